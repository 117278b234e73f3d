"""Consolidated fp32 weights from a DeepSpeed checkpoint, without DeepSpeed (and without
``zero_to_fp32.py``): ``resilient-ckpt export DIR OUT`` on a checkpoint written by
:mod:`resilient_callbacks.deepspeed` (and, through :mod:`.dcp.whole`, the whole model tensors
of a ``dcp.Sharded`` part).

At ZeRO stages 1-3 every rank saved its ranges of each flattened parameter in fp32 (see
``deepspeed/views.py``); here the ranges of all ranks are read, verified, and laid side by side
into full tensors, each range checked to cover its parameter exactly once. At stage 0 the
module was saved whole, as trained (its dtype is kept). The result is one
``model.safetensors`` (names as in ``engine.module.named_parameters()``) and an
``export.json`` saying where it came from.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors.torch import save_file

from . import reader, structure, structure_decode
from .commit import ensure_dir, fsync_dir, fsync_tree
from .errors import CheckpointCorruptError, CheckpointMismatchError, ConfigError
from .export_target import EXPORT_MARKER, check_export_target
from .layout import LoadedPart
from .layout_meta import is_dcp_dropin
from .manifest import Manifest, read_manifest
from .part_names import PARTS_EXTRA, parts_of_format
from .part_reads import read_part_tensors
from .wrapped import plain_name
from .zero_index import zero_indexes, zero_part_ids

SHARDED_FORMAT = "resilient_callbacks.dcp.sharded/1"  # dcp.Sharded's parts


def sharded_part_ids(manifest: Manifest) -> list[str]:
    """The parts of a checkpoint written by ``dcp.Sharded``: told apart without importing
    :mod:`resilient_callbacks.dcp`, which needs a newer torch than exporting other checkpoints."""
    return parts_of_format(manifest, SHARDED_FORMAT)


def is_deepspeed(manifest: Manifest, path: str) -> bool:
    """Whether the checkpoint at ``path`` was written by ``resilient_callbacks.deepspeed``."""
    if zero_part_ids(manifest):
        return True
    return _holds_engine(reader.open_checkpoint(path).part.structure)


def _holds_engine(structure_: Any) -> bool:
    """Whether a checkpoint's structure holds a stage-0 DeepSpeed engine's state."""
    engine = structure_.get("engine") if isinstance(structure_, dict) else None
    return isinstance(engine, dict) and "counters" in engine and "module" in engine


def exports_weights(manifest: Manifest, path: str) -> bool:
    """Whether ``export`` writes consolidated weights of the checkpoint at ``path``: one of
    ``resilient_callbacks.deepspeed``, one holding a ``dcp.Sharded`` part (FSDP, tensor
    parallelism), outside a Transformers Trainer run (a Trainer's checkpoint, under DeepSpeed or
    FSDP too, exports as a ``from_pretrained`` directory), or one of ``dcp.save`` through
    ``ResilientStorageWriter``."""
    if is_dcp_dropin(manifest):
        return True  # dcp.save's state dict: every tensor whole
    part = reader.open_checkpoint(path).part  # opened once for every question
    full = part.structure
    if isinstance(full, dict) and "trainer" in full:
        # a Trainer run (under DeepSpeed or FSDP too): a from_pretrained directory, unless its
        # model records no configuration (a plain torch module): then its weights
        full = structure_decode.inline_per_rank(full, part.per_rank)
        info = trainer_model_info(full, part.tensors)
        return not (info and info.get("config"))
    return (
        bool(zero_part_ids(manifest))
        or _holds_engine(full)
        or bool(sharded_part_ids(manifest))
        or _is_lightning(full)
    )


def trainer_model_info(full: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """What a Transformers Trainer run's checkpoint (its inlined structure ``full``) records of
    its model: class, ``config`` (as ``from_pretrained`` needs; a plain ``torch.nn.Module``
    trained by the Trainer has none), PEFT adapters; None if nothing."""
    values = structure_decode.decode(full["trainer"], tensors)
    info = values.get("model") if isinstance(values, dict) else None
    return info if isinstance(info, dict) else None


def _is_lightning(full: Any) -> bool:
    """A checkpoint of the Lightning callback: the LightningModule's ``state_dict`` beside
    Lightning's own state."""
    return isinstance(full, dict) and "lightning" in full and "state_dict" in full


