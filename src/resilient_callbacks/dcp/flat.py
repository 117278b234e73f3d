"""FSDP1's own layout, read without FSDP1's sharded state dict.

FSDP1 (``FullyShardedDataParallel`` with ``use_orig_params=True``, as Lightning's
``FSDPStrategy`` and accelerate set it up) flattens the parameters of each wrapped module into
one flat parameter and gives each rank an even slice of it. An original parameter's piece on a
rank is then a contiguous range of the *flattened* parameter (a 1-D view of the rank's slice),
and the optimizer's state for it has the same 1-D shape. FSDP1's sharded state dict turns that
into dim-0 chunks: it all-gathers the flat parameters and the optimizer state, cuts and clones
them -- most of what a save blocks for under FSDP1 (about 0.25 s for 128 MB a rank on the
2-core machine, docs/performance.md).

:class:`FlatLayout` reads the same pieces where they are: a rank's range ``[start, stop)`` of a
flattened tensor of shape ``S`` is at most ``2 * len(S) - 1`` boxes of the global tensor
(:func:`boxes_of_range`), each a contiguous run of the rank's 1-D piece, and the chunk index
records those boxes. What is saved is therefore the same global tensors under the same names as
through FSDP1's state dict, and a restore (which assembles each piece it needs from the boxes
that overlap it) does not know the difference: it reshards to any number of ranks, to FSDP2 and
back.

Nothing here is collective; :class:`~resilient_callbacks.dcp.sharded.Sharded` agrees across
ranks on using it, and compares it with FSDP1's own state dict whenever the layout changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..dtypes import DTYPE_TO_ST
from .chunks import Box, escape


def boxes_of_range(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes of a tensor of ``shape`` whose elements are those of ``[start, stop)`` in
    row-major (flattened) order, in that order: at most ``2 * len(shape) - 1`` of them."""
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    row0, col0 = divmod(start, inner)
    row1, col1 = divmod(stop, inner)
    if row0 == row1:  # within one row
        return [_in_row(row0, b) for b in boxes_of_range(shape[1:], col0, col1)]
    out: list[Box] = []
    if col0:  # the end of a first, partial row
        out += [_in_row(row0, b) for b in boxes_of_range(shape[1:], col0, inner)]
        row0 += 1
    if row1 > row0:  # whole rows
        out.append(Box((row0,) + (0,) * (len(shape) - 1), (row1 - row0, *shape[1:])))
    if col1:  # the start of a last, partial row
        out += [_in_row(row1, b) for b in boxes_of_range(shape[1:], 0, col1)]
    return out


def _in_row(row: int, box: Box) -> Box:
    return Box((row, *box.offsets), (1, *box.sizes))


class Names:
    """The names ``get_state_dict`` gives the parameters and buffers of ``model`` (FSDP1's
    wrapper modules left out), by their ``named_parameters``/``named_buffers`` names, computed
    once each: a model's structure does not change between saves."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._known: dict[str, tuple[str, ...]] = {}

    def __call__(self, name: str) -> str | None:
        """The one FQN of ``name``, or ``None`` when it has several (a flat parameter)."""
        fqns = self.every(name)
        return fqns[0] if len(fqns) == 1 else None

    def every(self, name: str) -> tuple[str, ...]:
        """Every FQN of ``name``, sorted (a flat parameter holds several)."""
        if name not in self._known:
            from torch.distributed.checkpoint.state_dict import _get_fqns

            self._known[name] = tuple(sorted(_get_fqns(self.model, name)))
        return self._known[name]


@dataclass(frozen=True)
class Piece:
    """One original parameter on this rank: its name (as ``get_state_dict`` names it), global
    shape, and the range ``[start, stop)`` of the flattened parameter this rank holds."""

    fqn: str
    shape: tuple[int, ...]
    start: int
    stop: int

    def chunks(self, local: torch.Tensor) -> Iterator[tuple[Box, torch.Tensor]]:
        """Each box of this rank's range with the run of ``local`` (the rank's 1-D piece of
        the parameter, or of an optimizer state of its shape) that holds it."""
        at = 0
        for box in boxes_of_range(self.shape, self.start, self.stop):
            yield box, local[at : at + box.numel].view(box.sizes)
            at += box.numel


def _handles(model: torch.nn.Module) -> list[Any]:
    """The flat-parameter handles of ``model``'s FSDP1 units."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [
        m._handle
        for m in model.modules()
        if isinstance(m, FullyShardedDataParallel) and m._handle is not None
    ]


