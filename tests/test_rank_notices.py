"""What a run of two ranks prints: each notice once across the ranks, or once per rank where it
is about that rank's own state and names it (the rule in ``resilient_callbacks.notices``).

A job's stderr merges every rank's: a notice printed by every rank is read 8 or 64 times. The
worker (this file: ``python test_rank_notices.py plain-worker DIR``) is a plain ``Checkpointer``
on two gloo ranks, run as a user runs it (no logging configured, Python's default warning
filters): it starts fresh, saves with retention, restores with a corrupt newest checkpoint
(the fallback), a removed key, tensors cast to another dtype, in the replicated state and in
each rank's ``PerRank`` state, then acts on a preemption request (SIGUSR1 on both ranks) and
closes; one without a save schedule steps, and its checkpoint, saved without RNG states, is
restored. ``dcp.load`` through the drop-in reader says its fallback once. A script that
configured logging at INFO finds in rank 1's log what rank 0 said once. Lightning DDP
(tests/lightning_train.py as two ranks) says a setting that changed since the checkpoint once,
the Transformers Trainer (tests/hf_train.py as two ranks) that it has no save trigger once.
The tests count the lines of each rank's output that hold each notice.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import spawn_ranks
from resilient_callbacks import Checkpointer, PerRank
from torch_needs import needs_transformers


def _state(rank: int, dtype: torch.dtype, new: bool) -> dict:
    torch.manual_seed(0)
    extra = {"history": [1]}
    mine = {"info": {"rank": rank}, "t": torch.zeros(3, dtype=dtype)}
    if new:  # keys the new code adds, which the checkpoints of the old code lack
        extra["new_shared_key"] = 1
        mine["info"]["new_rank_key"] = rank
    return {
        "model": nn.Linear(4, 4).to(dtype),
        "extra": extra,
        "mine": PerRank(mine),
    }


def plain_worker(root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    state = _state(rank, torch.float32, new=False)
    ck = Checkpointer(root, every_n_steps=2, keep_last=2, async_save=False)
    start = ck.restore(state)
    for s in range(start + 1, 7):  # saves 2, 4, 6; retention deletes 2
        ck.step(s, state)
    ck.close()
    dist.barrier()
    if rank == 0:  # the newest checkpoint damaged: the restore falls back to step 4
        path = os.path.join(root, "step_000000006", "shared.safetensors")
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    dist.barrier()

    state = _state(rank, torch.float64, new=True)
    ck = Checkpointer(root, every_n_steps=2, keep_last=2, exit_on_preemption=False)
    step = ck.restore(state)
    assert step == 4, step
    deadline = time.monotonic() + 120  # the ranks act at their next decision step (~1 s)
    while not ck.preempted and time.monotonic() < deadline:
        step += 1
        if step == 6:
            os.kill(os.getpid(), signal.SIGUSR1)
        ck.step(step, state)
    assert ck.preempted
    ck.close()

    other = os.path.join(root, "no_rng")  # a checkpoint saved without the random streams
    with Checkpointer(other, capture_rng=False, async_save=False) as ck:  # (no schedule)
        ck.step(1, {"model": nn.Linear(2, 2)})
        ck.save(1, {"model": nn.Linear(2, 2)})
    with Checkpointer(other) as ck:
        assert ck.restore({"model": nn.Linear(2, 2)}) == 1
    spawn_ranks.leave_group()


def exit_worker(root: str) -> None:
    """A preemption request with ``exit_on_preemption`` (the default): both ranks save and exit
    with code 75."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    state = _state(dist.get_rank(), torch.float32, new=False)
    ck = Checkpointer(root, every_n_steps=1000)
    step = ck.restore(state)
    deadline = time.monotonic() + 120  # the ranks act at their next decision step (~1 s)
    while time.monotonic() < deadline:  # step() exits the process once the ranks act on it
        step += 1
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        ck.step(step, state)
    raise AssertionError("the preemption request was not acted on")


class _Window:
    """A gradient accumulation window of micro-steps ``1..end-1`` (``mid_step`` inside it, as
    ``accelerate.Accumulation`` says), then one optimizer step per micro-step."""

    def __init__(self, end: int) -> None:
        self.end, self.micro = end, 0

    @property
    def mid_step(self) -> bool:
        return self.micro < self.end

    @property
    def steps_left(self) -> int:
        return max(0, self.end - self.micro)

    def state_dict(self) -> dict:
        return {"micro": self.micro}

    def load_state_dict(self, sd: dict) -> None:
        self.micro = sd["micro"]


