"""The Hugging Face Trainer adapter on 2 DDP processes (torchrun, gloo, CPU): a run killed with
SIGKILL mid-epoch and re-run gives every rank the same per-step losses, final weights and log
history as an uninterrupted run, bit for bit.

Both runs are ``torchrun --nproc_per_node 2 tests/hf_train.py --ddp``; the kill goes to torchrun
and both ranks at once, as a lost node would (torchrun starts each rank in its own session, so
they are found as its child processes).
"""

from __future__ import annotations

import json
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
    _run_and_signal,
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


def _killed_after(work: Path, at: int = 7, extra: tuple[str, ...] = ()) -> tuple[int, int]:
    """A 2-rank run in ``work`` killed (SIGKILL to torchrun and both ranks) once it logged
    step ``at``: (the last step it logged, the newest checkpoint committed before the kill,
    which depends on how fast the background saves ran beside the steps: read, not assumed)."""
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
                if recs and recs[-1]["step"] >= at:
                    _kill_tree(proc.pid)
                    break
                assert proc.poll() is None, (work / "stderr.txt").read_text()
                assert time.monotonic() < deadline, f"no step {at} in time"
                time.sleep(0.05)
            proc.wait(timeout=RUN_TIMEOUT)
        finally:
            _kill_tree(proc.pid)
            proc.wait()
    return _records_from(jsonl)[-1]["step"], _committed(work / "out" / "ckpt")[-1].step


def kill_and_rerun(tmp_path: Path, extra: tuple[str, ...] = ()) -> Path:
    """An uninterrupted 2-rank run, and one killed (SIGKILL to torchrun and both ranks) after
    step 7 and re-run: both ranks' per-step records, final weights and log history are the
    same, bit for bit. Returns the interrupted run's directory."""
    ref = tmp_path / "reference"
    ref.mkdir()
    err = _run(_ddp_cmd(ref, extra=extra))
    assert "[rank 0] restored step 0" in err and "[rank 1] restored step 0" in err

    work = tmp_path / "interrupted"
    killed_at, newest = _killed_after(work, 7, extra)

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


def test_ddp_a_collator_with_its_own_generator_sigkill_then_rerun_is_bit_exact(tmp_path):
    """Each rank's collator masks its batches from a generator of its own (as
    ``DataCollatorForLanguageModeling(seed=...)``), which the evaluations draw from too: each
    rank's checkpoint keeps its state (before 2026-12-06 the re-run started it from the seed)."""
    kill_and_rerun(tmp_path, extra=("--collator-seed", "5"))


def _read_order(path: Path) -> list[int]:
    """The training samples a process read, in the order it read them."""
    return [i for r in _records_from(path) for i in r["reads"]]


