"""The restore of a :class:`~.sharded.Sharded` part: which files a rank reads (its home JSON and
the tensor files holding a box that overlaps a local shard it needs; :func:`files_to_read`) and
the load of what they hold into the live state, in place where it fits (:func:`load`), under
FSDP1 with its sharded parameters written where they lie (:mod:`.flat_restore`).

Which ranks call what: every rank, on the training thread, through its ``Sharded``
(``files_to_read``, then, once every rank verified its files, ``load``; see
:mod:`resilient_callbacks.filepart`). Where DCP's ``get_state_dict``/``set_*_state_dict`` are
collective (FSDP1), every rank reaches them alike: whether the restore writes FSDP1's layout
directly (no collective) is the same answer on every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import (
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .. import module_versions
from ..consolidate import SHARDED_FORMAT as FORMAT
from ..dtypes import ST_TO_DTYPE
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from ..filepart import PartInfo, PartReader
from . import flat_restore, optim_fit, replicas, shards, state_dtypes
from .assemble import assemble, json_file, tensor_file
from .chunks import check_index, join, split
from .flat import FlatLayout
from .reads import frozen_hint, live_state, on_meta, plan_reads, refuse, refuse_missing
from .stateless import optimizers_of, restore_hyperparameters, saved_indices, without_saved_state
from .views import MODEL

if TYPE_CHECKING:
    from .sharded import Sharded


def files_to_read(part: Sharded, info: PartInfo) -> list[str]:
    """The home JSON (this rank's, or rank 0's for a rank the save did not have) and the
    tensor files holding a box that overlaps a local shard this rank needs."""
    saved = info.saved
    if saved.get("format") != FORMAT or not isinstance(saved.get("tensors"), dict):
        raise CheckpointMismatchError(
            f"part {info.part_id!r} was not written by resilient_callbacks.dcp.Sharded "
            f"(its manifest records {sorted(saved) or 'nothing'})"
        )
    if saved.get("optim") and not part.optimizers and not info.partial:
        raise CheckpointMismatchError(
            f"part {info.part_id!r} holds optimizer state, but this Sharded has none (to "
            "load the model alone, open the Checkpointer with read_only=True)"
        )
    refuse(info.part_id, on_meta(part.model))  # (a restore into it would load nothing)
    partial = info.partial and not part.optimizers  # a read-only restore of the model
    optims = () if partial else optimizers_of(saved, part.optimizers)
    with_optim = bool(optims)
    index: dict[str, Any] = saved["tensors"]
    check_index(index, info.saved_world_size)
    home = info.rank if info.rank < info.saved_world_size else 0
    # FSDP1 whose parameters are sharded now (between steps: on every rank alike)
    layout = FlatLayout.of(part.model, part._fqn) if part._flat_model() else None
    if layout is not None:
        direct = part._load = flat_restore.plan(
            layout, part._fqn, part.model, index, home, with_optim, saved.get("plain")
        )
        optim_fit.check(info.part_id, saved, part._kinds, part.optimizers, part.options.strict)
        return [json_file(home), *replicas.files(info)] + [
            tensor_file(r) for r in sorted(direct.ranks)
        ]
    target = live_state(info.part_id, lambda: part._state_dict(optims))
    _, tensors = split(target)
    plain, strict = saved.get("plain"), part.options.strict
    reads = plan_reads(tensors, index, plain, home, strict, part._box, with_optim)
    # the model's misfits first, then another optimizer's, then its state's
    left_out = (bool(saved.get("frozen_left_out")), part.options.ignore_frozen_params)
    refuse(info.part_id, frozen_hint([p for p in reads.problems if p.startswith(MODEL)], *left_out))
    optim_fit.check(info.part_id, saved, part._kinds, part.optimizers, strict)
    refuse(info.part_id, reads.problems)
    part._load = {
        "home": home,
        "ranks": sorted(reads.ranks),
        "tensors": tensors,
        "needs": reads.needs,
        "entries": reads.entries,
        "with_optim": with_optim,
        "optims": optims,
    }
    return [json_file(home), *replicas.files(info)] + [tensor_file(r) for r in sorted(reads.ranks)]


def load(part: Sharded, reader: PartReader) -> None:
    """:meth:`Sharded.load`: restore from the files :func:`files_to_read` named, as it planned:
    FSDP1's pieces written where they lie (:mod:`.flat_restore`), or the boxes assembled into the
    live state (in place where they fit) and put with DCP's ``set_*_state_dict``; then the
    hyperparameters of the optimizers saved without state (:func:`restore_groups`)."""
    plan, part._load = part._load, None
    if plan is None:
        raise RuntimeError("Sharded.load() without files_to_read() first")
    home = plan.home if isinstance(plan, flat_restore.DirectPlan) else plan["home"]
    meta = reader.json(json_file(home))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{json_file(home)}: not a Sharded part's JSON")
    if isinstance(plan, flat_restore.DirectPlan):
        files = {r: reader.tensors(tensor_file(r)) for r in sorted(plan.ranks)}
        optimizer = part.optimizers[0] if part.optimizers else None
        flat_restore.load(plan, files, meta["skeleton"], optimizer)
        restore_groups(part, meta, reader, home)
        return replicas.say_dropped(reader, home, meta)  # (the ranks gone: rank 0)
    files = {r: reader.tensors(tensor_file(r)) for r in plan["ranks"]}
    targets: dict[str, torch.Tensor] = plan["tensors"]

    asked: set[str] = set()
    filled: dict[str, torch.Tensor] = {}  # live tensors read into in place

    def value(name: str) -> Any:
        asked.add(name)
        target = targets.get(name)
        need = plan["needs"].get(name)
        if need is not None and target is not None:
            entry = plan["entries"][name]
            dest = shards.local(target) if shards.is_sharded(target) else target
            if tuple(dest.shape) == need.sizes and dest.dtype == ST_TO_DTYPE[entry["dtype"]]:
                # into the live tensor (its local piece), as dcp.load reads into it: one
                # copy, and pages the training run already owns
                assemble(name, need, entry, files, out=dest)
                filled[name] = target
                return target
            piece = assemble(name, need, entry, files)
            if shards.is_sharded(target):
                return shards.rebuild(target, piece.to(shards.local(target).device))
            return piece.to(target.device)
        saved = files[home].get(name)
        if saved is None and target is None and not part.options.strict:
            return None  # strict=False: a saved tensor this model does not have
        if saved is None:
            raise CheckpointCorruptError(
                f"{tensor_file(home)} does not hold {name}, which its JSON refers to"
            )
        if state_dtypes.same(target, saved) and not name.startswith(MODEL):
            filled[name] = target.copy_(saved)  # (an optimizer's: its dtype is put back)
            return target
        device = target.device if isinstance(target, torch.Tensor) else "cpu"
        return saved.to(device, copy=True)

    skeleton = meta["skeleton"] if plan["with_optim"] else {"model": meta["skeleton"]["model"]}
    sd = join(skeleton, value)  # (without its optimizer's: a restore of the model alone)
    unsaved = without_saved_state(set(targets) - asked, sd) if plan["with_optim"] else set()
    refuse_missing(set(targets) - asked - unsaved, part.options.strict)
    model_sd = module_versions.attach(sd["model"], meta, part._versions)  # (else the live)
    # frozen parameters left out (ignore_frozen_params) keep their values: DCP's strict load
    # would call them missing, after loading the rest (files_to_read checked the rest)
    lenient = replace(part.options, strict=False)
    set_model_state_dict(
        part.model, model_sd, options=lenient if lenient.ignore_frozen_params else part.options
    )
    if plan["with_optim"]:
        # parameters that had no optimizer state when saved get none (DCP's strict
        # loading refuses them; the optimizer's load_state_dict leaves them without)
        options = replace(part.options, strict=False) if unsaved else part.options
        states = state_dtypes.kept(plan["optims"], filled)  # (the load casts them)
        set_optimizer_state_dict(part.model, plan["optims"], sd["optim"], options=options)
        state_dtypes.put_back(states)
    restore_groups(part, meta, reader, home)
    replicas.say_dropped(reader, home, meta)


def restore_groups(part: Sharded, meta: dict[str, Any], reader: PartReader, home: int) -> None:
    """The hyperparameters of optimizers saved without state (:mod:`.stateless`)."""
    stepped = saved_indices(reader.info.saved, len(part.optimizers))
    if len(stepped) < len(part.optimizers) and "groups" in meta:
        restore_hyperparameters(part.optimizers, meta["groups"], json_file(home), set(stepped))
        part._stepped = tuple(i for i in part._stepped if i in stepped)  # (they have none)
