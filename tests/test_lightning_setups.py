"""Less common ``Trainer`` set-ups (tests/lightning_setups.py), each as a real process: with the
callback and never interrupted, the run is the run without it (every batch's loss, every
validation, every logged metric, the final RNG states, learning rates, EarlyStopping and
ModelCheckpoint states and weights); SIGKILLed twice at random batches and run again each
time, it ends the same.

Set-ups: ``val_check_interval`` as a float and as an int counted across epochs,
``check_val_every_n_epoch=2``, ``accumulate_grad_batches=3`` (kills fall between
micro-batches), gradient clipping by norm and by value, manual optimization with two
optimizers and a scheduler stepped by hand, ``limit_train_batches`` (int and float), two
``fit()`` stages on one Trainer, ``bf16-mixed`` on the CPU, a step-interval LR scheduler with
an epoch-interval ``ReduceLROnPlateau`` on ``val_loss``, ``EarlyStopping`` (patience 3) and a
``ModelCheckpoint`` (top 2, every 5 steps, last), a ``LearningRateMonitor`` (with momentum),
``accumulate_grad_batches=3`` with a validation every 4 batches (after a batch that made no
step), ``EarlyStopping`` on validations in the middle of epochs, a ``ModelCheckpoint(save_last=
True)`` with ``fit(ckpt_path="last")`` (ours resume: as new as Lightning's file), and two
``fit()`` stages set by ``max_steps``, the first ending in the middle of an epoch, and a
``GradientAccumulationScheduler`` (1, then 3 batches a step from epoch 1). An ``IterableDataset`` without state is
only compared uninterrupted: a mid-epoch resume restarts its epoch (docs/lightning.md).

On two DDP ranks (``--devices 2``: ``strategy="ddp"``, rank 1 launched by Lightning, gloo):
two ``max_steps`` stages, ``EarlyStopping`` mid-epoch, ``ckpt_path="last"`` and a ``max_steps``
run ending mid-epoch, each killed at a random batch and then right after its last step's
boundary (during the final save), run again, and once more when finished; ``EarlyStopping``
and ``ModelCheckpoint`` on each rank's own ``train_loss``, killed after a checkpoint (each rank
resumes its own callback states); a ``max_time`` stop run again with another ``max_time`` on
each rank (every rank follows rank 0's decision to train on).

Each set-up takes 30-60 s (five processes): ``-m slow``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("lightning_setups.py")
SEED = int(os.environ.get("RC_TEST_SEED", "20240611"))
TIMEOUT = 240

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _env() -> dict[str, str]:
    src = str(Path(__file__).parents[1] / "src")
    path = os.pathsep.join([src, str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONPATH=path)
    for k in [k for k in env if k.startswith("SLURM_")]:
        del env[k]
    return env


def _start(work: Path, setup: str, *more: str) -> tuple[subprocess.Popen, Path]:
    work.mkdir(parents=True, exist_ok=True)
    err = work / f"err{len(list(work.glob('err*')))}.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(work), "--setup", setup, *more],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env=_env(),
            start_new_session=True,
        )
    return proc, err


def _finish(proc: subprocess.Popen, err: Path, timeout: float = TIMEOUT) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the run hung:\n{err.read_text()[-3000:]}")
    assert rc == 0, err.read_text()[-3000:]


def _records(path: Path, start: int = 0, end: int | None = None) -> list[dict]:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read() if end is None else f.read(end - start)
    out = []
    for line in data.split(b"\n"):
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))  # a line cut by SIGKILL is skipped
    return out


def _restored(err: Path) -> int:
    for line in err.read_text().splitlines():
        if line.startswith("restored step "):
            return int(line.split()[2])
    raise AssertionError(err.read_text()[-3000:])


def _same(ref: list[dict], got: list[dict], what: str) -> None:
    a = [r for r in ref if r["ev"] != "boundary"]
    b = [r for r in got if r["ev"] != "boundary"]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        assert x == y, f"{what}: record {i} differs:\n  without/uninterrupted {x}\n  got {y}"
    assert len(a) == len(b), (
        f"{what}: {len(a)} records vs {len(b)}: {(a[len(b) :] or b[len(a) :])[:3]}"
    )


@pytest.mark.parametrize(
    "setup",
    [
        "val_float",
        "val_int_across",
        "val_every_2",
        "accum3",
        "clip",
        "clip_value",
        "gan",
        "limit",
        "limit_frac",
        "refit",
        "bf16",
        "sched",
        "early",
        "mc",
        "iterable",
        "lr_monitor",
        "accum_val",
        "early_mid",
        "ckpt_last",
        "refit_steps",
        "accum_sched",
    ],
)
def test_a_setup_is_unchanged_by_the_callback_and_resumes_exactly_after_sigkills(tmp_path, setup):
    without, ref = _start(tmp_path / "without", setup, "--no-callback")
    with_, err = _start(tmp_path / "with", setup)
    _finish(without, ref)
    _finish(with_, err)
    reference = _records(tmp_path / "without" / "out.jsonl")
    _same(reference, _records(tmp_path / "with" / "out.jsonl"), "with the callback")
    if setup == "iterable":
        return
    batches = sum(1 for r in reference if r["ev"] == "train")
    rng = random.Random(f"{SEED}-{setup}")
    work, out = tmp_path / "killed", tmp_path / "killed" / "out.jsonl"
    segments: list[tuple[int, Path]] = []
    for kill_at in [rng.randint(2, batches * 4 // 5) for _ in range(2)] + [None]:
        offset = out.stat().st_size if out.exists() else 0
        proc, err = _start(work, setup, "--sleep", "0.03")
        segments.append((offset, err))
        if kill_at is None:
            _finish(proc, err)
            break
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            trained = (
                sum(1 for r in _records(out, offset) if r["ev"] == "train") if out.exists() else 0
            )
            if trained >= kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
        proc.wait(timeout=60)
    # each killed process's records up to the step boundary the next one resumed at
    merged: list[dict] = []
    for i, (offset, _) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else None
        records = _records(out, offset, end)
        if end is not None:
            resumed = _restored(segments[i + 1][1])
            cut = [
                j + 1 for j, r in enumerate(records) if r["ev"] == "boundary" and r["gs"] == resumed
            ]
            records = records[: cut[-1]] if cut else []
        merged += records
    if setup in (
        "refit",
        "refit_steps",
    ):  # a re-run's first stage that trained nothing records an end too
        stage1_end = next(r["gs"] for r in reference if r["ev"] == "end" and r["fit"] == 1)
        merged = [r for r in merged if r["ev"] != "end" or r["fit"] != 1 or r["gs"] == stage1_end]
    _same(reference, merged, "killed and resumed")


def _restored_ranks(err: Path) -> list[int]:
    """Each rank's restored step (rank 0: ``restored step N``, rank 1: ``rank 1 restored N``)."""
    text = err.read_text()  # (both ranks write to it: lines may run together)
    first = [
        re.search(pattern, text) for pattern in (r"restored step (\d+)", r"rank 1 restored (\d+)")
    ]
    steps = [int(m.group(1)) if m else None for m in first]  # the first fit()'s
    assert None not in steps, err.read_text()[-3000:]
    return steps  # type: ignore[return-value]


