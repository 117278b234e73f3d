"""``resilient-ckpt inspect``: one checkpoint's manifest and every key with its shape and
dtype. The checkpoint shown is verified first (every checksum; ``--fast``: sizes only, and the
output says so). Without ``--step`` it is the newest valid checkpoint, and a newer one skipped
as corrupt is named on stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from . import reader
from .catalog import Depth, Entry, Status
from .cli_format import (
    CORRUPT,
    fmt_metrics,
    fmt_size,
    local_time,
    print_json,
    status_text,
)
from .cli_scan import (
    NOT_LOADED,
    newer_without_manifest,
    no_checkpoints,
    node_part_note,
    public,
    resolve,
    row,
    scan,
)
from .dtype_codes import dtype_name
from .errors import CheckpointError
from .layout_meta import (
    SHARED_STRUCTURE,
    TAG,
    is_dcp_dropin,
    json_object,
    shared_meta,
    shared_refs,
)
from .part_names import PARTS_EXTRA, part_dir
from .reader import describe
from .zero_index import zero_part_ids, zero_tensors

_SCALARS = (bool, int, float, str, type(None))
WIDE = 60  # the widest key the key column is padded to


def _value(path: str, v: Any, type_: str | None = None) -> dict[str, Any]:
    """A plain value, typed: JSON numbers, booleans, strings and null stay what they are."""
    t = type_ or ("null" if v is None else type(v).__name__)
    return {"key": path, "kind": "value", "type": t, "value": v}


def walk(
    node: Any,
    meta: dict[str, tuple[str, list[int]]],
    path: str,
    out: list[dict],
    parts: Mapping[str, Any] | None = None,
) -> None:
    """Flatten an encoded structure (see :mod:`.structure`) into one entry per key; a FilePart
    by what its ``describe()`` recorded in the manifest (``parts``)."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            walk(v, meta, f"{path}[{i}]", out, parts)
        return
    if not isinstance(node, dict):
        out.append(_value(path, node if isinstance(node, _SCALARS) else repr(node)))
        return
    tag = node.get(TAG)
    if tag is None:
        for k, v in node.items():
            walk(v, meta, f"{path}.{k}" if path else k, out, parts)
    elif tag == "tensor":
        dtype, shape = meta.get(node["key"], (None, None))
        out.append(
            {
                "key": path,
                "kind": "tensor",
                "dtype": dtype,
                "shape": shape,
                "stored_as": node["key"],
            }
        )
    elif tag == "stateful":
        out.append({"key": path, "kind": "object", "type": node["type"]})
        walk(node["state"], meta, path, out, parts)
    elif tag in ("tuple", "set", "frozenset", "size"):
        for i, v in enumerate(node["items"]):
            walk(v, meta, f"{path}[{i}]", out, parts)
    elif tag == "dict":
        for k, v in node["items"]:
            walk(v, meta, f"{path}[{k!r}]", out, parts)
    elif tag == "float":  # non-finite: kept as its repr ("nan", "inf", "-inf")
        out.append(_value(path, node["value"], "float"))
    elif tag == "np":
        inner = node["value"]
        out.append(_value(path, inner if isinstance(inner, _SCALARS) else repr(inner)))
        out[-1]["type"] = f"numpy {node.get('dtype', '?')}"
    elif tag in ("dtype", "device"):
        out.append(_value(path, node.get("name"), tag))
    elif tag == "bytes":
        out.append(_value(path, f"<{len(node.get('b64', '')) * 3 // 4} bytes>", "bytes"))
    elif tag == "filepart":
        _part(node["id"], (parts or {}).get(node["id"]), path, out)
    elif tag == "per_rank":
        out.append({"key": path, "kind": "per-rank", "value": "stored in rank_*.json"})
    else:
        out.append({"key": path, "kind": str(tag), "value": json.dumps(node)[:80]})


