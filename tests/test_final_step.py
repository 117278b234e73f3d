"""``step(..., final=True)``: a finished run leaves a checkpoint of its last step, so re-running
the finished job restores the end and trains nothing."""

from __future__ import annotations

import torch

from resilient_callbacks import Checkpointer, catalog


def _train(ckdir, total: int, final: bool) -> tuple[int, list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    trained = []
    with Checkpointer(ckdir, every_n_steps=10, keep_last=5) as ck:
        start = step = ck.restore(state)
        while step < total:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            trained.append(step)
            ck.step(step, state, final=final and step == total)
    return start, trained


def _steps(ckdir) -> list[int]:
    entries = catalog.scan(str(ckdir), catalog.Depth.FULL)
    return [e.step for e in catalog.committed(entries)]


def test_final_step_is_saved_and_a_rerun_trains_nothing(tmp_path):
    start, trained = _train(tmp_path / "ck", 25, final=True)
    assert start == 0 and trained == list(range(1, 26))
    assert _steps(tmp_path / "ck") == [10, 20, 25]
    start, trained = _train(tmp_path / "ck", 25, final=True)
    assert start == 25 and trained == []


def test_without_final_the_tail_after_the_last_interval_is_retrained(tmp_path):
    _train(tmp_path / "ck", 25, final=False)
    assert _steps(tmp_path / "ck") == [10, 20]
    start, trained = _train(tmp_path / "ck", 25, final=False)
    assert start == 20 and trained == [21, 22, 23, 24, 25]


def test_final_on_a_step_already_saved_does_not_save_twice(tmp_path):
    _train(tmp_path / "ck", 20, final=True)
    assert _steps(tmp_path / "ck") == [10, 20]
