"""A restore decodes the checkpoint's structure once: the check that every value decodes,
before anything is loaded, leaves the values it decoded for the load (structure_decode.decode's
memo), which decoded the whole structure a second time before."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from resilient_callbacks import Checkpointer, layout, structure, structure_decode


class _CountingTensors(dict):  # type: ignore[type-arg]
    """A part's tensors, counting the lookups of each key (decode looks a tensor node up)."""

    seen: collections.Counter[str]

    def __getitem__(self, key: str) -> Any:
        self.seen[key] += 1
        return super().__getitem__(key)


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra": {"arr": np.arange(5.0) + seed, "n": seed}}


def test_a_restore_decodes_each_tensor_node_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _state(0)
    with Checkpointer(tmp_path, preemption=False, async_save=False) as ck:
        ck.save(1, saved)
    parts: list[_CountingTensors] = []
    read_part = layout.read_part

    def counting(*a: Any, **k: Any) -> Any:
        part = read_part(*a, **k)
        part.tensors = _CountingTensors(part.tensors)
        part.tensors.seen = collections.Counter()
        parts.append(part.tensors)
        return part

    monkeypatch.setattr(layout, "read_part", counting)
    state = _state(1)
    with Checkpointer(tmp_path, preemption=False, read_only=True) as r:
        assert r.restore(state) == 1
    (tensors,) = parts
    seen = {k: n for k, n in tensors.seen.items() if not k.startswith("@rng/")}  # (not decoded)
    assert len([k for k in seen if k.startswith("model/")]) == 4 and len(seen) == 17
    assert set(seen.values()) == {1}  # (before: 2, the check's decode and the load's)
    live, want_sd = state["model"].state_dict(), saved["model"].state_dict()
    assert all(torch.equal(live[k], want_sd[k]) for k in want_sd)
    got, want = state["optimizer"].state_dict()["state"], saved["optimizer"].state_dict()["state"]
    assert all(torch.equal(got[i][k], want[i][k]) for i in want for k in want[i])
    assert np.array_equal(state["extra"]["arr"], np.arange(5.0)) and state["extra"]["n"] == 0


def test_decode_memo_gives_the_values_of_the_first_decode() -> None:
    t = torch.arange(3.0)
    enc, _ = structure.encode({"a": {"x": t, "y": [1, 2]}, "b": (t, 3)})
    tensors = dict(enc.tensors)
    memo: dict[int, Any] = {}
    whole = structure_decode.decode(enc.structure, tensors, memo=memo)
    node = enc.structure["a"]
    assert structure_decode.decode(node, tensors, memo=memo) is whole["a"]
    assert structure_decode.decode(node, tensors) is not whole["a"]  # (no memo: decoded afresh)
    again = structure_decode.decode(node, tensors)
    assert torch.equal(again["x"], t) and again["y"] == [1, 2]
