"""``resilient-ckpt``: look at, verify and clean a checkpoint directory.

    resilient-ckpt ls DIR [--json] [--fast] [--remote URL [-o KEY=VALUE ...]]
    resilient-ckpt verify DIR [--step N]
    resilient-ckpt inspect DIR --step N [--json]
    resilient-ckpt gc DIR [--dry-run] [--remove-corrupt] [--keep-last N]
    resilient-ckpt pull URL DIR [--step N] [-o KEY=VALUE ...]
    resilient-ckpt push DIR URL [--step N] [-o KEY=VALUE ...]
    resilient-ckpt export DIR OUT [--step N] [--force]   (Hugging Face from_pretrained dir)

``-o`` passes an fsspec option for the remote store (``-o endpoint_url=http://...``; a value
that parses as JSON is used as JSON: ``-o 'client_kwargs={"region_name": "eu-west-1"}'``).

Exit codes: 0 success; 1 a checkpoint is bad (verify) or the command failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from . import catalog
from .catalog import Depth, Entry, Status
from .commit import remove_checkpoint
from .errors import CheckpointError
from .layout import SHARED_STRUCTURE, SHARED_TENSORS
from .lock import DirLock
from .manifest import read_manifest
from .retention import Plan, RetentionPolicy, plan
from .structure import TAG
from .tensorfile import tensor_meta


def _fmt_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def _current(entries: list[Entry]) -> Entry | None:
    valid = [e for e in entries if e.status is Status.VALID and e.manifest is not None]
    return valid[-1] if valid else None


def _plan(entries: list[Entry], policy: RetentionPolicy | None = None) -> tuple[Plan, str | None]:
    newest = _current(entries)
    run_id = newest.manifest.run_id if newest and newest.manifest else None
    if policy is None:
        policy = RetentionPolicy()
        if newest is not None and newest.manifest is not None and newest.manifest.retention:
            policy = RetentionPolicy.from_json(newest.manifest.retention)
    cands = catalog.retention_candidates(entries)
    return plan(cands, policy, run_id), run_id


def _row(e: Entry, p: Plan) -> dict[str, Any]:
    m = e.manifest
    if e.status is Status.INCOMPLETE:
        kept = "not kept: removed when the next writer opens the directory, or by gc"
    elif e.name in p.keep:
        kept = "; ".join(p.keep[e.name])
    else:
        kept = "not kept: gc would delete it"
    return {
        "name": e.name,
        "step": e.step,
        "status": str(e.status),
        "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)) if m else None,
        "bytes": m.total_bytes if m else None,
        "run_id": m.run_id if m else None,
        "metrics": m.metrics if m else {},
        "kept": kept,
        "problem": e.problem,
        "path": e.path,
    }


def _remote_options(pairs: list[str] | None) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CheckpointError(f"-o {pair!r}: expected KEY=VALUE")
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts


def _store(url: str, pairs: list[str] | None) -> Any:
    from .remote import RemoteStore

    return RemoteStore(url, _remote_options(pairs))


def _tiers(entries: list[Entry], rows: list[dict[str, Any]], store: Any) -> None:
    """Add a ``tier`` to each row (local-only, uploading, both) and rows for remote-only
    checkpoints."""
    remote = store.scan()
    by_key = {e.key: e for e in remote if e.key is not None and e.problem is None}
    torn = {e.name for e in remote if e.manifest is None}
    seen = set()
    for e, r in zip(entries, rows, strict=True):
        key = (e.manifest.run_id, e.manifest.seq) if e.manifest else None
        if key in by_key:
            r["tier"] = "both"
            seen.add(key)
        elif e.name in torn:
            r["tier"] = "uploading"  # or an upload a crash cut off: re-sent by the next run
        else:
            r["tier"] = "local-only"
    for k, re_ in by_key.items():
        if k in seen:
            continue
        m = re_.manifest
        rows.append(
            {
                "name": re_.name,
                "step": m.step,
                "status": "valid",
                "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)),
                "bytes": m.total_bytes,
                "run_id": m.run_id,
                "metrics": m.metrics,
                "kept": f"remote only: {store.url}/{re_.name}",
                "problem": None,
                "path": f"{store.url}/{re_.name}",
                "tier": "remote",
            }
        )
    rows.sort(key=lambda r: r["step"] if r["step"] is not None else -1)


def cmd_ls(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir) and not args.remote:
        print(f"resilient-ckpt: {args.dir}: no such directory", file=sys.stderr)
        return 1
    entries = catalog.scan(args.dir, Depth.SIZE if args.fast else Depth.FULL)
    p, _ = _plan(entries)
    rows = [_row(e, p) for e in entries]
    if args.remote:
        _tiers(entries, rows, _store(args.remote, args.option))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints in {args.dir}" + (f" or {args.remote}" if args.remote else ""))
        return 0
    tier = f"{'TIER':10}  " if args.remote else ""
    print(
        f"{'STEP':>10}  {'TIME':19}  {'SIZE':>9}  {'STATUS':10}  {tier}{'RUN':16}  KEPT / PROBLEM"
    )
    for r in rows:
        size = _fmt_size(r["bytes"]) if r["bytes"] is not None else "-"
        note = r["problem"] if r["status"] != "valid" else r["kept"]
        t = f"{r.get('tier', '-'):10}  " if args.remote else ""
        print(
            f"{r['step'] if r['step'] is not None else '?':>10}  {r['time'] or '-':19}  "
            f"{size:>9}  {r['status']:10}  {t}{r['run_id'] or '-':16}  {note}"
        )
    return 0


def _locked(path: str, what: str) -> DirLock | None:
    os.makedirs(path, exist_ok=True)
    lock = DirLock(path)
    try:
        lock.acquire()
    except CheckpointError as err:
        print(
            f"resilient-ckpt {what}: {err} (a running trainer syncs this directory itself)",
            file=sys.stderr,
        )
        return None
    return lock


def cmd_pull(args: argparse.Namespace) -> int:
    from .commit import fsync_dir

    store = _store(args.url, args.option)
    remote = [e for e in store.scan() if e.manifest is not None]
    if args.step is not None:
        remote = [e for e in remote if e.manifest.step == args.step]
    usable = [e for e in remote if e.problem is None]
    if not usable:
        what = f"no checkpoint of step {args.step}" if args.step is not None else "no checkpoints"
        print(f"resilient-ckpt pull: {what} in {args.url}", file=sys.stderr)
        return 1
    entry = usable[-1]
    lock = _locked(args.dir, "pull")
    if lock is None:
        return 1
    try:
        final = os.path.join(args.dir, entry.name)
        if os.path.exists(os.path.join(final, "manifest.json")):
            m = read_manifest(final)
            if (m.run_id, m.seq) == entry.key:
                try:
                    catalog.verify(final, m, Depth.FULL)
                    print(f"{entry.name} (step {m.step}) is already in {args.dir}, verified")
                    return 0
                except CheckpointError:
                    remove_checkpoint(final)
            else:
                print(
                    f"resilient-ckpt pull: {final} holds another checkpoint; refusing to "
                    "overwrite it (pull into an empty directory)",
                    file=sys.stderr,
                )
                return 1
        staging, name = store.download(entry, args.dir, progress=None)
        os.rename(staging, final)
        fsync_dir(args.dir)
        print(
            f"pulled {store.url}/{name} (step {entry.manifest.step}, "
            f"{_fmt_size(entry.manifest.total_bytes)}) -> {final}, every checksum verified"
        )
        return 0
    finally:
        lock.release()


def cmd_push(args: argparse.Namespace) -> int:
    from .progress import Progress

    store = _store(args.url, args.option)
    lock = _locked(args.dir, "push")
    if lock is None:
        return 1
    try:
        local = [
            e
            for e in catalog.committed(catalog.scan(args.dir, Depth.FULL))
            if args.step is None or e.step == args.step
        ]
        if not local:
            print(f"resilient-ckpt push: no checkpoints to push in {args.dir}", file=sys.stderr)
            return 1
        remote = {e.key for e in store.scan() if e.key is not None and e.problem is None}
        failed = 0
        for e in local:
            if e.status is not Status.VALID or e.manifest is None:
                print(f"skipped {e.name}: {e.problem}")
                failed += 1
                continue
            if (e.manifest.run_id, e.manifest.seq) in remote:
                print(f"{e.name} (step {e.step}) is already in {store.url}")
                continue
            bar = Progress(e.manifest.total_bytes, f"pushing {e.name}")
            try:
                store.upload(e.path, e.manifest, e.name, bar)
            finally:
                bar.close()
            print(f"pushed {e.name} (step {e.step}, {_fmt_size(e.manifest.total_bytes)})")
        return 1 if failed else 0
    finally:
        lock.release()


def _select(entries: list[Entry], step: int | None) -> list[Entry]:
    committed = catalog.committed(entries)
    if step is None:
        return committed
    return [e for e in committed if e.step == step]


def cmd_verify(args: argparse.Namespace) -> int:
    entries = catalog.scan(args.dir, Depth.FULL)
    chosen = _select(entries, args.step)
    if not chosen:
        what = f"no checkpoint of step {args.step}" if args.step is not None else "no checkpoints"
        print(f"resilient-ckpt verify: {what} in {args.dir}", file=sys.stderr)
        return 1
    bad = 0
    for e in chosen:
        if e.status is Status.VALID:
            print(f"ok       step {e.step:>10}  {e.name}")
        else:
            bad += 1
            print(
                f"CORRUPT  step {e.step if e.step is not None else '?':>10}  {e.name}: {e.problem}"
            )
    if bad:
        print(f"{bad} of {len(chosen)} checkpoint(s) failed verification", file=sys.stderr)
        return 1
    return 0


def _walk(
    node: Any, meta: dict[str, tuple[str, list[int]]], path: str, out: list[dict[str, Any]]
) -> None:
    if isinstance(node, list):
        for i, v in enumerate(node):
            _walk(v, meta, f"{path}[{i}]", out)
        return
    if not isinstance(node, dict):
        text = repr(node)
        out.append(
            {"key": path, "kind": "value", "value": text if len(text) < 80 else text[:77] + "..."}
        )
        return
    tag = node.get(TAG)
    if tag is None:
        for k, v in node.items():
            _walk(v, meta, f"{path}.{k}" if path else k, out)
    elif tag == "tensor":
        dtype, shape = meta.get(node["key"], ("?", []))
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
        _walk(node["state"], meta, path, out)
    elif tag in ("tuple", "set", "frozenset", "size"):
        for i, v in enumerate(node["items"]):
            _walk(v, meta, f"{path}[{i}]", out)
    elif tag == "dict":
        for k, v in node["items"]:
            _walk(v, meta, f"{path}[{k!r}]", out)
    elif tag == "per_rank":
        out.append({"key": path, "kind": "per-rank", "value": "stored in rank_*.json"})
    else:
        out.append({"key": path, "kind": tag, "value": json.dumps(node)[:80]})


def cmd_inspect(args: argparse.Namespace) -> int:
    entries = catalog.scan(args.dir, Depth.SIZE)
    chosen = _select(entries, args.step)
    if not chosen:
        print(
            f"resilient-ckpt inspect: no checkpoint of step {args.step} in {args.dir}",
            file=sys.stderr,
        )
        return 1
    e = chosen[-1]
    m = e.manifest
    assert m is not None
    with open(os.path.join(e.path, SHARED_STRUCTURE), "rb") as f:
        struct = json.loads(f.read())["structure"]
    meta = tensor_meta(os.path.join(e.path, SHARED_TENSORS))
    keys: list[dict[str, Any]] = []
    _walk(struct, meta, "", keys)
    info = {
        "name": e.name,
        "step": m.step,
        "status": str(e.status),
        "problem": e.problem,
        "run_id": m.run_id,
        "created": m.created,
        "world_size": m.world_size,
        "reason": m.reason,
        "metrics": m.metrics,
        "versions": m.versions,
        "files": [f.__dict__ for f in m.files],
        "keys": keys,
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(
        f"{e.name}: step {m.step}, {e.status}, run {m.run_id}, world size {m.world_size}, "
        f"saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.created))} ({m.reason})"
    )
    if e.problem:
        print(f"  problem: {e.problem}")
    print(f"  metrics: {json.dumps(m.metrics)}")
    print(f"  versions: {json.dumps(m.versions)}")
    print("  files:")
    for fe in m.files:
        print(f"    {fe.path:28} {_fmt_size(fe.size):>9}  xxh3_64 {fe.xxh3_64}  (rank {fe.rank})")
    print("  keys:")
    for k in keys:
        if k["kind"] == "tensor":
            print(f"    {k['key']:60} {k['dtype']:9} {k['shape']}")
        elif k["kind"] == "object":
            print(f"    {k['key']:60} <{k['type']}>")
        else:
            print(f"    {k['key']:60} {k.get('value', '')}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        print(f"resilient-ckpt: {args.dir}: no such directory", file=sys.stderr)
        return 1
    lock = DirLock(args.dir)
    if not args.dry_run:
        try:
            lock.acquire()
        except CheckpointError as err:
            print(f"resilient-ckpt gc: {err}", file=sys.stderr)
            return 1
    try:
        entries = catalog.scan(args.dir, Depth.FULL if args.remove_corrupt else Depth.SIZE)
        policy = None
        if args.keep_last is not None:
            newest = _current(entries)
            base = (
                RetentionPolicy.from_json(newest.manifest.retention)
                if newest and newest.manifest and newest.manifest.retention
                else RetentionPolicy()
            )
            policy = RetentionPolicy(
                keep_last=args.keep_last,
                keep_best=base.keep_best,
                monitor=base.monitor,
                mode=base.mode,
                keep_every_n_steps=base.keep_every_n_steps,
            )
        p, run_id = _plan(entries, policy)
        doomed: list[tuple[Entry, str]] = []
        for e in entries:
            if e.status is Status.INCOMPLETE:
                doomed.append((e, "incomplete (no manifest)"))
            elif e.name in p.delete:
                doomed.append((e, "not kept by retention"))
            elif args.remove_corrupt and e.status is Status.CORRUPT:
                doomed.append((e, f"corrupt: {e.problem}"))
        verb = "would delete" if args.dry_run else "deleted"
        for e, why in doomed:
            if not args.dry_run:
                if e.status is Status.INCOMPLETE:
                    shutil.rmtree(e.path)
                else:
                    remove_checkpoint(e.path)
            print(f"{verb} {e.name} (step {e.step}): {why}")
        kept = [e for e in entries if e not in [d for d, _ in doomed]]
        print(
            f"{len(doomed)} {'would be deleted' if args.dry_run else 'deleted'}, {len(kept)} kept"
            + (f" (current run {run_id})" if run_id else "")
        )
        return 0
    finally:
        lock.release()


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """The ``export`` command's arguments (also ``python -m resilient_callbacks.transformers``)."""
    p.add_argument("dir", help="a ResilientCheckpoint directory, or one checkpoint in it")
    p.add_argument("out", help="the directory to write (must not exist, unless --force)")
    p.add_argument("--step", type=int, help="export this step (default: the newest valid one)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")