def _merged(out: Path, segments: list[tuple[int, Path]], rank: int) -> list[dict]:
    """One rank's records of the killed processes, each up to the step the next resumed at."""
    merged: list[dict] = []
    for i, (offset, _) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else None
        records = _records(out, offset, end)
        if end is not None:
            resumed = _restored_ranks(segments[i + 1][1])[rank]
            cut = [
                j + 1 for j, r in enumerate(records) if r["ev"] == "boundary" and r["gs"] == resumed
            ]
            records = records[: cut[-1]] if cut else []
        merged += records
    return merged


@pytest.mark.distributed
@pytest.mark.parametrize(
    "setup, more",
    [
        ("refit_steps", ()),
        ("early_mid", ()),
        ("ckpt_last", ()),
        ("val_float", ("--max-steps", "23")),
    ],
)
def test_ddp_setup_sigkilled_and_rerun_ends_as_the_uninterrupted_run(tmp_path, setup, more):
    """The same set-ups on two DDP ranks (gloo, ``strategy="ddp"`` launched by Lightning):
    killed (the whole process group) at a random batch, then right after the last step's
    boundary (during the final save), and run again, each rank's records up
    to each resume, then the last run's, are the uninterrupted run's; both ranks resume the
    same step; a further re-run of the finished run trains nothing and ends as it did."""
    ddp = ("--devices", "2", *more)
    without, ref = _start(tmp_path / "without", setup, "--no-callback", *ddp)
    _finish(without, ref)
    reference = [_records(tmp_path / "without" / f"out.jsonl.rank{r}") for r in (0, 1)]
    batches = sum(1 for r in reference[0] if r["ev"] == "train")
    rng = random.Random(f"{SEED}-{setup}-ddp")
    work = tmp_path / "killed"
    out = [work / f"out.jsonl.rank{r}" for r in (0, 1)]
    segments: list[list[tuple[int, Path]]] = [[], []]
    final = [x["gs"] for x in reference[0] if x["ev"] == "end"][-1]
    for kill_at in [rng.randint(2, batches * 4 // 5), "final", None]:
        offsets = [o.stat().st_size if o.exists() else 0 for o in out]
        proc, err = _start(work, setup, "--sleep", "0.03", *ddp)
        for r in (0, 1):
            segments[r].append((offsets[r], err))
        if kill_at is None:
            _finish(proc, err)
            break
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            records = _records(out[0], offsets[0]) if out[0].exists() else []
            if kill_at == "final":  # during the last step's save (its boundary started it)
                due = any(r["ev"] == "boundary" and r["gs"] == final for r in records)
            else:
                due = sum(1 for r in records if r["ev"] == "train") >= kill_at
            if due:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
        proc.wait(timeout=60)
    for _, err in segments[0][1:]:
        steps = _restored_ranks(err)
        assert steps[0] == steps[1], f"the ranks resumed different steps: {steps}"
    for r in (0, 1):
        merged = _merged(out[r], segments[r], r)
        if setup == "refit_steps":  # a re-run's first stage that trained nothing records an end
            stage1 = next(x["gs"] for x in reference[r] if x["ev"] == "end" and x["fit"] == 1)
            merged = [x for x in merged if x["ev"] != "end" or x["fit"] != 1 or x["gs"] == stage1]
        _same(reference[r], merged, f"rank {r} killed and resumed")
    offsets = [o.stat().st_size for o in out]
    proc, err = _start(work, setup, *ddp)  # the finished run, run again
    _finish(proc, err)
    for r in (0, 1):
        again = [x for x in _records(out[r], offsets[r]) if x["ev"] != "boundary"]
        assert not [x for x in again if x["ev"] in ("train", "val")], again[:3]
        assert again[-1] == [x for x in reference[r] if x["ev"] == "end"][-1], f"rank {r}"


@pytest.mark.distributed
def test_ddp_each_rank_resumes_its_own_callback_states(tmp_path):
    """``EarlyStopping`` and a top-2 ``ModelCheckpoint`` on ``train_loss``, which each DDP rank
    logs for its own batches (no ``sync_dist``): each rank's callbacks keep their own best
    scores and wait counts, and Lightning stops when any rank's ``EarlyStopping`` says so.
    SIGKILLed right after the checkpoint of step 21 (an epoch's end) and run again, each rank
    goes on with its own states: the callbacks' states after every epoch, the stopping step
    and each rank's final weights are the uninterrupted run's (without the callback). Found
    2026-12-06: the checkpoint held rank 0's callback states only (as Lightning's own does);
    rank 1 resumed with them and the run stopped at step 49 instead of 28."""
    ddp = ("--devices", "2")
    ref, ref_err = _start(tmp_path / "ref", "early_train", "--no-callback", *ddp)
    work = tmp_path / "killed"
    killed, killed_err = _start(work, "early_train", "--die-after", "21", *ddp)
    _finish(ref, ref_err)
    assert killed.wait(timeout=TIMEOUT) == -signal.SIGKILL, killed_err.read_text()[-3000:]
    offsets = [(work / f"out.jsonl.rank{r}").stat().st_size for r in (0, 1)]
    again, err = _start(work, "early_train", *ddp)
    _finish(again, err)
    assert _restored_ranks(err) == [21, 21]
    for r in (0, 1):
        reference = _records(tmp_path / "ref" / f"out.jsonl.rank{r}")
        assert [x["gs"] for x in reference if x["ev"] == "end"] == [28]  # stopped early
        before = _records(work / f"out.jsonl.rank{r}", 0, offsets[r])
        after = _records(work / f"out.jsonl.rank{r}", offsets[r])
        _same(reference, before + after, f"rank {r}, killed after step 21 and resumed")


@pytest.mark.distributed
def test_ddp_ranks_follow_rank_0_on_whether_a_max_time_stop_trains_on(tmp_path):
    """A run stopped by ``max_time``, run again: whether it trains on was each rank's own
    decision, from its own ``Timer`` and clock (read at slightly different moments; here
    rank 1's re-run has a smaller ``max_time``, used up, rank 0's a larger one). Rank 1 stayed
    stopped while rank 0 trained on, and the run hung in the next collective. Every rank now
    follows rank 0: both train on to the end (``max_epochs=4``: 28 steps), and each rank's
    steps and its end are those of a run never stopped (the validation Lightning ran at the
    stop drew from each rank's random streams: the re-run goes on from them as they were
    before it)."""
    ddp = ("--devices", "2")
    ref, ref_err = _start(tmp_path / "ref", "clip", "--no-callback", *ddp)
    work = tmp_path / "run"
    first, err = _start(work, "clip", "--max-time", "2", "--sleep", "0.2", *ddp)
    _finish(first, err)
    _finish(ref, ref_err)
    out = [work / f"out.jsonl.rank{r}" for r in (0, 1)]
    stopped = [x["gs"] for x in _records(out[0]) if x["ev"] == "end"]
    assert 0 < stopped[0] < 28, stopped  # stopped by max_time
    offsets = [o.stat().st_size for o in out]
    again, err = _start(work, "clip", "--max-time", "1000", "--max-time-rank1", "1", *ddp)
    _finish(again, err, timeout=120)
    assert _restored_ranks(err) == [stopped[0]] * 2
    for r in (0, 1):
        ends = [x for x in _records(out[r], offsets[r]) if x["ev"] == "end"]
        reference = _records(tmp_path / "ref" / f"out.jsonl.rank{r}")
        assert ends == [x for x in reference if x["ev"] == "end"], r  # weights, RNG, step 28
        trained = [x for x in _records(out[r]) if x["ev"] == "train"]
        assert trained == [x for x in reference if x["ev"] == "train"], r
