"""The Hugging Face Trainer adapter on 2 DDP processes (torchrun, gloo, CPU): a run killed with
SIGKILL mid-epoch and re-run gives every rank the same per-step losses, final weights and log
history as an uninterrupted run, bit for bit.

Both runs are ``torchrun --nproc_per_node 2 tests/hf_train.py --ddp``; the kill goes to torchrun
and both ranks at once, as a lost node would (torchrun starts each rank in its own session, so
they are found as its child processes).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spawn_ranks import free_port

pytest.importorskip("transformers")

import contextlib

from test_transformers import (
    EVERY,
    RUN_TIMEOUT,
    UPDATES_PER_EPOCH,
    _assert_same_run,
    _cmd,
    _committed,
    _env,
    _records_from,
    _restored,
)

# slow (about a minute of CPU): run with -m slow. The default suite covers DDP exactness with the
# Lightning DDP test and the core's two-rank tests, and the Transformers adapter single-process.
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def _ddp_cmd(workdir: Path, sleep: float = 0.0, extra: tuple[str, ...] = ()) -> list[str]:
    script_and_args = _cmd(workdir, sleep)[1:]  # drop sys.executable
    return [
        *TORCHRUN,
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *script_and_args,
        "--ddp",
        *extra,
    ]


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=_env())
    assert p.returncode == 0, (
        f"run failed (rc={p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-8000:]}"
    )
    return p.stderr


def kill_and_rerun(tmp_path: Path, extra: tuple[str, ...] = ()) -> Path:
    """An uninterrupted 2-rank run, and one killed (SIGKILL to torchrun and both ranks) after
    step 7 and re-run: both ranks' per-step records, final weights and log history are the
    same, bit for bit. Returns the interrupted run's directory."""
    ref = tmp_path / "reference"
    ref.mkdir()
    err = _run(_ddp_cmd(ref, extra=extra))
    assert "[rank 0] restored step 0" in err and "[rank 1] restored step 0" in err

    work = tmp_path / "interrupted"
    work.mkdir()
    jsonl = work / "steps.jsonl.rank0"
    with open(work / "stderr.txt", "w") as errf:
        proc = subprocess.Popen(
            _ddp_cmd(work, sleep=0.15, extra=extra),
            stdout=subprocess.DEVNULL,
            stderr=errf,
            env=_env(),
        )
        try:
            deadline = time.monotonic() + RUN_TIMEOUT
            while True:
                recs = _records_from(jsonl)
                if recs and recs[-1]["step"] >= 7:
                    _kill_tree(proc.pid)
                    break
                assert proc.poll() is None, (work / "stderr.txt").read_text()
                assert time.monotonic() < deadline, "no step 7 in time"
                time.sleep(0.05)
            proc.wait(timeout=RUN_TIMEOUT)
        finally:
            _kill_tree(proc.pid)
            proc.wait()
    killed_at = _records_from(jsonl)[-1]["step"]
    # the newest checkpoint committed before the kill (how many that is depends on how fast
    # the background saves ran beside the steps, so it is read, not assumed)
    newest = _committed(work / "out" / "ckpt")[-1].step

    err = _run(_ddp_cmd(work, extra=extra))
    restored = _restored(err)
    assert f"[rank 1] restored step {restored}" in err
    assert restored == newest and restored % EVERY == 0 and 0 < restored <= killed_at
    assert restored % UPDATES_PER_EPOCH != 0, "the kill landed on an epoch boundary"
    for rank in (0, 1):
        _assert_same_run(ref, work, suffix=f".rank{rank}")
    return work


def test_ddp_sigkill_mid_epoch_then_rerun_is_bit_exact(tmp_path):
    work = kill_and_rerun(tmp_path)
    entries = _committed(work / "out" / "ckpt")
    assert all(
        len([f for f in e.manifest.files if f.path.startswith("rank_")]) == 4 for e in entries
    )