def consolidate_zero(path: str, manifest: Manifest, part_id: str) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's ranges of ZeroPart ``part_id``, verified: the trained
    ones' fp32 masters and, at ZeRO 3, the frozen ones as saved."""
    entries = {f.path: f for f in manifest.files}
    out: dict[str, torch.Tensor] = {}  # name -> the flattened parameter being filled
    shapes: dict[str, list[int]] = {}
    filled: dict[str, int] = {}
    for rel, index in zero_indexes(path, manifest, part_id):
        st_rel = rel[: -len(".json")] + ".safetensors"
        if st_rel not in entries:
            raise CheckpointCorruptError(f"{path}: the manifest does not list {st_rel}")
        tensors = read_part_tensors(path, manifest, entries[st_rel])
        # the trained parameters' fp32 masters, and at ZeRO 3 the frozen ones' partitions
        for section, key in (("params", "fp32"), ("frozen", "frozen")):
            for name, rng in (index.get(section) or {}).items():
                shapes[name] = [int(d) for d in rng["shape"]]
                if not rng["numel"]:
                    continue
                src = tensors[f"{key}/{name}"]
                full = out.setdefault(name, torch.zeros(math.prod(shapes[name]), dtype=src.dtype))
                full.narrow(0, int(rng["start"]), int(rng["numel"])).copy_(src)
                filled[name] = filled.get(name, 0) + int(rng["numel"])
    result: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        flat = out.get(name, torch.zeros(math.prod(shape), dtype=torch.float32))
        if filled.get(name, 0) != flat.numel():
            raise CheckpointCorruptError(
                f"{path}: parameter {name!r}: the ranks' ranges cover {filled.get(name, 0)} of "
                f"its {flat.numel()} values"
            )
        result[name] = flat.reshape(shape)
    return result


def consolidated(path: str, part: LoadedPart | None = None) -> dict[str, torch.Tensor]:
    """The model weights of the checkpoint at ``path``: a DeepSpeed one's (the trained parameters
    in fp32 at ZeRO 1-3, with the frozen parameters and persistent buffers as saved), or a
    ``dcp.Sharded`` part's whole model tensors (as saved), a Lightning run's LightningModule
    state dict (as saved), or every tensor of a ``dcp.save``
    through ``ResilientStorageWriter`` whole, by its DCP key. ``part``: its rank-0 part, if the
    caller opened it already (read and verified once, not twice)."""
    manifest = read_manifest(path)
    if is_dcp_dropin(manifest):
        from .dcp.dropin import whole_tensors

        return whole_tensors(path)
    parts = zero_part_ids(manifest)
    if parts:
        weights = consolidate_zero(path, manifest, parts[0])
        weights.update(_module_extras(part or reader.open_checkpoint(path).part))
        tied = manifest.extra.get(PARTS_EXTRA, {}).get(parts[0], {}).get("tied") or {}
        for name, owner in tied.items():  # a tied weight under each of its names
            if owner in weights and name not in weights:
                weights[name] = weights[owner].clone()
        return weights
    sharded = sharded_part_ids(manifest)
    if len(sharded) > 1:
        raise CheckpointMismatchError(
            f"{path} holds {len(sharded)} dcp.Sharded parts ({', '.join(sharded)}): name the "
            "one to export with --key"
        )
    if sharded:
        from .dcp.whole import model_tensors

        return model_tensors(path, manifest, sharded[0])
    part = part or reader.open_checkpoint(path).part
    full = structure_decode.inline_per_rank(part.structure, part.per_rank)
    model = None
    if _is_lightning(full):  # the LightningModule's state dict, as saved
        model = full["state_dict"]
    elif isinstance(full, dict) and "trainer" in full and "model" in full:
        model = full["model"]  # a Trainer run's model (no DeepSpeed, no FSDP), as saved
    if model is not None:
        module = structure_decode.decode(model, part.tensors)
        return {k: v.clone() for k, v in module.items() if isinstance(v, torch.Tensor)}
    engine = _find_engine(full)
    if engine is None or "module" not in engine:
        raise CheckpointMismatchError(
            f"{path} was not written by resilient_callbacks.deepspeed (no engine state)"
        )
    module = structure_decode.decode(engine["module"], part.tensors)
    return {k: v.clone() for k, v in module.items() if isinstance(v, torch.Tensor)}


