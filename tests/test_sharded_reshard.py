"""``dcp.Sharded`` resharded: what a restore on another number of ranks keeps, drops and
refuses.

(a) One process: a chunk index whose chunks overlap (hand-edited or damaged) is refused; the
    sum of the overlaps counted an element twice and let a gap pass as covered.
"""

from __future__ import annotations

import pytest
import torch

from resilient_callbacks.dcp.assemble import assemble
from resilient_callbacks.dcp.chunks import Box, check_index, first_overlap
from resilient_callbacks.errors import CheckpointCorruptError
from torch_needs import needs_dcp

pytestmark = [needs_dcp]

# ----------------------------------------------------------------------------- (a) one process


def _overlapping_index() -> dict:
    """A 1-D tensor of 6 elements whose two saved chunks, [0, 3) of rank 0 and [1, 4) of rank 1,
    hold 3 elements each: 6 in all, as many as the tensor, but [4, 6) is in neither."""
    return {"model/w": {"dtype": "F32", "shape": [6], "chunks": [[0, [0], [3]], [1, [1], [3]]]}}


def test_overlapping_chunks_are_not_counted_as_covering_a_gap():
    index = _overlapping_index()
    files = {0: {"model/w": torch.arange(3.0)}, 1: {"model/w": torch.arange(1.0, 4.0)}}
    need = Box.of([0], [6])
    with pytest.raises(CheckpointCorruptError, match=r"model/w: the saved chunks .* overlap"):
        assemble("model/w", need, index["model/w"], files)  # (export's call: a fresh tensor)
    live = torch.full((6,), -1.0)
    with pytest.raises(CheckpointCorruptError, match="overlap"):
        assemble("model/w", need, index["model/w"], files, out=live)
    assert live.tolist() == [-1.0] * 6  # refused before anything was copied into it
    with pytest.raises(
        CheckpointCorruptError, match=r"chunk index of 'model/w' is damaged.*overlap"
    ):
        check_index(index, world_size=2)


def test_chunks_that_tile_a_tensor_do_not_overlap():
    rows = [Box.of([0, 0], [4, 4]), Box.of([4, 0], [3, 4])]
    assert first_overlap(rows) is None
    # FSDP1's flat pieces of a 3x4 tensor: the tail of a row, whole rows, the head of a row
    flat = [Box.of([0, 2], [1, 2]), Box.of([1, 0], [1, 4]), Box.of([2, 0], [1, 1])]
    assert first_overlap([Box.of([0, 0], [1, 2]), *flat, Box.of([2, 1], [1, 3])]) is None
    cols = [Box.of([0, 0], [5, 2]), Box.of([0, 2], [5, 2])]  # shards along dimension 1
    assert first_overlap(cols) is None
    assert first_overlap([*cols, Box.of([4, 1], [1, 2])]) == (cols[0], Box.of([4, 1], [1, 2]))
    assert first_overlap([Box((), ()), Box((), ())]) is not None  # two 0-d chunks: one element
    assert first_overlap([Box((), ())]) is None
    index = {
        "model/w": {
            "dtype": "F32",
            "shape": [7, 4],
            "chunks": [[0, [0, 0], [4, 4]], [1, [4, 0], [3, 4]]],
        }
    }
    check_index(index, world_size=2)
