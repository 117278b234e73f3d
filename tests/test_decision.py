"""Decision steps (decision.py): how far apart the ranks compare their flags. The spacing bounds
how long a preemption request waits; a probe found it made for fast steps and kept for slow
ones (SIGTERM acted on 20 s after it arrived, with steps 170 times slower). The collective is
replaced by one rank's values (MAX over one rank), with world_size 2 pretended."""

from __future__ import annotations

import pytest
import torch

from resilient_callbacks import decision, dist
from resilient_callbacks.decision import Decider, spacing_step_time


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: None)
    ticks = iter(range(10**6))
    monkeypatch.setattr(decision.time, "perf_counter", lambda: next(ticks) * 2e-4)  # 0.2 ms


def test_a_slowdown_counts_at_the_next_decision_step():
    fast = [0.003] * 50
    assert spacing_step_time(fast) == pytest.approx(0.003)
    slowed = fast[5:] + [0.5] * 5  # the median is still fast
    assert spacing_step_time(slowed) == 0.5


def test_the_spacing_follows_the_step_time(two_ranks):
    d = Decider()
    step, seen = 0, []
    while step < 400:
        slow = step >= 300
        t = spacing_step_time([0.003] * 45 + ([0.5] * 5 if slow else [0.003] * 5))
        if d.decide(step, [0], t) is not None:
            seen.append((step, d.every))
        step += 1
    fast = [every for s, every in seen if s < 300]
    assert max(fast) > 10  # fast steps: a collective every many steps (0.1% budget)
    after = [every for s, every in seen if s >= 300]
    assert after and after[0] <= 2  # at 0.5 s a step: at most ~1 s between comparisons