def entry_tensors(path: str, key: str | None) -> tuple[str, dict[str, torch.Tensor]]:
    """A plain ``Checkpointer`` checkpoint's entry ``key`` (``"model"``; ``"train.model"`` in a
    nested dict) as ``{name: tensor}``: a module's state dict (a stateful entry) or a dict of
    tensors, by dotted names, or a ``dcp.Sharded`` part's model, whole. ``key=None``: the one
    module in the state, or an error naming the entries to choose from. Returns (key, tensors)."""
    part = reader.open_checkpoint(path).part
    full = structure_decode.inline_per_rank(part.structure, part.per_rank)
    if not isinstance(full, dict):
        raise CheckpointMismatchError(f"{path}: the saved state is not a dict of entries")
    if key is None:
        found = list(_modules(full, ""))
        if len(found) != 1:
            raise CheckpointMismatchError(
                f"{path}: {'no' if not found else 'more than one'} entry of the state is a "
                f"module's state dict ({', '.join(found) or 'entries: ' + ', '.join(full)}); "
                "name the one to export with --key"
            )
        key = found[0]
    node: Any = full
    for i, name in enumerate(key.split(".")):
        items = structure_decode._node_items(_state(node))
        if items is None or name not in items:
            where = ".".join(key.split(".")[:i]) or "the state"
            have = ", ".join(map(str, items)) if items else "no entries"
            raise CheckpointMismatchError(f"{path}: {where} has no entry {name!r} ({have})")
        node = items[name]
    if isinstance(node, dict) and node.get(structure.TAG) == "filepart":
        manifest = read_manifest(path)
        if node.get("id") not in sharded_part_ids(manifest):
            raise CheckpointMismatchError(f"{path}: the entry {key!r} is not a dcp.Sharded part")
        from .dcp.whole import model_tensors

        return key, model_tensors(path, manifest, str(node["id"]))  # its model, whole
    if isinstance(node, dict) and node.get(structure.TAG) == "stateful":
        items = structure_decode._node_items(node["state"]) or {}
        if not any(_is_tensor(v) for v in items.values()):  # an optimizer's, a scheduler's
            modules = ", ".join(_modules(full, ""))
            raise CheckpointMismatchError(
                f"{path}: the entry {key!r} is not a module's state dict (its state holds "
                f"{_what(node['state'])}): export writes model weights; name a module"
                + (f" ({modules})" if modules else "")
            )
    out: dict[str, torch.Tensor] = {}
    _flatten(structure_decode.decode(_state(node), part.tensors), "", out)
    if not out:
        raise CheckpointMismatchError(f"{path}: the entry {key!r} holds no tensors")
    return key, out


def _what(state: Any) -> str:
    """A few words on a saved state that is not a flat dict of tensors: its entries' names."""
    items = structure_decode._node_items(state)
    if not items:
        return "no entries"
    names = list(map(str, items))
    return "entries " + ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


def _state(node: Any) -> Any:
    stateful = isinstance(node, dict) and node.get(structure.TAG) == "stateful"
    return node["state"] if stateful else node


def _modules(node: Any, prefix: str) -> Iterator[str]:
    """The dotted keys of the modules' state dicts in a state's plain dicts, at any depth."""
    items = structure_decode._node_items(node)
    for k, n in (items or {}).items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if _is_state_dict(n):
            yield key
        elif structure_decode._node_items(n) is not None:
            yield from _modules(n, key)


def _is_state_dict(node: Any) -> bool:
    """A stateful entry whose state is a flat dict of tensors: a module's, not an optimizer's."""
    if not (isinstance(node, dict) and node.get(structure.TAG) == "stateful"):
        return False
    items = structure_decode._node_items(node["state"]) or {}
    return bool(items) and all(_is_tensor(v) for v in items.values())


def _is_tensor(node: Any) -> bool:
    return isinstance(node, dict) and node.get(structure.TAG) == "tensor"


def _flatten(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value.clone()
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)


def _module_extras(part: LoadedPart) -> dict[str, torch.Tensor]:
    """The ZeRO 1-3 engine's module tensors besides its partitions in a checkpoint's rank-0
    ``part``, by their state-dict names: its frozen parameters (at ZeRO 1-2,
    ``engine_state.module_extras``) and rank 0's persistent buffers (``RankBuffers``)."""
    full = structure_decode.inline_per_rank(part.structure, part.per_rank)
    engine = _find_engine(full)
    if engine is None:
        return {}
    out: dict[str, torch.Tensor] = {}
    if "module_extras" in engine:  # (older checkpoints hold the buffers here too: "buffer/")
        extras = structure_decode.decode(engine["module_extras"], part.tensors)
        for k, v in extras.items():
            if isinstance(v, torch.Tensor) and k.startswith(("frozen/", "buffer/")):
                out[k.split("/", 1)[1]] = v.clone()
    if "buffers" in engine:  # each rank's own persistent buffers: rank 0's
        buffers = structure_decode.decode(engine["buffers"], part.tensors)
        out.update({k: v.clone() for k, v in buffers.items() if isinstance(v, torch.Tensor)})
    return out


def _find_engine(full: Any) -> dict[str, Any] | None:
    """The DeepSpeed engine's state in a checkpoint's tree: under ``"engine"`` (the DeepSpeed
    adapter, the Trainer under DeepSpeed)."""
    engine = full.get("engine") if isinstance(full, dict) else None
    return engine if isinstance(engine, dict) else None


