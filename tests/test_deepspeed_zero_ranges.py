"""How ZeroPart lays a parameter's range together from the ranges saved ranks recorded
(``zero_part._assemble``, on plain tensors): every value of the range from exactly one saved
rank, or a ``CheckpointCorruptError`` that names the parameter."""

from __future__ import annotations

import pytest
import torch

from resilient_callbacks.deepspeed.zero_part import _assemble
from resilient_callbacks.errors import CheckpointCorruptError


def _saved(*ranges: tuple[int, int]) -> tuple[dict, dict]:
    """Indexes and tensors of saved ranks, rank r holding ``ranges[r]`` of parameter ``w`` (its
    values: their own positions in the flattened parameter)."""
    indexes = {r: {"params": {"w": {"start": s, "numel": n}}} for r, (s, n) in enumerate(ranges)}
    tensors = {
        r: {"fp32/w": torch.arange(s, s + n, dtype=torch.float32)}
        for r, (s, n) in enumerate(ranges)
    }
    return indexes, tensors


def test_ranges_of_several_saved_ranks_are_laid_together() -> None:
    indexes, tensors = _saved((0, 3), (3, 3), (6, 2))
    out = _assemble("w", "fp32", "params", 2, 5, [0, 1, 2], indexes, tensors)
    assert out.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]


def test_a_gap_between_saved_ranges_is_refused_naming_the_parameter() -> None:
    indexes, tensors = _saved((0, 2), (3, 1))
    with pytest.raises(CheckpointCorruptError, match=r"'w' \(fp32\).* cover 3 of the 4"):
        _assemble("w", "fp32", "params", 0, 4, [0, 1], indexes, tensors)


def test_two_saved_ranges_that_overlap_do_not_count_as_covering_the_rest() -> None:
    """Saved ranks 0 and 1 both recorded values 0-1 of ``w``, no rank values 2-3: the copied
    values added up to the 4 needed, and values 2-3 were returned as ``torch.empty`` left them
    (the live value was overwritten with whatever the allocation held)."""
    indexes, tensors = _saved((0, 2), (0, 2))
    with pytest.raises(CheckpointCorruptError, match=r"'w' \(fp32\).*overlaps"):
        _assemble("w", "fp32", "params", 0, 4, [0, 1], indexes, tensors)
