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


def test_the_smallest_proposed_spacing_is_agreed(two_ranks, monkeypatch):
    """A rank waiting for a slower one inside the collective measures fast steps and a long
    collective, and proposes a wide spacing; agreeing on the largest proposal made a SIGTERM
    wait 20 s (92 steps of 0.2 s) with 2 ranks. The slow rank's proposal (3 steps) wins."""
    slow_rank = decision.pack([1], 3)  # it saw a preemption request, spacing 3

    def all_reduce(t, op=None):
        t.copy_(torch.maximum(t, slow_rank))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    d = Decider()
    d._collective_s = 0.2  # this rank waited in the last collective
    assert d._propose(0.003) == 100  # alone, it would space by the cap
    assert d.decide(0, [0], 0.003) == [1]
    assert d.every == 3