def export_staging(out: str) -> str:
    """A new, empty directory beside ``out`` to write an export into before it is renamed to
    ``out``, with the mode ``makedirs`` gives (the umask applied), not ``mkdtemp``'s 0700: a
    serving process of another user reads the export."""
    parent = os.path.dirname(os.path.abspath(out))
    ensure_dir(parent)  # (created: its name durable, else a power loss takes the export away)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.export-", dir=parent)
    os.chmod(staging, 0o777 & ~_umask())
    return staging


def publish_export(staging: str, out: str) -> None:
    """Give the files in ``staging`` the mode an ordinary new file gets (the umask applied:
    safetensors writes 0600, which another user's serving process cannot read), then put it in
    place of ``out``; an ``out`` that exists is moved aside first and removed after. Durable:
    every file and folder is fsynced before the rename, the parent after it and before the old
    export is removed (a power loss leaves the old export or the whole new one)."""
    mode = 0o666 & ~_umask()
    for root, _, files in os.walk(staging):
        for name in files:
            os.chmod(os.path.join(root, name), mode)
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # (safetensors' save_file does not)
            finally:
                os.close(fd)
    fsync_tree(staging)
    old = None
    if os.path.exists(out):
        old = os.path.join(
            os.path.dirname(out), f".{os.path.basename(out)}.old-{uuid.uuid4().hex[:8]}"
        )
        os.rename(out, old)
    os.rename(staging, out)
    fsync_dir(os.path.dirname(os.path.abspath(out)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ``export --dtype``: what floating-point weights are written as (default: as saved)
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_fits(name: str, t: torch.Tensor, dtype: str) -> None:
    """Refuse (:class:`ConfigError`) to cast ``t`` to ``dtype`` where a finite value would
    become inf (fp16's range ends at 65504)."""
    to = EXPORT_DTYPES[dtype]
    if not t.is_floating_point() or torch.finfo(to).max >= torch.finfo(t.dtype).max:
        return
    finite = t[torch.isfinite(t)]
    big = float(finite.abs().max()) if finite.numel() else 0.0
    if big > torch.finfo(to).max:
        raise ConfigError(
            f"{name} holds {big:.6g}, beyond {dtype}'s largest value "
            f"({torch.finfo(to).max:.6g}): it would be written as inf; export as bf16 or fp32"
        )


def cast_floats(weights: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """``weights`` with every floating-point tensor in ``dtype`` (``fp32``, ``bf16``, ``fp16``;
    None: as they are), as ``tensor.to`` rounds (to nearest even); integer and bool tensors as
    they are. :func:`check_fits` first."""
    if dtype is None:
        return weights
    to = EXPORT_DTYPES[dtype]
    for k, v in weights.items():
        check_fits(k, v, dtype)
    return {k: v.to(to) if v.is_floating_point() else v for k, v in weights.items()}


def uncompiled(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` by the names of the model uncompiled: without the ``_orig_mod.`` segments of
    a submodule compiled on its own (``enc = torch.compile(enc)``: ``enc._orig_mod.0.weight``),
    which the model a user loads the export into does not have; as they are if two names would
    become one."""
    renamed = {plain_name(k): v for k, v in weights.items()}
    return renamed if len(renamed) == len(weights) else weights


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def export_weights(
    path: str,
    out: str,
    *,
    overwrite: bool = False,
    weights: dict[str, torch.Tensor] | None = None,
    key: str | None = None,
    dtype: str | None = None,
) -> str:
    """Write ``model.safetensors`` and ``export.json`` of the checkpoint at ``path`` into the
    directory ``out`` (written under a temporary name, renamed into place). ``weights``: what to
    write (default: :func:`consolidated`), the state's entry ``key`` (recorded); ``dtype``:
    the floating-point weights cast to it (:func:`cast_floats`; None: as saved)."""
    out = check_export_target(path, out, overwrite=overwrite)
    weights = cast_floats(consolidated(path) if weights is None else weights, dtype)
    manifest = read_manifest(path)
    if not is_dcp_dropin(manifest):  # (dcp.save's own keys are kept as they are)
        weights = uncompiled(weights)
    staging = export_staging(out)
    try:
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            os.path.join(staging, "model.safetensors"),
        )
        info: dict[str, Any] = {
            "source": path,
            "step": manifest.step,
            **({"key": key} if key is not None else {}),
            "parameters": len(weights),
            "dtypes": sorted({str(v.dtype).removeprefix("torch.") for v in weights.values()}),
        }
        with open(os.path.join(staging, EXPORT_MARKER), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
        publish_export(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
