"""``every_seconds`` across restarts: the time since the last save counts the lives before.

A fake clock (``time.time`` for the history, ``time.monotonic`` for the policy's clock) moves a
minute per step; nothing sleeps."""

from __future__ import annotations

import time

import torch

from resilient_callbacks import Checkpointer, history

MIN = 60.0


def _life(root, state, clock: list[float], steps: int, **kw) -> tuple[int, list[int]]:
    """One process: restore, ``steps`` training steps of a minute each, then killed (it
    leaves with an exception: no clean end, the next start is a restart after a failure)."""
    ck = Checkpointer(root, every_seconds=60 * MIN, async_save=False, preemption=False, **kw)
    step = ck.restore(state)
    saved = []
    for _ in range(steps):
        clock[0] += MIN
        step += 1
        with torch.no_grad():
            state["w"].add_(1.0)
        if ck.step(step, state):
            saved.append(step)
    ck.abort(RuntimeError("killed"))
    clock[0] += 5 * MIN  # down: requeued, waiting
    return step, saved


def test_every_seconds_counts_the_running_time_of_the_lives_before(tmp_path, monkeypatch):
    """The clock of every_seconds restarted with each process: a job killed every 50 minutes
    with every_seconds=3600 never saved and trained the same 50 minutes again forever. The
    time since the last save (or, with none, since the run started) now counts the time the
    run's earlier lives ran after it, the time it was down left out."""
    clock = [1.7e9]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    root, state = tmp_path / "ck", {"w": torch.zeros(4)}
    assert _life(root, state, clock, 50) == (50, [])  # killed before its first save
    # the run goes on from nothing saved: 50 of its 60 minutes ran already
    assert _life(root, state, clock, 50) == (50, [10])
    # resumed from step 10, saved 40 minutes of running before the kill
    assert _life(root, state, clock, 50) == (60, [30])
    assert [r["step"] for r in history.records(str(root), ("save",))] == [10, 30]


def test_the_time_down_is_not_counted(tmp_path, monkeypatch):
    """Days in the queue between a kill and the restart are no running time: the restarted
    process saves 60 minutes of running after the checkpoint, not at once."""
    clock = [1.7e9]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    root, state = tmp_path / "ck", {"w": torch.zeros(4)}
    assert _life(root, state, clock, 70) == (70, [60])  # ran 10 minutes after its save
    clock[0] += 3 * 86400.0
    assert _life(root, state, clock, 60) == (120, [110])  # 10 + 50 minutes


def test_a_restart_from_an_older_checkpoint_counts_from_the_last_save(tmp_path, monkeypatch):
    """resume=<an older checkpoint of the run> (or a fallback past a damaged newest one): the
    time since the run's last save counts, not since the older one's (which would make the
    first step save at once)."""
    clock = [1.7e9]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    root, state = tmp_path / "ck", {"w": torch.zeros(4)}
    assert _life(root, state, clock, 130) == (130, [60, 120])  # killed 10 minutes after a save
    older = str(root / "step_000000060")
    assert _life(root, state, clock, 55, resume=older) == (115, [110])  # 10 + 50 minutes