def _part(part_id: str, described: Any, path: str, out: list[dict]) -> None:
    """A FilePart's entries: one per tensor when its describe() recorded an index of them
    (``{"tensors": {name: {"dtype", "shape", "chunks"}}}``, as ``dcp.Sharded`` does, and as
    :func:`_keys` adds for a DeepSpeed ZeroPart from its ranks' indexes; the whole tensor's
    shape, and in how many rank-written chunks it is stored), else one line."""
    described = described if isinstance(described, dict) else {}
    tensors = described.get("tensors")
    if not isinstance(tensors, dict):
        fmt = described.get("format", "?")
        out.append({"key": path, "kind": "part", "value": f"part {part_id!r} ({fmt})"})
        return
    for name, t in tensors.items():
        t = t if isinstance(t, dict) else {}
        chunks = t.get("chunks")
        out.append(
            {
                "key": f"{path}.{name}",
                "kind": "tensor",
                "dtype": _dtype_name(t.get("dtype")),
                "shape": t.get("shape"),
                "stored_as": part_dir(part_id),
                "chunks": len(chunks) if isinstance(chunks, list) else None,
            }
        )
    plain = described.get("plain")  # dcp.Sharded: tensors not sharded, in every rank's file
    for name, (dtype, shape) in sorted(plain.items()) if isinstance(plain, dict) else ():
        out.append(
            {
                "key": f"{path}.{name}",
                "kind": "tensor",
                "dtype": _dtype_name(dtype),
                "shape": shape,
                "stored_as": f"{part_dir(part_id)} (every rank)",
                "chunks": None,
            }
        )


def _dtype_name(code: Any) -> Any:
    """A tensor's dtype as torch names it (``float32``), as for the checkpoint's own tensors
    (:func:`.tensor_headers.tensor_meta`): parts record safetensors codes (``F32``)."""
    return dtype_name(code) if isinstance(code, str) else code


