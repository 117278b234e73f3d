"""A restore into FSDP1's own layout: each parameter's piece on this rank (a range of the
flattened parameter, :mod:`.flat`) is assembled in place from the saved boxes that overlap it,
and the optimizer gets its state for those pieces through its own ``load_state_dict``.

FSDP1's ``set_state_dict`` is not called: it all-gathers every flat parameter, and its
optimizer state dict code exchanges the ranks' parameter information with
``all_gather_object`` (pickle). This path has no collective at all and unpickles nothing; the
checkpoint may come from any layout (FSDP1 or FSDP2 on any number of ranks, one process).

Which ranks call what: every rank of an FSDP1 model (:meth:`.flat.FlatLayout.sharded_flat`, the
same answer on every rank) plans and loads its own pieces; nothing here is collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import mapped
from ..dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from . import state_dtypes
from .assemble import assemble
from .chunks import Box, escape, join
from .flat import FlatLayout, Names, Piece, buffer_casts, buffers
from .reads import misfit
from .views import state_of


@dataclass
class DirectPlan:
    """What :func:`plan` found: the files to read and where each tensor goes."""

    home: int
    index: dict[str, Any]
    with_optim: bool
    params: list[tuple[str, Piece, torch.Tensor]]  # name, where it lies, this rank's 1-D piece
    buffers: dict[str, torch.Tensor]  # name -> the live buffer (read whole from the home file)
    entries: dict[str, Any]  # name -> index entry (or one saying "whole, in the home file")
    by_fqn: dict[str, tuple[Piece, torch.Tensor]] = field(default_factory=dict)
    fqn_of: dict[int, str] = field(default_factory=dict)  # id(parameter) -> its name
    ranks: set[int] = field(default_factory=set)
    casts: dict[str, frozenset[str]] = field(default_factory=dict)  # (flat.buffer_casts)


def plan(
    layout: FlatLayout,
    names: Names,
    model: torch.nn.Module,
    index: dict[str, Any],
    home: int,
    with_optim: bool,
    plain: Any = None,
) -> DirectPlan:
    """The boxes this rank needs and the saved files holding them; a checkpoint that does not
    fit the model (a tensor missing or extra, another shape or dtype) is refused with the
    names (:class:`CheckpointMismatchError`). ``plain``: the manifest's ``{name: [dtype,
    shape]}`` of the tensors saved whole (buffers), checked here too (None: not recorded;
    :func:`load` checks them against the home file)."""
    out = DirectPlan(home, index, with_optim, [], {}, {}, ranks={home})
    problems: list[str] = []
    known: set[str] = set()
    hinted: set[bool] = set()  # (reads.misfit)
    whole = plain if isinstance(plain, dict) else {}
    out.casts = buffer_casts(model, names)
    for param, piece in layout.pieces.values():
        name = f"model/{escape(piece.fqn)}"
        known.add(name)
        local = param.detach()
        out.params.append((name, piece, local))
        out.by_fqn[piece.fqn] = (piece, local)
        out.fqn_of[id(param)] = piece.fqn
        code = DTYPE_TO_ST.get(param.dtype, str(param.dtype))
        entry = index.get(name)
        said = whole.get(name) if entry is None else (entry["dtype"], entry["shape"])
        if isinstance(said, (list, tuple)) and len(said) == 2:
            problem = misfit(name, (code, list(piece.shape)), (said[0], said[1]), hinted)
            if problem is not None:
                problems.append(problem)
                continue
        if entry is None:  # saved whole, as by one process (FSDP1 on one rank is NO_SHARD)
            entry = {"dtype": code, "shape": list(piece.shape), "whole": True}
            entry["chunks"] = [[home, [0] * len(piece.shape), list(piece.shape)]]
        out.entries[name] = entry
        _need(out, entry, boxes=[b for b, _ in piece.chunks(local)])
    for path, fqn, buf in buffers(model, names):
        if fqn is None:
            problems.append(f"{path}: a buffer without one state dict name")
            continue
        name = f"model/{escape(fqn)}"
        said = whole.get(name)
        if isinstance(said, list) and len(said) == 2:
            code = DTYPE_TO_ST.get(buf.dtype, str(buf.dtype))
            if {code, said[0]} <= out.casts.get(name, frozenset()):
                code = said[0]  # (cast by FSDP1's mixed precision: either dtype fits)
            problem = misfit(name, (code, list(buf.shape)), (said[0], said[1]), hinted)
            if problem is not None:  # (FSDP1 buffers: copied in with copy_, which casts)
                problems.append(problem)
        elif plain is not None and name not in whole:
            problems.append(f"{name}: not in the checkpoint")
        out.buffers[name] = buf
        known.add(name)
    for name in whole:
        if name.startswith("model/") and name not in known:
            problems.append(f"{name}: in the checkpoint, not in this model/optimizer")
    for name, entry in index.items():
        if name in known:
            continue
        fqn_key = state_of(name)
        if fqn_key is None or fqn_key[0] not in out.by_fqn or not with_optim:
            problems.append(f"{name}: in the checkpoint, not in this model/optimizer")
            continue
        piece, local = out.by_fqn[fqn_key[0]]
        if entry["shape"] == []:
            _need(out, entry, boxes=[Box((), ())] if piece.stop > piece.start else [])
        elif entry["shape"] == list(piece.shape):
            _need(out, entry, boxes=[b for b, _ in piece.chunks(local)])
        else:
            problems.append(f"{name}: saved {entry['shape']}, the parameter is {list(piece.shape)}")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointMismatchError(
            "the checkpoint does not fit this model: " + "; ".join(problems[:10]) + more
        )
    return out


def _need(out: DirectPlan, entry: Mapping[str, Any], boxes: list[Box]) -> None:
    for r, offsets, sizes, *_ in entry["chunks"]:
        saved = Box.of(offsets, sizes)
        if any(b.intersect(saved) is not None and b.numel for b in boxes):
            out.ranks.add(int(r))


def load(
    p: DirectPlan,
    files: Mapping[int, Mapping[str, torch.Tensor]],
    skeleton: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Write every piece, buffer and optimizer state of the plan into the live model and
    optimizer. Nothing is written when a tensor the model has is not in the checkpoint (or
    not as the model has it)."""
    home = files[p.home]
    problems = []
    for name, piece, local in p.params:
        if p.entries[name].get("whole"):
            problems += _whole_problem(name, home.get(name), list(piece.shape), local.dtype)
    for name, buf in p.buffers.items():
        saved, fits = home.get(name), p.casts.get(name, frozenset())
        cast = saved is not None and {DTYPE_TO_ST.get(saved.dtype), DTYPE_TO_ST[buf.dtype]} <= fits
        dtype = saved.dtype if saved is not None and cast else buf.dtype
        problems += _whole_problem(name, saved, list(buf.shape), dtype)
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointMismatchError(
            "the checkpoint does not fit this model: " + "; ".join(problems[:10]) + more
        )
    with torch.no_grad():
        for name, piece, local in p.params:
            for box, view in piece.chunks(local):
                assemble(name, box, p.entries[name], files, out=view)
        for name, buf in p.buffers.items():
            buf.copy_(home[name])
    if p.with_optim and optimizer is not None:
        osd = _optimizer_state(p, files, skeleton, optimizer)
        states = state_dtypes.given(optimizer, osd)  # (fresh tensors: they hold no file)
        # the state it keeps must not hold the files (mapped.py)
        mapped.load_state(optimizer, osd, optimizer.load_state_dict)
        state_dtypes.put_back(states)  # (load_state_dict casts them to the parameters' dtype)