def is_fsdp1(model: torch.nn.Module) -> bool:
    """Whether ``model`` has FSDP1 units (with parameters)."""
    return bool(_handles(model))


def _readable(handle: Any) -> bool:
    """Whether an FSDP1 unit is one whose layout is read directly: original parameters kept,
    sharded, none shared."""
    flat = handle.flat_param
    return bool(
        handle._use_orig_params
        and handle.uses_sharded_strategy
        and flat._params is not None
        and not flat._shared_param_infos
    )


def _unsharded(flat: Any) -> bool:
    """Whether an FSDP1 flat parameter holds the whole parameters now (inside forward or
    backward, or summoned). Before its first forward FSDP1 has no ``_local_shard`` yet: the
    flat parameter is the local shard it cut at construction."""
    shard = getattr(flat, "_local_shard", None)
    return shard is not None and flat.data_ptr() != shard.data_ptr()


class FlatLayout:
    """Where each original parameter of an FSDP1 model lies on this rank (see the module
    docstring). :meth:`of` returns ``None`` for a model it does not describe: no FSDP1 unit, an
    unit without ``use_orig_params`` or with an unsharded strategy (one rank: ``NO_SHARD``),
    parameters shared between modules, or parameters not sharded at the moment (inside
    forward/backward, or summoned)."""

    def __init__(self, pieces: dict[int, tuple[torch.nn.Parameter, Piece]]) -> None:
        self.pieces = pieces  # id(parameter) -> (parameter, where it lies)

    @staticmethod
    def sharded_flat(model: torch.nn.Module) -> bool:
        """Whether ``model`` has FSDP1 units and every one keeps the original parameters
        (``use_orig_params``), shards them and shares none: what the model is, not the moment,
        so the same answer on every rank."""
        handles = _handles(model)
        return bool(handles) and all(_readable(h) for h in handles)

    @classmethod
    def of(cls, model: torch.nn.Module, fqn: Names) -> FlatLayout | None:
        from torch.distributed.fsdp._common_utils import HandleTrainingState

        names = {id(p): n for n, p in model.named_parameters()}
        pieces: dict[int, tuple[torch.nn.Parameter, Piece]] = {}
        for handle in _handles(model):
            flat = handle.flat_param
            if (
                not _readable(handle)
                or handle._training_state != HandleTrainingState.IDLE
                or _unsharded(flat)
            ):
                return None
            for info, param, shape in zip(
                flat._shard_param_infos, flat._params, flat._shapes, strict=True
            ):
                start = stop = 0
                if info.in_shard:
                    first, last = info.intra_param_start_idx, info.intra_param_end_idx
                    if first is None or last is None:
                        return None
                    start, stop = first, last + 1
                name = fqn(names[id(param)]) if id(param) in names else None
                if name is None or param.dim() != 1 or param.numel() != stop - start:
                    return None
                pieces[id(param)] = (param, Piece(name, tuple(shape), start, stop))
        if not pieces or len(pieces) != len(names):
            return None  # no FSDP1 unit, or parameters outside them
        return cls(pieces)

    def optimizer_state(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[list[dict[str, Any]], dict[str, dict[str, torch.Tensor]]] | None:
        """``(param_groups, state)`` of ``optimizer`` as ``get_optimizer_state_dict`` names
        them (parameters by name; the state of this rank's pieces, 1-D, and its ``step``
        counters), or ``None`` for an optimizer this does not describe (a parameter outside
        the model's FSDP1 units, a state value that is neither a tensor of the piece's shape
        nor a scalar tensor)."""
        groups: list[dict[str, Any]] = []
        state: dict[str, dict[str, torch.Tensor]] = {}
        for group in optimizer.param_groups:
            fqns = []
            for p in group["params"]:
                known = self.pieces.get(id(p))
                if known is None:
                    return None
                piece = known[1]
                fqns.append(piece.fqn)
                values = optimizer.state.get(p)
                if not values:
                    continue
                for v in values.values():
                    if not isinstance(v, torch.Tensor):
                        return None
                    if v.dim() != 0 and tuple(v.shape) != tuple(p.shape):
                        return None
                state[piece.fqn] = dict(values)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
        return groups, state


def buffers(model: torch.nn.Module, names: Names) -> Iterator[tuple[str, str | None, torch.Tensor]]:
    """The persistent buffers of ``model`` (those its state dict holds), each once: its
    module path, its state dict name (``None`` when it has several) and the buffer."""
    seen: set[int] = set()
    for where, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            path = f"{where}.{name}" if where else name
            yield path, names(path), buf


def buffer_casts(model: torch.nn.Module, names: Names) -> dict[str, frozenset[str]]:
    """The buffers FSDP1's mixed precision casts (``MixedPrecision(buffer_dtype=...)``), by
    tensor name (``model/...``): the dtype codes each may be saved and restored in. FSDP1
    casts them from the dtype they were built in to ``buffer_dtype`` at its first forward, and
    its sharded state dict (DCP's, and what :func:`flat_state` reads) holds whichever the
    buffer has at the save: a checkpoint and the live model may differ here and still be the
    same model (a copy casts; from the built dtype as FSDP1's own cast does). FSDP1 leaves
    buffers of other dtypes (integer counters) as they are."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    of = {id(buf): fqn for _, fqn, buf in buffers(model, names) if fqn is not None}
    out: dict[str, frozenset[str]] = {}
    for unit in model.modules():
        policy = getattr(unit, "mixed_precision", None) if isinstance(unit, FSDP) else None
        cast = getattr(policy, "buffer_dtype", None)
        built = getattr(unit, "_buffer_name_to_orig_dtype", None)
        if cast is None or not isinstance(built, dict):
            continue
        for path, buf in unit.named_buffers():
            fqn, orig = of.get(id(buf)), built.get(clean_tensor_name(path))
            if fqn is not None and orig is not None and orig.is_floating_point:
                name = f"model/{escape(fqn)}"
                codes = {DTYPE_TO_ST.get(d, str(d)) for d in (cast, orig)}
                out[name] = out.get(name, frozenset()) | codes
    return out


@dataclass
class FlatState:
    """A state dict as ``get_state_dict`` names and nests it, read from the FSDP1 layout:
    ``sd`` holds each parameter's (and its optimizer states') 1-D piece where FSDP1's state dict
    has a ShardedTensor; ``pieces`` says, by tensor name (as :func:`.chunks.split` names it),
    which tensors are such pieces and where they lie."""

    sd: dict[str, Any]
    pieces: dict[str, Piece]


def flat_state(
    layout: FlatLayout,
    names: Names,
    model: torch.nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    with_optim: bool,
) -> FlatState | None:
    """The state of ``model`` and ``optimizers`` (one at most) from ``layout``, or ``None``
    where it does not describe them (see :meth:`FlatLayout.optimizer_state`)."""
    pieces: dict[str, Piece] = {}
    msd: dict[str, torch.Tensor] = {}
    for param, piece in layout.pieces.values():
        msd[piece.fqn] = param.detach()
        pieces[f"model/{escape(piece.fqn)}"] = piece
    for _, buffer_fqn, buf in buffers(model, names):
        if buffer_fqn is None:
            return None
        msd[buffer_fqn] = buf.detach()
    sd: dict[str, Any] = {"model": msd}
    if not with_optim:
        return FlatState(sd, pieces)
    if len(optimizers) != 1:
        return None
    described = layout.optimizer_state(optimizers[0])
    if described is None:
        return None
    groups, state = described
    by_fqn = {piece.fqn: piece for _, piece in layout.pieces.values()}
    for fqn, values in state.items():
        held = by_fqn[fqn].stop > by_fqn[fqn].start
        for key, v in list(values.items()):
            if v.dim():
                pieces[f"optim/state/{escape(fqn)}/{escape(key)}"] = by_fqn[fqn]
            elif not held:
                # a rank without a piece of the parameter skips it at every step: its step
                # counter (made when the state was first asked for) is not the parameter's
                del values[key]
    sd["optim"] = {"state": state, "param_groups": groups}
    return FlatState(sd, pieces)