def _two_checkpointers(root: str) -> None:
    """A model's and an EMA's Checkpointer in one process, the EMA's killed before its save of
    step 2: the second restore replaces the random streams of step 2 with those of step 1,
    the same on every rank (said once)."""
    for name, steps in (("model", [1, 2]), ("ema", [1])):
        with Checkpointer(os.path.join(root, name), async_save=False) as ck:
            for s in steps:
                ck.save(s, {"w": torch.full((2,), float(s))})
    with Checkpointer(os.path.join(root, "model")) as a:
        assert a.restore({"w": torch.zeros(2)}) == 2
        with Checkpointer(os.path.join(root, "ema")) as b:
            assert b.restore({"w": torch.zeros(2)}) == 1


def held_worker(root: str) -> None:
    """SIGUSR1 on rank 1 only, inside an accumulation window that ends at micro-step 400 (the
    ranks act on a request within 100 steps): the ranks hold the preemption together and save
    at the window's end; rank 0 says so once, naming rank 1's signal. Then two Checkpointers
    restoring the process's random streams from two steps (said once), and the CUDA random
    streams of a checkpoint of more devices than this rank sees: each rank says so, naming
    itself."""
    import torch.distributed as dist

    from resilient_callbacks import rng

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    window = _Window(400)
    state = {"model": nn.Linear(2, 2), "window": window}
    ck = Checkpointer(root, every_n_steps=10**6, exit_on_preemption=False, async_save=False)
    step = ck.restore(state)
    while not ck.preempted and step < 1000:
        step += 1
        window.micro = step
        if step == 5 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        ck.step(step, state)
    assert ck.preempted and step == 400, step
    ck.close()
    _two_checkpointers(root)
    info, tensors = rng.capture()
    n = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    info["cuda_devices"] = n
    tensors.update({f"@rng/cuda_{i}": torch.zeros(16, dtype=torch.uint8) for i in range(n)})
    for said in rng.restore(info, tensors):
        print(said, file=sys.stderr)
    spawn_ranks.leave_group()


