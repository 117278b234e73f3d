"""Checkpointer.abort(exc): the one entry point adapters call when training fails (instead of
``ckpt.__exit__(...)``). With save_on_exception it saves the last step step() saw, then closes;
without it, or for our own errors and deliberate exits, it only closes. It never raises ``exc``."""

from __future__ import annotations

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.errors import CheckpointError, CheckpointWriteError


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "n": 0}


@pytest.mark.parametrize("async_save", [True, False])
def test_abort_saves_the_last_consistent_step_and_closes(tmp_path, async_save):
    state = _state()
    ck = Checkpointer(tmp_path, every_n_steps=100, save_on_exception=True, async_save=async_save)
    for step in (1, 2, 3):
        state["n"] = step
        ck.step(step, state)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    state["n"] = 99  # changed after step 3 was reported: not part of the saved state
    ck.abort(RuntimeError("the data loader died"))
    assert ck._closed
    assert [e.step for e in ck.checkpoints()] == [3]
    with pytest.raises(CheckpointError, match="closed"):
        ck.save(4, state)

    fresh = _state()
    with torch.no_grad():
        fresh["model"].weight.zero_()
    with Checkpointer(tmp_path) as ck2:
        assert ck2.restore(fresh) == 3
    assert fresh["n"] == 3
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, expected[k])


@pytest.mark.parametrize(
    "exc",
    [SystemExit(75), CheckpointWriteError("disk full", (0,))],
    ids=["deliberate exit", "our own failure"],
)
def test_abort_only_closes_for_exits_and_checkpoint_errors(tmp_path, exc):
    state = _state()
    ck = Checkpointer(tmp_path, every_n_steps=100, save_on_exception=True)
    ck.step(1, state)
    ck.abort(exc)
    assert ck._closed and ck.checkpoints() == []


def test_abort_without_save_on_exception_only_closes_and_is_idempotent(tmp_path):
    state = _state()
    ck = Checkpointer(tmp_path, every_n_steps=100)
    ck.step(1, state)
    ck.abort(RuntimeError("boom"))
    ck.abort(RuntimeError("again"))  # closed already: nothing happens
    assert ck._closed and ck.checkpoints() == []
    Checkpointer(tmp_path).close()  # the directory lock was released


def test_with_block_goes_through_abort_and_the_exception_propagates(tmp_path):
    state = _state()
    with (
        pytest.raises(KeyError, match="lost"),
        Checkpointer(tmp_path, every_n_steps=100, save_on_exception=True) as ck,
    ):
        ck.step(7, state)
        raise KeyError("lost")
    assert [e.step for e in ck.checkpoints()] == [7]