def cmd_export(args: argparse.Namespace) -> int:
    try:
        from .transformers.export import cli_export
    except ImportError as e:
        print(
            f"resilient-ckpt export: needs transformers ({e}); "
            "pip install 'resilient-callbacks[transformers]'",
            file=sys.stderr,
        )
        return 1
    return int(cli_export(args))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="resilient-ckpt", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ls", help="list checkpoints with status and why each is kept")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--fast", action="store_true", help="check sizes only, not checksums")
    p.add_argument("--remote", help="also list this remote tier (fsspec URL)")
    p.add_argument("-o", "--option", action="append", help="remote option KEY=VALUE")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("verify", help="check every file's size and checksum")
    p.add_argument("dir")
    p.add_argument("--step", type=int, help="verify only this step")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("inspect", help="show a checkpoint's keys, shapes, dtypes and metrics")
    p.add_argument("dir")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("gc", help="delete what retention does not keep, and leftovers")
    p.add_argument("dir")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    p.add_argument("--remove-corrupt", action="store_true", help="also delete corrupt checkpoints")
    p.add_argument("--keep-last", type=int, help="override the keep_last recorded in the manifests")
    p.set_defaults(fn=cmd_gc)
    p = sub.add_parser("pull", help="download a remote checkpoint (newest, or --step), verified")
    p.add_argument("url")
    p.add_argument("dir")
    p.add_argument("--step", type=int)
    p.add_argument("-o", "--option", action="append", help="remote option KEY=VALUE")
    p.set_defaults(fn=cmd_pull)
    p = sub.add_parser("push", help="upload the local checkpoints the remote does not have")
    p.add_argument("dir")
    p.add_argument("url")
    p.add_argument("--step", type=int)
    p.add_argument("-o", "--option", action="append", help="remote option KEY=VALUE")
    p.set_defaults(fn=cmd_push)
    p = sub.add_parser(
        "export", help="write a Transformers checkpoint as a from_pretrained directory"
    )
    add_export_arguments(p)
    p.set_defaults(fn=cmd_export)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CheckpointError as e:
        print(f"resilient-ckpt: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. piped into head
        return 0
    except OSError as e:  # the remote store failed (unreachable, missing bucket, ...)
        print(f"resilient-ckpt: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