def _keys(e: Entry) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The keys of a checkpoint, or why they cannot be read."""
    if e.manifest is not None and is_dcp_dropin(e.manifest):
        from .dcp import dropin

        try:
            return dropin.keys(e.path, e.manifest), None
        except (OSError, CheckpointError) as err:
            return None, f"cannot read the keys ({type(err).__name__}: {err})"
    where = os.path.join(e.path, SHARED_STRUCTURE)
    try:
        with open(where, "rb") as f:
            doc = json_object(f.read(), where)
        refs = shared_refs(doc, e.path)
    except CheckpointError:  # (an OSError too) what the status line says (_no_structure)
        return None, f"cannot read the keys: {SHARED_STRUCTURE} is corrupt"
    except OSError as err:
        return None, f"cannot read the keys ({type(err).__name__}: {err})"
    try:
        struct = doc["structure"]
        if e.manifest is None:
            return None, "cannot read the keys (no manifest)"
        meta = shared_meta(e.path, e.manifest, refs)
    except (OSError, ValueError, KeyError, TypeError, CheckpointError) as err:
        return None, f"cannot read the keys ({type(err).__name__}: {err})"
    keys: list[dict[str, Any]] = []
    parts = e.manifest.extra.get(PARTS_EXTRA) if e.manifest is not None else None
    parts = dict(parts) if isinstance(parts, dict) else None
    if parts and e.manifest is not None:
        try:  # a ZeroPart's tensors are listed in its ranks' indexes, not in the manifest
            for part_id in zero_part_ids(e.manifest):
                tensors = zero_tensors(e.path, e.manifest, part_id, parts[part_id])
                parts[part_id] = {**parts[part_id], "tensors": tensors}
        except (OSError, ValueError, KeyError, TypeError, CheckpointError) as err:
            return None, f"cannot read the ZeRO ranges ({type(err).__name__}: {err})"
    walk(struct, meta, "", keys, parts)
    return keys, None


def _no_structure(e: Entry) -> bool:
    """Whether a checkpoint found valid holds a structure file that is no structure (not JSON,
    no object, naming none: no reader loads it, whatever its checksums), marked corrupt."""
    if e.status is not Status.VALID or e.manifest is None or is_dcp_dropin(e.manifest):
        return False
    where = os.path.join(e.path, SHARED_STRUCTURE)
    try:
        with open(where, "rb") as f:
            shared_refs(json_object(f.read(), where), e.path)
    except CheckpointError as err:  # (an OSError too: first)
        e.status, e.problem = Status.CORRUPT, str(err)
        return True
    except OSError:  # unreadable: said where its keys are ("cannot read the keys")
        return False
    return False


def _choose(args: argparse.Namespace, depth: Depth) -> tuple[Entry, list[Entry]]:
    """The checkpoint to show, and the newer ones skipped because they are corrupt."""
    target = resolve(args.dir)
    entries = reader.committed(target.root)
    if target.only is not None:
        # a copy of the user's (step_N.bak) is no checkpoint of the directory: checked alone
        entries = [e for e in entries if e.name == target.only] or scan(target, Depth.NONE)
    if not entries:
        raise no_checkpoints(target.root)
    if target.only is not None or args.step is not None:
        # A named checkpoint is shown as it is, corrupt or not (the exit code says which).
        found = reader.check(reader.find(entries, target.root, args.step, target.only), depth)
        _no_structure(found)
        return found, []
    while True:  # (one found to hold no structure is skipped as a corrupt one is)
        sel = reader.newest_valid(entries, target.root, depth)
        if not _no_structure(sel.entry):
            return sel.entry, list(sel.skipped)


def inspect(args: argparse.Namespace) -> int:
    depth = Depth.SIZE if args.fast else Depth.FULL
    e, skipped = _choose(args, depth)
    for s in skipped:
        print(
            f"resilient-ckpt inspect: skipped {describe(s)}: corrupt: {s.problem}", file=sys.stderr
        )
    torn = newer_without_manifest(args.dir, e.step) if args.step is None else []
    for name in torn:
        print(f"resilient-ckpt inspect: skipped {name}: {NOT_LOADED}", file=sys.stderr)
    if skipped or torn:
        print(
            f"resilient-ckpt inspect: showing {describe(e)}, the newest "
            f"{'valid' if depth is Depth.FULL else 'size-checked'} checkpoint",
            file=sys.stderr,
        )
    m = e.manifest
    info = public(row(e, depth))
    keys, keys_problem = _keys(e) if m is not None else (None, f"unknown: {e.problem}")
    info |= {
        "world_size": m.world_size if m else None,
        "versions": dict(m.versions) if m else {},
        "files": [dict(f.__dict__) for f in m.files] if m else [],
        "blobs": [dict(b.__dict__) for b in m.blobs] if m else [],
        "keys": keys,
        "keys_problem": keys_problem,
    }
    code = 1 if info["status"] == CORRUPT else 0
    if args.json:
        print_json(info)
        return code
    state = status_text(info["status"], info["checked"])
    if info["status"] == CORRUPT:
        state = f"{state}: {e.problem}"
    elif info["checked"] != "checksums":
        state += " (--fast: checksums not read)"
    print(f"{e.name}: step {info['step']}, {state}")
    if m is None:
        return code
    print(f"  run:       {m.run_id}, world size {m.world_size}, commit #{m.seq}")
    print(f"  saved:     {local_time(m.created)} ({m.reason})")
    print(f"  metrics:   {fmt_metrics(m.metrics)}")
    print(f"  versions:  {', '.join(f'{k} {v}' for k, v in m.versions.items()) or '-'}")
    print(f"  files:     {len(m.files)}, {fmt_size(m.total_bytes)}")
    fwidth = max([len(fe.path) for fe in m.files] + [28])
    for fe in m.files:
        print(
            f"    {fe.path:{fwidth}} {fmt_size(fe.size):>9}  xxh3_64 {fe.xxh3_64}  (rank {fe.rank})"
        )
    if m.blobs:
        print(
            f"  blobs:     {len(m.blobs)}, {fmt_size(m.blob_bytes)} in the run's blob store "
            "(incremental: stored once for every checkpoint naming them; not in files above)"
        )
    if keys is None:
        print(f"  keys:      {keys_problem}")
        return code
    print(f"  keys:      {len(keys)}")
    # a key longer than WIDE is printed whole, its row's columns pushed right: not every row
    # padded to it (one 600-character key made each line of the listing 800 wide)
    width = max([len(k["key"]) for k in keys if len(k["key"]) <= WIDE] + [20])
    dwidth = max([len(str(k.get("dtype") or "?")) for k in keys if k["kind"] == "tensor"] + [9])
    for k in keys:
        if k["kind"] == "tensor":
            shape = k["shape"] if k["shape"] is not None else "?"
            chunks = f"  ({k['chunks']} chunks)" if k.get("chunks", 1) not in (None, 1) else ""
            print(f"    {k['key']:{width}}  {k['dtype'] or '?':{dwidth}} {shape}{chunks}")
        elif k["kind"] == "object":
            print(f"    {k['key']:{width}}  <{k['type']}>")
        else:
            text = json.dumps(k.get("value")) if k["kind"] == "value" else str(k.get("value"))
            print(f"    {k['key']:{width}}  {text if len(text) < 80 else text[:77] + '...'}")
    if note := node_part_note([info]):  # its files and keys are this node's ranks' only
        print(f"\n{note}")
    return code
