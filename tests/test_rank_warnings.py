"""More of what a run of two gloo ranks says (the rule in ``resilient_callbacks.notices``; the
first cases are in tests/test_rank_notices.py): a notice the ranks say after comparing their
restores, not before (a restore that fails on another rank replaced no RNG states); the state
of the ranks gone that any rank's part tells of, not rank 0's alone; and with the warnings made
errors (``python -W error``), a notice that stops one rank stops every rank: none goes on to
its next collective and waits there for a rank that is gone.

The worker is this file: ``python test_rank_warnings.py WORKER DIR``.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
from torch import nn

import spawn_ranks
from resilient_callbacks import Checkpointer, PerRank

# a gloo timeout far past the tests' deadlines: a rank left waiting fails the test by the
# deadline, not by a collective that gave up and ended the rank as if it had stopped with it
_PG_TIMEOUT = datetime.timedelta(seconds=900)


def _init() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=_PG_TIMEOUT)
    return dist.get_rank()


class _FailsOnRank1:
    """A stateful object whose load fails on rank 1 only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        if self.rank == 1:
            raise ValueError("rank 1 cannot load this")


def replaced_worker(root: str) -> None:
    """A model's and an EMA's Checkpointer in one process, the EMA's last checkpoint a step
    older; the EMA's restore fails on rank 1 (after rank 0 set its RNG states): it replaced
    nothing, and no rank says it did."""
    import torch.distributed as dist

    rank = _init()
    for name, steps in (("model", [1, 2]), ("ema", [1])):
        with Checkpointer(os.path.join(root, name), async_save=False) as ck:
            for s in steps:
                ck.save(s, {"w": torch.full((2,), float(s)), "obj": _FailsOnRank1(0)})
    with Checkpointer(os.path.join(root, "model")) as a:
        assert a.restore({"w": torch.zeros(2), "obj": _FailsOnRank1(0)}) == 2
        b = Checkpointer(os.path.join(root, "ema"))
        try:
            b.restore({"w": torch.zeros(2), "obj": _FailsOnRank1(rank)})
        except Exception as e:
            print(f"RESTORE FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        b.close()
    dist.barrier()
    spawn_ranks.leave_group()


def gone_worker(root: str, ranks: str) -> None:
    """Saved by 3 ranks (``ranks`` "3"), restored by 2 ("2"): the PerRank state and the RNG
    states of rank 2 are not loaded, said once (rank 0's ``PerRank`` state is empty, the
    others' are not)."""
    import torch.distributed as dist

    rank = _init()
    items = {"seen": torch.full((2,), float(rank))} if rank else {}
    state = {"w": torch.zeros(2), "mine": PerRank(items)}
    ck = Checkpointer(root, async_save=False)
    if ranks == "3":
        ck.save(1, state)
    else:
        assert ck.restore(state) == 1
    dist.barrier()  # a rank that went on waits here for the one that stopped
    print("PASSED THE BARRIER", file=sys.stderr)
    ck.close()
    spawn_ranks.leave_group()


def werror_worker(root: str, which: str) -> None:
    """Run with ``-W error:<a notice>``. ``once``: a checkpoint saved without RNG states,
    restored: rank 0 says so (the same on every rank), and its warning raises there. ``own``:
    a checkpoint of one rank restored on two: rank 1's own notice (it has no RNG state)
    raises there. Either way every rank must stop, none wait at the barrier after."""
    import torch.distributed as dist

    _init()
    if which == "once":
        with Checkpointer(root, capture_rng=False, async_save=False) as ck:
            ck.save(1, {"model": nn.Linear(2, 2)})
    ck = Checkpointer(root)
    ck.restore({"model": nn.Linear(2, 2)})  # (the warning made an error raises out of here)
    dist.barrier()  # a rank that went on waits here for the one that stopped
    print("PASSED THE BARRIER", file=sys.stderr)
    ck.close()
    spawn_ranks.leave_group()


def plain_dcp_worker(root: str) -> None:
    """Plain ``dcp.save`` on two ranks, read back through ``plain_dcp_reader`` on both: that
    it unpickles is the same on every rank, said once."""
    import torch.distributed.checkpoint as dcp

    from resilient_callbacks.dcp import plain_dcp_reader

    _init()
    dcp.save({"w": torch.ones(4)}, checkpoint_id=root)
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=plain_dcp_reader(root, allow_pickle=True))
    assert torch.equal(back["w"], torch.ones(4))
    spawn_ranks.leave_group()


def logger_sink_worker(root: str) -> None:
    """``telemetry="logger"`` on a plain Checkpointer of two ranks: no framework sends its
    metrics, the same on every rank: said once."""
    _init()
    with Checkpointer(root, every_n_steps=1, telemetry="logger", async_save=False) as ck:
        ck.step(1, {"w": torch.zeros(2)})
    spawn_ranks.leave_group()


