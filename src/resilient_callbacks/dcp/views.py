"""What one save of :class:`~resilient_callbacks.dcp.sharded.Sharded` writes on this rank, from
a state dict: :func:`view_of` splits it into the JSON skeleton, this rank's entry of the chunk
index (for each tensor its dtype, global shape and the boxes this rank holds, each under the
key it is written with) and the tensors to write.

The state dict is either DCP's (``get_state_dict``: DTensors, ShardedTensors, plain tensors;
one box a rank) or read from FSDP1's layout (:mod:`.flat`: 1-D pieces of flattened tensors,
several boxes a rank, written as ``name#0``, ``name#1``, ...; step counters as 0-d chunks,
restored from whichever rank wrote them). :func:`differences` compares the two on this rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dtypes import DTYPE_TO_ST, unsupported
from ..errors import UnsupportedStateError
from . import shards
from .chunks import TAG, Box, narrow, split, unescape
from .flat import Piece

OPTIM_STATE = "optim/state/"
MODEL = "model/"  # the names of the model's tensors in a Sharded part's index


def dtype_code(name: str, t: torch.Tensor) -> str:
    try:
        return DTYPE_TO_ST[t.dtype]
    except KeyError:
        raise UnsupportedStateError(unsupported(name, t.dtype)) from None


@dataclass
class View:
    skeleton: Any
    # name -> [dtype, global shape, [[offsets, sizes, key], ...]]: this rank's boxes
    mine: dict[str, list[Any]] = field(default_factory=dict)
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> tensor to write
    plain: set[str] = field(default_factory=set)  # names of tensors every rank writes whole
    mesh: dict[str, Any] | None = None


def view_of(
    sd: Mapping[str, Any],
    pieces: Mapping[str, Piece],
    box: Callable[[str, Any], Box] = shards.box_of,
) -> View:
    """The view of ``sd``; ``pieces``: the tensors that are 1-D pieces of flattened tensors
    (read from FSDP1's layout), by name; ``box``: a sharded tensor's box on this rank."""
    skeleton, tensors = split(sd)
    view = View(skeleton)
    for name, t in tensors.items():
        piece = pieces.get(name)
        if piece is not None:
            runs = list(piece.chunks(t.detach()))
            keys = [name] if len(runs) == 1 else [f"{name}#{i}" for i in range(len(runs))]
            view.mine[name] = [
                dtype_code(name, t),
                list(piece.shape),
                [[list(b.offsets), list(b.sizes), k] for (b, _), k in zip(runs, keys, strict=True)],
            ]
            view.local.update((k, v) for (_, v), k in zip(runs, keys, strict=True))
            view.mesh = {"layout": "FSDP1 flat parameters, read directly"}
        elif shards.is_sharded(t):
            b = box(name, t)
            view.mine[name] = [
                dtype_code(name, t),
                list(t.shape),
                [[list(b.offsets), list(b.sizes), name]],
            ]
            view.local[name] = shards.local(t).detach()
            if view.mesh is None:
                view.mesh = shards.layout(t)
        elif pieces and t.dim() == 0 and name.startswith(OPTIM_STATE):
            # a step counter: ranks without a piece of the parameter have none; a restore
            # takes it from the lowest rank that saved it
            view.mine[name] = [dtype_code(name, t), [], [[[], [], name]]]
            view.local[name] = t.detach()
        else:
            dtype_code(name, t)
            view.plain.add(name)
            view.local[name] = t.detach()
    return view


def state_of(name: str) -> tuple[str, str] | None:
    """``(parameter name, state key)`` of an optimizer state's tensor name, else ``None``."""
    if not name.startswith(OPTIM_STATE):
        return None
    parts = name[len(OPTIM_STATE) :].split("/")
    return (unescape(parts[0]), unescape(parts[1])) if len(parts) == 2 else None


def optim_state_names(index: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(fqn, key, name)`` of every optimizer state in the chunk ``index``."""
    return [(*of, name) for name in index if (of := state_of(name)) is not None]


def complete_skeleton(skeleton: Any, names: list[tuple[str, str, str]]) -> None:
    """Add to ``skeleton`` a reference to every optimizer state of ``names``
    (:func:`optim_state_names` of the chunk index) that it lacks: a rank that holds no piece of
    a parameter has no optimizer state for it, while FSDP1's state dict lists it on every
    rank."""
    optim = skeleton.get("optim") if isinstance(skeleton, dict) else None
    state = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(state, dict):
        return
    for fqn, key, name in names:
        slot = state.get(fqn)
        if slot is None:
            slot = state[fqn] = {}
        if key not in slot:
            slot[key] = {TAG: "tensor", "name": name}


def differences(flat: View, dcp: View, index: Mapping[str, Any]) -> str | None:
    """What differs between the state read from FSDP1's layout (``flat``, with the chunk
    ``index`` gathered from it) and DCP's state dict of the same state (``dcp``), on this rank:
    names, the non-tensor state, dtypes, global shapes, and the values where this rank's boxes
    of both overlap. ``None`` when nothing does."""
    names, expected = set(index) | flat.plain, set(dcp.mine) | dcp.plain
    if names != expected:
        return f"tensors {sorted(names ^ expected)[:5]} are in only one of them"
    if flat.skeleton != dcp.skeleton:
        return "the non-tensor state (param_groups, names) differs"
    for name, (dtype, shape, chunks) in dcp.mine.items():
        entry = index[name]
        if entry["dtype"] != dtype or entry["shape"] != shape:
            return f"{name}: {entry['dtype']} {entry['shape']} against {dtype} {shape}"
        for offsets, sizes, key in chunks:
            theirs = Box.of(offsets, sizes)
            for o, s, k in flat.mine.get(name, [None, None, []])[2]:
                mine = Box.of(o, s)
                common = theirs.intersect(mine)
                if common is None or not common.numel:
                    continue
                a = narrow(dcp.local[key], common, theirs)
                if not torch.equal(a, narrow(flat.local[k], common, mine)):
                    return f"{name}: the values of {common} differ"
    for name in dcp.plain:
        t = dcp.local[name]
        if name in flat.plain:
            same = flat.local[name].dtype == t.dtype and torch.equal(flat.local[name], t)
        else:  # a step counter, in the index
            entry = index[name]
            same = entry["shape"] == [] and entry["dtype"] == dtype_code(name, t)
            if same and name in flat.local:
                same = torch.equal(flat.local[name], t)
        if not same:
            return f"{name}: differs"
    return None