def _whole_problem(
    name: str, saved: torch.Tensor | None, shape: list[int], dtype: torch.dtype
) -> list[str]:
    if saved is None:
        return [f"{name}: not in the checkpoint"]
    if list(saved.shape) != shape or saved.dtype != dtype:
        return [f"{name}: saved {saved.dtype} {list(saved.shape)}, this model has {dtype} {shape}"]
    return []


def _optimizer_state(
    p: DirectPlan,
    files: Mapping[int, Mapping[str, torch.Tensor]],
    skeleton: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """``optimizer``'s own state dict (parameters by position) for this rank's pieces, from
    the saved one (parameters by name)."""
    saved = skeleton.get("optim")
    if not isinstance(saved, dict):
        raise CheckpointCorruptError("the home JSON holds no optimizer state")
    groups = join(saved.get("param_groups"), lambda name: _home_tensor(p, files, name))
    mine = [[p.fqn_of.get(id(q)) for q in g["params"]] for g in optimizer.param_groups]
    if [g.get("params") for g in groups] != mine:
        raise CheckpointMismatchError(
            "the optimizer's parameter groups differ from the saved ones "
            f"(saved {[len(g.get('params', [])) for g in groups]} parameters by group, "
            f"this optimizer {[len(m) for m in mine]})"
        )
    position = {fqn: i for i, fqn in enumerate(f for m in mine for f in m)}
    state: dict[int, Any] = {}
    for fqn, values in saved.get("state", {}).items():
        piece_local = p.by_fqn.get(fqn)
        if piece_local is None or fqn not in position:
            raise CheckpointMismatchError(f"optim/state/{fqn}: not a parameter of this optimizer")
        piece, local = piece_local
        if piece.stop > piece.start:  # a rank without a piece of it never steps it

            def tensor(name: str, piece: Piece = piece, local: torch.Tensor = local) -> Any:
                return _state_tensor(p, files, name, piece, local)

            state[position[fqn]] = join(values, tensor)
    return {
        "state": state,
        "param_groups": [{**g, "params": [position[f] for f in g["params"]]} for g in groups],
    }


def _state_tensor(
    p: DirectPlan,
    files: Mapping[int, Mapping[str, torch.Tensor]],
    name: str,
    piece: Piece,
    local: torch.Tensor,
) -> torch.Tensor:
    entry = p.index.get(name)
    if entry is None:  # saved whole, in the home file
        whole = files[p.home].get(name)
        if whole is None:
            raise CheckpointCorruptError(f"{name}: neither in the chunk index nor in the home file")
        if whole.dim() == 0:
            return whole.clone()
        if list(whole.shape) != list(piece.shape):
            raise CheckpointMismatchError(
                f"{name}: saved {list(whole.shape)}, the parameter is {list(piece.shape)}"
            )
        return whole.reshape(-1)[piece.start : piece.stop].to(local.device, copy=True)
    dtype = ST_TO_DTYPE[entry["dtype"]]
    if entry["shape"] == []:
        out = torch.empty((), dtype=dtype)
        assemble(name, Box((), ()), entry, files, out=out)
        return out
    out = torch.empty(local.shape, dtype=dtype, device=local.device)
    for box, view in piece.chunks(out):
        assemble(name, box, entry, files, out=view)
    return out


def _home_tensor(
    p: DirectPlan, files: Mapping[int, Mapping[str, torch.Tensor]], name: str
) -> torch.Tensor:
    """A tensor among the optimizer's hyper-parameters (a tensor learning rate), saved whole."""
    saved = files[p.home].get(name)
    if saved is None:
        raise CheckpointCorruptError(f"{name}: not in the home file its JSON refers to")
    return saved.clone()