def _exit_at_once(worker) -> None:
    """Run ``worker``; one that raises (the ``-W error`` cases: a warning made an error) prints
    its traceback and exits with status 1 at once. Left to interpreter teardown with its
    Checkpointer and process group alive, a rank aborted there now and then under load
    (SIGABRT, "terminate called without an active exception": torch's, as
    ``spawn_ranks.leave_group`` says) instead of exiting with 1."""
    try:
        worker()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__" and len(sys.argv) >= 3:
    _exit_at_once(
        {
            "logger-sink-worker": lambda: logger_sink_worker(sys.argv[2]),
            "plain-dcp-worker": lambda: plain_dcp_worker(sys.argv[2]),
            "replaced-worker": lambda: replaced_worker(sys.argv[2]),
            "gone-worker": lambda: gone_worker(sys.argv[2], sys.argv[3]),
            "werror-worker": lambda: werror_worker(sys.argv[2], sys.argv[3]),
        }[sys.argv[1]]
    )


import pytest  # noqa: E402  (after the worker code, which does not need it)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _count(outputs: list[str], text: str) -> list[int]:
    """Per rank: how many lines of its output hold ``text``."""
    return [sum(text in line for line in out.splitlines()) for out in outputs]


def test_a_restore_that_fails_on_another_rank_says_no_rng_states_were_replaced(tmp_path):
    argv = [sys.executable, __file__, "replaced-worker", str(tmp_path / "ckpt")]
    zygote = spawn_ranks.shared_zygote()  # (each rank forked: torch imported once)
    outputs = spawn_ranks.run(argv, 2, tmp_path, "replaced", deadline=240, zygote=zygote).outputs
    shown = "\n".join(outputs)
    assert _count(outputs, "RESTORE FAILED") == [1, 1], shown
    assert _count(outputs, "restore failed on rank 1") == [1, 0], shown
    assert _count(outputs, "replace those restored from step 2") == [0, 0], shown


@pytest.mark.slow
def test_the_per_rank_state_of_the_ranks_gone_is_said_where_only_other_ranks_hold_some(tmp_path):
    root = str(tmp_path / "ckpt")
    spawn_ranks.run([sys.executable, __file__, "gone-worker", root, "3"], 3, tmp_path, "save")
    argv = [sys.executable, __file__, "gone-worker", root, "2"]
    outputs = spawn_ranks.run(argv, 2, tmp_path, "restore", deadline=240).outputs
    shown = "\n".join(outputs)
    assert _count(outputs, "the PerRank state of rank 2 in 'mine' is not loaded") == [1, 0], shown
    assert _count(outputs, "the RNG states of rank 2 are not loaded") == [1, 0], shown


def _werror(tmp_path, notice: str, *args: str) -> list[str]:
    argv = [sys.executable, "-W", f"error:{notice}", __file__, *args]
    # (a rank left waiting at the barrier misses the deadline: the gloo timeout is longer)
    outputs = spawn_ranks.run(argv, 2, tmp_path, "werror", expect=1, deadline=200).outputs
    assert _count(outputs, "PASSED THE BARRIER") == [0, 0], "\n".join(outputs)
    return outputs


def test_warnings_as_errors_stop_every_rank_where_rank_0_says_a_notice_once(tmp_path):
    notice = "the checkpoint was saved without RNG states"
    outputs = _werror(tmp_path, notice, "werror-worker", str(tmp_path / "ckpt"), "once")
    shown = "\n".join(outputs)
    for out in outputs:  # each rank's traceback ends with the warning raised
        assert f"UserWarning: {notice}" in out, shown


def test_warnings_as_errors_stop_every_rank_where_one_rank_says_its_own_notice(tmp_path):
    from resilient_callbacks import Checkpointer as Single

    with Single(str(tmp_path / "ckpt"), async_save=False) as ck:  # a checkpoint of one rank
        ck.save(1, {"model": nn.Linear(2, 2)})
    notice = "rank 1 has no RNG state in this checkpoint"
    outputs = _werror(tmp_path, notice, "werror-worker", str(tmp_path / "ckpt"), "own")
    shown = "\n".join(outputs)
    assert f"UserWarning: {notice}" in outputs[1], shown
    assert f"restore failed on rank 1: UserWarning: {notice}" in outputs[0], shown


@pytest.mark.slow
def test_warnings_as_errors_stop_every_rank_where_rank_0_says_what_the_ranks_gone_lose(tmp_path):
    root = str(tmp_path / "ckpt")
    spawn_ranks.run([sys.executable, __file__, "gone-worker", root, "3"], 3, tmp_path, "save")
    notice = "the checkpoint was written by 3 ranks, this run has 2"
    outputs = _werror(tmp_path, notice, "gone-worker", root, "2")
    for out in outputs:  # each rank's traceback ends with the warning raised
        assert f"UserWarning: {notice}" in out, "\n".join(outputs)


@pytest.mark.slow
def test_reading_a_plain_dcp_checkpoint_on_two_ranks_says_it_unpickles_once(tmp_path):
    argv = [sys.executable, __file__, "plain-dcp-worker", str(tmp_path / "plain")]
    outputs = spawn_ranks.run(argv, 2, tmp_path, "plain", deadline=240).outputs
    said = "unpickles its metadata and objects"
    assert _count(outputs, said) == [1, 0], "\n".join(outputs)


@pytest.mark.slow
def test_a_logger_sink_without_a_framework_on_two_ranks_is_said_once(tmp_path):
    argv = [sys.executable, __file__, "logger-sink-worker", str(tmp_path / "ckpt")]
    outputs = spawn_ranks.run(argv, 2, tmp_path, "sink", deadline=240).outputs
    said = "this Checkpointer has none, so that sink does nothing"
    assert _count(outputs, said) == [1, 0], "\n".join(outputs)
