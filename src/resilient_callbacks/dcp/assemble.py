"""A rank's piece of a saved sharded tensor: the saved chunks (boxes of the global tensor, each
in some rank's file) that overlap the box the rank needs, copied into it.

Which ranks call what: any rank, for itself; nothing here is collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from ..layout import rank_structure, rank_tensors
from .chunks import Box, copy_overlap, first_overlap
from .views import dtype_code

# a Sharded part's files are named as the core's own files of each rank
tensor_file = rank_tensors
json_file = rank_structure


def assemble(
    name: str,
    need: Box,
    entry: Mapping[str, Any],
    files: Mapping[int, Mapping[str, torch.Tensor]],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's piece ``need`` of tensor ``name``, copied from the saved chunks that
    overlap it into ``out`` (a live tensor of that shape and dtype, written in place), or
    without ``out`` into a fresh tensor -- or then the saved chunk itself (a view of the
    verified, privately mapped file: no copy) when it is exactly that piece."""
    dtype = ST_TO_DTYPE[entry["dtype"]]
    for r, offsets, sizes, *key in entry["chunks"]:
        src = files[int(r)].get(key[0] if key else name) if Box.of(offsets, sizes) == need else None
        if src is not None and tuple(src.shape) == need.sizes and src.dtype == dtype:
            if out is None:
                return src
            with torch.no_grad():
                return out.copy_(src)
    # the saved chunks that share elements with ``need``: an honest index has no two that
    # overlap, so their shares add up to the elements covered (else some count twice and a
    # gap passes as covered); checked before anything is copied into ``out``
    used = [
        (int(r), Box.of(offsets, sizes), key[0] if key else name)
        for r, offsets, sizes, *key in entry["chunks"]
        if need.numel and need.intersect(Box.of(offsets, sizes)) is not None
    ]
    both = first_overlap([box for _, box, _ in used])
    if both is not None:
        a, b = both
        raise CheckpointCorruptError(
            f"{name}: the saved chunks {list(a.offsets)}+{list(a.sizes)} and "
            f"{list(b.offsets)}+{list(b.sizes)} overlap: the chunk index is damaged"
        )
    local = torch.empty(need.sizes, dtype=dtype) if out is None else out
    filled = 0
    for r, box, key in used:
        src = files[r].get(key)
        if src is None:  # (load() refuses tensors the checkpoint lacks before asking)
            raise CheckpointCorruptError(f"{tensor_file(r)} does not hold {name}")
        if entry.get("whole") and (src.dtype != local.dtype or tuple(src.shape) != box.sizes):
            raise CheckpointMismatchError(
                f"{name}: saved {DTYPE_TO_ST.get(src.dtype, src.dtype)} {list(src.shape)}, "
                f"this model has {entry['dtype']} {list(box.sizes)}"
            )
        with torch.no_grad():
            filled += copy_overlap(local, need, src, box)
    if filled != need.numel:
        raise CheckpointCorruptError(
            f"{name}: the saved chunks cover {filled} of the {need.numel} elements this rank needs"
        )
    return local


def full_box(t: torch.Tensor) -> Box:
    return Box.of([0] * t.dim(), list(t.shape))


def whole_entry(name: str, t: torch.Tensor, home: int) -> dict[str, Any]:
    """The index entry of a tensor saved whole, as a plain tensor, into rank ``home``'s file."""
    return {
        "dtype": dtype_code(name, t),
        "shape": list(t.shape),
        "chunks": [[home, [0] * t.dim(), list(t.shape)]],
        "whole": True,
    }