def _epoch_orders(rank0: list[int], rank1: list[int]) -> list[list[int]]:
    """Each epoch's order of the 50 samples, from what 2 processes read: global batch ``i`` (4
    samples) went to process ``i % 2``; the last global batch has 2 samples, and accelerate
    completes it, and gives process 1 a 7th batch, from the start of the order, so each
    process reads 28 samples an epoch."""
    orders = []
    for e in range(min(len(rank0), len(rank1)) // 28):
        a, b = rank0[28 * e : 28 * e + 28], rank1[28 * e : 28 * e + 28]
        order = [i for j in range(0, 24, 4) for i in (*a[j : j + 4], *b[j : j + 4])]
        orders.append(order + a[24:26])
    return orders


def test_a_resume_on_one_process_with_the_same_global_batch_goes_on_with_the_epochs_order(
    tmp_path,
):
    """Killed on 2 processes (per-device batch 4, accumulation 3: 24 samples a step) and
    resumed on 1 with accumulation 6 (24 samples a step): the resumed process reads the rest of
    the interrupted epoch's order from the saved step on, then the next epochs' orders, as
    the uninterrupted 2-process run read them, and trains to the end (the resume was refused:
    the saved position is a per-process batch index). With accumulation 3 on 1 process (12 a
    step) it is refused, naming the global batch."""
    ref = tmp_path / "reference"
    ref.mkdir()
    reference = subprocess.Popen(
        _ddp_cmd(ref, extra=("--record-reads",)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    work = tmp_path / "run"
    _, newest = _killed_after(work, 5)  # saves every 2 steps; an epoch is 3 steps here
    assert newest % 3 != 0, "not mid-epoch"

    refused = subprocess.run(_cmd(work), capture_output=True, text=True, env=_env(), timeout=300)
    assert refused.returncode != 0 and "CheckpointMismatchError" in refused.stderr
    assert "global batch (processes x per-device batch x accumulation) stays 24" in (
        refused.stderr
    ), refused.stderr[-3000:]

    err = _run([*_cmd(work), "--accumulation", "6", "--record-reads"])
    assert _restored(err) == newest
    assert "on 1 process(es) x 4 x 6 accumulated: the same global batch of 24" in err, err[-3000:]
    assert json.loads((work / "final.safetensors.json").read_text())["global_step"] == 14
    _, ref_err = reference.communicate(timeout=RUN_TIMEOUT)
    assert reference.returncode == 0, ref_err[-3000:]

    orders = _epoch_orders(*(_read_order(ref / f"steps.jsonl.reads.rank{r}") for r in (0, 1)))
    epoch, into = divmod(newest, 3)
    want = orders[epoch][24 * into :] + [i for o in orders[epoch + 1 :] for i in o]
    ours = _read_order(work / "steps.jsonl.reads")
    assert len(ours) >= 2 * 50 and len(want) >= 2 * 50, (len(ours), len(want))
    n = min(len(ours), len(want))
    assert ours[:n] == want[:n]


def test_a_resume_on_two_processes_with_the_same_global_batch_reads_each_share_of_the_order(
    tmp_path,
):
    """The other way: killed on 1 process (batch 4, accumulation 6: 24 samples a step) and
    resumed on 2 with accumulation 3 (24 a step). Each process reads its share of the rest of
    the interrupted epoch's order, from the saved step on, then its share of the next epochs'
    orders, as the uninterrupted 1-process run drew them (process ``r`` reads global batch
    ``2k + r`` as its ``k``-th), and the run trains to the end on both processes."""
    one_process = ("--accumulation", "6", "--record-reads")
    ref = tmp_path / "reference"
    ref.mkdir()
    reference = subprocess.Popen(
        [*_cmd(ref), *one_process],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    work = tmp_path / "run"
    work.mkdir()
    _run_and_signal([*_cmd(work, sleep=0.15), *one_process], work, 5, signal.SIGKILL)
    newest = _committed(work / "out" / "ckpt")[-1].step
    assert newest % 3 != 0, f"not mid-epoch (an epoch is 3 steps here): step {newest}"

    err = _run(_ddp_cmd(work, extra=("--accumulation", "3", "--record-reads")))
    assert _restored(err) == newest and f"[rank 1] restored step {newest}" in err
    assert "on 2 process(es) x 4 x 3 accumulated: the same global batch of 24" in err, err[-3000:]
    for rank in (0, 1):
        final = json.loads((work / f"final.safetensors.rank{rank}.json").read_text())
        assert final["global_step"] == 14
    _, ref_err = reference.communicate(timeout=RUN_TIMEOUT)
    assert reference.returncode == 0, ref_err[-3000:]

    drawn = _read_order(ref / "steps.jsonl.reads")  # 50 samples an epoch, in the epoch's order
    epoch, into = divmod(newest, 3)
    for rank in (0, 1):
        want: list[int | None] = []
        for e in range(epoch, len(drawn) // 50):
            order = drawn[50 * e : 50 * e + 50]
            first = 3 * into if e == epoch else 0  # a step is 3 local batches of each process
            for k in range(first, 7):  # 7 local batches of 4 an epoch (the last one padded)
                g = 2 * k + rank
                want += order[4 * g : 4 * g + 4] if g < 12 else [None] * 4
        ours = _read_order(work / f"steps.jsonl.reads.rank{rank}")
        assert len(ours) >= 50 and len(want) >= 50, (rank, len(ours), len(want))
        n = min(len(ours), len(want))
        padded = [None if w is None else o for o, w in zip(ours[:n], want[:n], strict=True)]
        assert padded == want[:n], rank


def test_under_deepspeed_zero2_two_processes_sigkill_then_rerun_is_bit_exact(tmp_path):
    pytest.importorskip("deepspeed")
    kill_and_rerun(tmp_path, extra=("--deepspeed", "2"))


def test_under_deepspeed_a_resume_on_one_process_with_the_same_global_batch_trains_on(tmp_path):
    """The Trainer under DeepSpeed ZeRO-2 (options in the config's section): killed on 2
    processes, resumed on 1 with twice the accumulation. The partitions of 2 ranks load into
    1, the layout change is said, and nothing is said of a changed micro-step count (accelerate
    sets the engine's accumulation boundaries itself)."""
    pytest.importorskip("deepspeed")
    work = tmp_path / "run"
    _, newest = _killed_after(work, 5, extra=("--deepspeed", "2"))
    err = _run([*_cmd(work), "--deepspeed", "2", "--accumulation", "6"])
    assert _restored(err) == newest > 0
    assert "on 1 process(es) x 4 x 6 accumulated: the same global batch of 24" in err, err[-3000:]
    assert "micro-step count" not in err, err[-3000:]
    assert json.loads((work / "final.safetensors.json").read_text())["global_step"] == 14
