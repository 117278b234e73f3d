"""The adaptive schedule on two ranks (gloo, 127.0.0.1) that measure different step times
(an injected step clock: 10x apart) and their own save costs: every rank proposes its own
interval, all adopt the largest, and both save the same steps.

This file doubles as the worker: ``python test_adaptive_ranks.py worker DIR OUT``.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch


def worker(root: str, out: str) -> None:
    import torch.distributed as dist

    import spawn_ranks
    from resilient_callbacks import Checkpointer, PerRank

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    state = {"w": torch.zeros(8), "mine": PerRank({"t": torch.full((8,), float(rank))})}
    clock, per_step = [0.0], 1.0 if rank == 0 else 10.0  # rank 1 measures 10x slower steps
    saved = []
    # (the save costs are injected, alike on both ranks: 5 ms blocking, 10 ms persisting; with an
    # MTBF of 1.2 h, Daly's interval sqrt(2 x 0.005 x 4320) is 6.6 s: rank 0 proposes 6 or 7
    # steps, rank 1 its floor of 1. Measured for real, a quiet machine's costs made both ranks
    # propose 1 step, and a cost that moved after the last decision moved rank 0's proposal)
    with Checkpointer(root, adaptive=True, mtbf_hours=1.2, preemption=False) as ck:
        ck._trigger.now = lambda: clock[0]
        sched = ck.schedule
        assert sched is not None
        save, amend, persist = sched.observe_save, sched.amend_last_cost, sched.observe_persist
        sched.observe_save = lambda _b, p=None: save(0.005, None if p is None else 0.01)
        sched.amend_last_cost = lambda _b: amend(0.005)
        sched.observe_persist = lambda _p: persist(0.01)
        ck.restore(state)
        for s in range(1, 401):
            clock[0] += per_step
            if ck.step(s, state):
                saved.append(s)
        assert ck.schedule is not None
        info = ck.schedule.explain()
        line = ck.schedule.describe()
    res = {"saved": saved, "mine": info["interval_steps"], "decision": info["decision_steps"]}
    Path(f"{out}.rank{rank}").write_text(json.dumps({**res, "line": line}))
    spawn_ranks.leave_group()


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "worker":
    worker(sys.argv[2], sys.argv[3])

import pytest  # noqa: E402  (after the worker code, which does not need it)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_ranks_that_measure_differently_save_the_same_steps(tmp_path):
    import spawn_ranks

    argv = [sys.executable, __file__, "worker", str(tmp_path / "ck"), str(tmp_path / "out")]
    zygote = spawn_ranks.shared_zygote()  # (each rank forked: torch imported once)
    spawn_ranks.run(argv, 2, tmp_path, "adaptive", deadline=120.0, zygote=zygote)
    r0, r1 = (json.loads((tmp_path / f"out.rank{r}").read_text()) for r in (0, 1))
    assert r0["saved"] == r1["saved"] and len(r0["saved"]) >= 3, (r0, r1)
    assert r0["saved"][0] == 20  # the warm-up save
    assert r0["decision"] == r1["decision"], (r0, r1)
    # the largest proposal (the one in force may be kept within the 5% change tolerance)
    assert all(r["decision"] >= 0.95 * r["mine"] for r in (r0, r1)), (r0, r1)
    # rank 1 (slower steps: fewer of them) adopted rank 0's proposal, and says so
    assert r1["mine"] < r1["decision"], r1
    assert "the largest of the ranks' proposals; this rank's:" in r1["line"], r1["line"]