def dcp_worker(root: str) -> None:
    """``dcp.save`` twice through the drop-in writer; the newest checkpoint damaged, ``dcp.load``
    through the reader falls back to the older one."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with ResilientStorageWriter(root, keep_last=2) as writer:
        for step in (1, 2):
            writer.step = step
            dcp.save({"model": model.state_dict()}, storage_writer=writer)
    dist.barrier()
    if dist.get_rank() == 0:
        shard = os.path.join(root, "step_000000002", "dcp", "rank_00000.safetensors")
        with open(shard, "r+b") as f:
            f.seek(-2, os.SEEK_END)
            byte = f.read(1)
            f.seek(-2, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    reader = ResilientStorageReader(root)
    dcp.load({"model": nn.Linear(4, 4).state_dict()}, storage_reader=reader)
    assert reader.loaded_step == 1, reader.loaded_step
    spawn_ranks.leave_group()


def info_worker(root: str) -> None:
    """A script that configured logging at INFO (each rank's log kept whole): a checkpoint
    saved without RNG states, restored; a preemption request on rank 1 only."""
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    with Checkpointer(root, capture_rng=False, async_save=False) as ck:
        ck.save(1, {"model": nn.Linear(2, 2)})
    with Checkpointer(root, exit_on_preemption=False) as ck:
        step = ck.restore({"model": nn.Linear(2, 2)})
        while not ck.preempted and step < 1000:
            step += 1
            if step == 3 and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            ck.step(step, {"model": nn.Linear(2, 2)})
        assert ck.preempted
    spawn_ranks.leave_group()


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "info-worker":
    info_worker(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "dcp-worker":
    dcp_worker(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "plain-worker":
    plain_worker(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "exit-worker":
    exit_worker(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "held-worker":
    held_worker(sys.argv[2])


import pytest  # noqa: E402  (after the worker code, which does not need it)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _count(outputs: list[str], text: str) -> list[int]:
    """Per rank: how many lines of its output hold ``text``."""
    return [sum(text in line for line in out.splitlines()) for out in outputs]


def test_a_plain_checkpointer_on_two_ranks_says_each_notice_once(tmp_path):
    argv = [sys.executable, __file__, "plain-worker", str(tmp_path / "ckpt")]
    zygote = spawn_ranks.shared_zygote()  # (each rank forked: torch imported once)
    outputs = spawn_ranks.run(argv, 2, tmp_path, "plain", deadline=240, zygote=zygote).outputs
    shown = "\n".join(f"--- rank {r}:\n{out}" for r, out in enumerate(outputs))
    once = [  # the same on every rank: rank 0 says it
        "skipping checkpoint",  # the fallback from the damaged step 6
        "state['extra']['new_shared_key'] not in the checkpoint",
        "state['model']['weight']: float32 in checkpoint, float64 here",
        "preemption (SIGUSR1): saving step",
        "the checkpoint was saved without RNG states",
        "no save schedule is configured",
    ]
    for text in once:
        assert _count(outputs, text) == [1, 0], f"{text!r}:\n{shown}"
    for r in (0, 1):  # this rank's own PerRank state: each rank says it, naming itself
        mine = [
            f"rank {r}: restore: state['mine']['info']['new_rank_key'] not in the checkpoint",
            f"rank {r}: 1 tensor(s) of the checkpoint are cast",
        ]
        for text in mine:
            assert _count(outputs, text) == [int(r == 0), int(r == 1)], f"{text!r}:\n{shown}"


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_a_preemption_that_exits_says_its_save_and_its_exit_once(tmp_path):
    argv = [sys.executable, __file__, "exit-worker", str(tmp_path / "ckpt")]
    outputs = spawn_ranks.run(argv, 2, tmp_path, "exit", expect=75, deadline=240).outputs
    for text in ("preemption (SIGUSR1): saving step", "committed; exiting with code 75"):
        assert _count(outputs, text) == [1, 0], f"{text!r}:\n" + "\n".join(outputs)


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_a_preemption_only_rank_1_got_is_held_and_saved_said_once_naming_rank_1(tmp_path):
    argv = [sys.executable, __file__, "held-worker", str(tmp_path / "ckpt")]
    outputs = spawn_ranks.run(argv, 2, tmp_path, "held", deadline=240).outputs
    shown = "\n".join(outputs)
    held = "is inside a gradient accumulation window"
    assert _count(outputs, held) == [1, 0], shown
    assert _count(outputs, "preemption (SIGUSR1 on rank 1) at step") == [1, 0], shown
    assert _count(outputs, "preemption (SIGUSR1 on rank 1): saving step 400") == [1, 0], shown
    assert _count(outputs, "saving step") == [1, 0], shown
    assert _count(outputs, "replace those restored from step 2") == [1, 0], shown
    cuda = "CUDA device(s) but"
    assert _count(outputs, cuda) == [1, 1], shown
    for r in (0, 1):
        assert _count(outputs, f"rank {r}: the checkpoint holds RNG states of") == [
            int(r == 0),
            int(r == 1),
        ], shown


def test_the_other_ranks_log_at_info_what_rank_0_says_once(tmp_path):
    """What rank 0 says once, the other ranks log at INFO: a script that configured logging at
    INFO finds it in every rank's log (docs/distributed.md)."""
    argv = [sys.executable, __file__, "info-worker", str(tmp_path / "ckpt")]
    zygote = spawn_ranks.shared_zygote()  # (each rank forked: torch imported once)
    outputs = spawn_ranks.run(argv, 2, tmp_path, "info", deadline=240, zygote=zygote).outputs
    shown = "\n".join(outputs)
    for text, on_0 in (  # rank 0: a warning and its WARNING line, or a WARNING line alone
        ("the checkpoint was saved without RNG states", 2),
        ("preemption (SIGUSR1 on rank 1): saving step", 1),
    ):
        lines = [[x for x in out.splitlines() if text in x] for out in outputs]
        assert [len(x) for x in lines] == [on_0, 1], f"{text!r}:\n{shown}"
        assert lines[1][0].startswith("INFO resilient_callbacks"), f"{text!r}:\n{shown}"


def test_a_node_local_restore_from_the_remote_is_said_by_its_node_naming_it(tmp_path):
    """Node-local mode, two nodes of one rank (tests/test_nodelocal_failures.py's worker),
    the remote a file:// directory; node 1's disk wiped after a first run: its leader says
    that it restores its files from the remote, naming node 1 ('this node's' on a merged
    log of 8 nodes named none); node 0 restores from its disk and says nothing of it."""
    import shutil

    import test_nodelocal_failures as worker

    def run(name: str, steps: int, **env: str) -> list[str]:
        argv = [sys.executable, worker.__file__, str(tmp_path), "--steps", str(steps)]
        zygote = spawn_ranks.shared_zygote()
        env = {"RC_PER_NODE": "1", "RC_OUTAGE_S": "2", **env}
        return spawn_ranks.run(argv, 2, tmp_path, name, env=env, zygote=zygote).outputs

    run("first", 4)  # closed: committed remotely
    shutil.rmtree(tmp_path / "node1")
    outputs = run("second", 6)
    shown = "\n".join(outputs)
    assert _count(outputs, "restoring node 1's 4 file(s) of step 4 from the remote") == [0, 1]
    assert _count(outputs, "from the remote copy") == [0, 1], shown
    assert _count(outputs, "this node's") == [0, 0], shown
    # the store refuses connections at a restart: each node goes on from its own disk, and
    # says so naming itself (whether a node reaches the store is its own)
    outputs = run("down", 8, RC_PREFLIGHT_FAILS="refused", RC_SCAN_FAILS_AFTER="0")
    shown = "\n".join(outputs)
    going_on = "holds checkpoints: going on with them; uploads are retried"
    assert _count(outputs, going_on) == [1, 1], shown
    for r in (0, 1):
        assert [
            sum(going_on in line and line.startswith(f"node {r}: ") for line in out.splitlines())
            for out in outputs
        ] == [int(r == 0), int(r == 1)], shown


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_the_dcp_reader_on_two_ranks_says_its_fallback_once(tmp_path):
    argv = [sys.executable, __file__, "dcp-worker", str(tmp_path / "ckpt")]
    outputs = spawn_ranks.run(argv, 2, tmp_path, "dcp", deadline=240).outputs
    for text in ("skipping checkpoint", "dcp.load: restored"):
        assert _count(outputs, text) == [1, 0], f"{text!r}:\n" + "\n".join(outputs)


HERE = Path(__file__).parent


def _framework_run(script: str, tmp_path: Path, name: str, *args: str) -> list[str]:
    argv = [sys.executable, str(HERE / script), *args]
    return spawn_ranks.run(argv, 2, tmp_path, name, deadline=280).outputs


@pytest.mark.slow  # two Lightning DDP runs of 2 ranks: about 10 s alone, more in the suite
@pytest.mark.timeout(600)
def test_lightning_ddp_says_a_setting_changed_since_the_checkpoint_once(tmp_path):
    pytest.importorskip("lightning")
    common = ["--devices", "2", "--every-n-steps", "4", "--root", str(tmp_path)]
    common += ["--out-jsonl", str(tmp_path / "o.jsonl"), "--out-params", str(tmp_path / "p.st")]
    ck = str(tmp_path / "ckpt")
    _framework_run("lightning_train.py", tmp_path, "first", ck, "--max-steps", "8", *common)
    outputs = _framework_run(
        "lightning_train.py",
        tmp_path,
        "resumed",
        ck,
        "--max-steps",
        "10",
        "--accumulate",
        "2",
        *common,
    )
    text = "accumulate_grad_batches=2 here, 1 when the checkpoint was saved"
    assert _count(outputs, text) == [1, 0], "\n".join(outputs)


@needs_transformers
@pytest.mark.slow  # a Trainer of 2 ranks: about 7 s alone (the rule is tested on the core's)
def test_the_transformers_trainer_on_two_ranks_says_it_has_no_save_trigger_once(tmp_path):
    pytest.importorskip("transformers")
    args = [str(tmp_path), "--ddp", "--default-logging", "--every-n-steps", "0"]
    args += ["--max-steps", "2", "--out-jsonl", str(tmp_path / "o.jsonl")]
    outputs = _framework_run(
        "hf_train.py", tmp_path, "hf", *args, "--out-final", str(tmp_path / "f.st")
    )
    assert _count(outputs, "ResilientCheckpoint: no save trigger") == [1, 0], "\n".join(outputs)
