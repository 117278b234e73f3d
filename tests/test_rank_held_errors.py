"""A save's failure that one rank holds: every rank raises it at the same save, none waits.

A background save's failure is stored and raised by the next save. When only some ranks held
one (a rank whose state could not be encoded raised at once; the others learned it in the
background and held it), each rank raised it at another save: a rank raised at the start of a
save, before its collectives, while its peers went on into them and waited there until the
process group's timeout (or, as here, paired their collectives with another save's). Now the
ranks exchange what they hold at each background save, in the training thread, and every rank
raises at the same save, naming the rank that failed.

Two gloo ranks (this file is the worker: ``python test_rank_held_errors.py worker DIR OUT``),
a loop that catches each save's ``CheckpointWriteError`` and goes on (as a run does whose
directory was made writable again). ``prepare``: rank 1's ``PerRank`` state raises while it is
encoded at step 10. ``write``: rank 1 cannot write its part from step 10 on (a file-size limit
on that rank's process: EFBIG), reported through the commit to every rank. Then the exchange
with a failure rank 0 alone holds. The process group's
timeout (120 s) is far above the spawn deadline: a rank left waiting fails the test.
"""

from __future__ import annotations

import datetime
import json
import resource
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

import spawn_ranks
from resilient_callbacks import Checkpointer, CheckpointWriteError, PerRank, catalog, held_failures

WORLD = 2
LIMIT = 128 * 1024  # rank 1's file-size limit in the write mode: below its part's size


class Bomb:
    """A per-rank object whose state_dict() raises on rank 1 once armed."""

    def __init__(self, rank: int) -> None:
        self.rank, self.armed = rank, False
        self.t = torch.zeros(64 * 1024)  # 256 KB per rank: above LIMIT

    def state_dict(self) -> dict[str, Any]:
        if self.armed and self.rank == 1:
            raise RuntimeError("simulated failure encoding rank 1's state")
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = sd["t"]


def _outcome(call: Any) -> Any:
    try:
        return call()
    except CheckpointWriteError as e:
        return {"failed_ranks": list(e.failed_ranks), "message": str(e)}


def _run(root: Path, mode: str, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    bomb = Bomb(rank)
    state = {"model": nn.Linear(8, 8), "mine": PerRank(bomb)}
    res: dict[str, Any] = {"saves": []}
    with Checkpointer(root, async_save=True) as ck:
        ck.save(5, state)
        ck.flush()
        if mode == "prepare":
            bomb.armed = True
        elif mode == "write" and rank == 1:  # every later write of rank 1's part fails (EFBIG)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))
        for step in (10, 11, 12):
            res["saves"].append(_outcome(lambda s=step: ck.save(s, state)))
            bomb.armed = False
        res["flush"] = _outcome(lambda: ck.flush() or "flushed")
    if mode == "write" and rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    dist.barrier()
    res["steps"] = [e.step for e in catalog.committed(catalog.scan(str(root), catalog.Depth.FULL))]
    return res


def worker(root: str, out: str) -> None:
    import torch.distributed as dist

    # far above the spawn deadline: a rank left waiting in a collective fails the test
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    res = {mode: _run(Path(root) / mode, mode, rank) for mode in ("prepare", "write")}
    # the exchange itself, with a failure only rank 0 holds (what rank 0's own work after a
    # commit that every rank learned of leaves: its retention pass, its upload queue)
    res["nothing"] = _outcome(lambda: held_failures.agree(11, rank, None, None, root) or "ok")
    mine = CheckpointWriteError("the save of step 10 stopped on rank 0: OSError: EIO", (0,))
    held = mine if rank == 0 else None
    res["held"] = _outcome(lambda: held_failures.agree(11, rank, held, None, root))
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    spawn_ranks.leave_group()


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "worker":
    try:
        worker(sys.argv[2], sys.argv[3])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)

import pytest  # noqa: E402  (after the worker code, which does not need it)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _failed(outcome: Any) -> list[int] | None:
    return outcome["failed_ranks"] if isinstance(outcome, dict) else None


def test_a_failure_one_rank_holds_is_raised_on_every_rank_at_the_same_save(tmp_path):
    out = tmp_path / "result"
    spawn_ranks.run(
        [sys.executable, __file__, "worker", str(tmp_path / "ckpt"), str(out)],
        WORLD,
        tmp_path,
        "held",
        deadline=60.0,
        zygote=spawn_ranks.shared_zygote(),
    )
    r0, r1 = (json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD))
    # the encoding failure: raised by every rank at the save of step 10 (rank 0 raised it at
    # step 11, before that save's collectives, while rank 1 went on into them)
    for res in (r0["prepare"], r1["prepare"]):
        s10, s11, s12 = res["saves"]
        assert _failed(s10) == [1], res
        assert "simulated failure encoding rank 1's state" in s10["message"], res
        assert s11 is True and s12 is True and res["flush"] == "flushed", res
        assert res["steps"] == [5, 11, 12], res
    # rank 1 cannot write: reported through the commit, held by both ranks, raised by both at
    # the next save (not made); the save after it fails again, raised by both at flush()
    for res in (r0["write"], r1["write"]):
        s10, s11, s12 = res["saves"]
        assert s10 is True and s12 is True, res
        assert _failed(s11) == [1] and "step 10" in s11["message"], res
        assert _failed(res["flush"]) == [1] and "step 12" in res["flush"]["message"], res
        assert res["steps"] == [5], res
    # a failure rank 0 alone holds: rank 0 raises it, rank 1 an error naming it, at once
    assert r0["nothing"] == r1["nothing"] == "ok"
    assert r0["held"]["message"] == "the save of step 10 stopped on rank 0: OSError: EIO", r0
    assert r1["held"]["failed_ranks"] == [0], r1
    assert r1["held"]["message"].startswith(
        "the save of step 11 was not made on any rank: an earlier background save failed on "
        "rank(s) 0, which raise it now: rank 0: CheckpointWriteError: the save of step 10 "
        "stopped on rank 0: OSError: EIO."
    ), r1


@pytest.mark.parametrize("said", ["its own text.", "its own text", "its own text.  "])
def test_the_failures_text_ends_each_sentence_with_one_full_stop(said):
    """A failure whose text ends with a full stop (a warning raised as an error: "...what it
    would delete).") read "...delete).. Nothing was committed"; one without still gets one."""
    err = held_failures.own_prepare_error(ValueError(said), 4, 1, "/ck")
    assert str(err) == (
        "checkpoint for step 4 was not committed; failed on rank(s) 1: rank 1: ValueError: "
        "its own text. Nothing was committed and older checkpoints in /ck are intact."
    )
    err = held_failures._held_elsewhere("restore() was not attempted", [(1, said)], "/ck", "x")
    assert str(err) == (
        "restore() was not attempted on any rank: an earlier background save failed on rank(s) "
        "1, which raise it now: rank 1: its own text. The checkpoints committed in /ck are "
        "intact; x as usual."
    )
