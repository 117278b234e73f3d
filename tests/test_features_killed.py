"""The less common training parts in a plain loop (tests/features_train.py), killed with a real
SIGKILL after a committed checkpoint and run again: the resumed run restores that step, trains
each later step once, and ends with the state of the run never killed bit for bit (parameters,
optimizer state, learning rate, schedulers, grad scaler, averaged and EMA models, data position,
RNG). ``accumulate`` is killed between the micro-batches of an accumulation window: the window's
micro-batches are trained again from the checkpoint of the step before it (their gradients are
in no checkpoint)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spawn_ranks

SCRIPT = Path(__file__).with_name("features_train.py")
TOTAL, EVERY, KILL_AFTER = 12, 4, 6  # the checkpoint of step 4 is the one resumed from
RUN_TIMEOUT = 120.0

pytestmark = pytest.mark.timeout(600)

SETUPS = ["lbfgs", "sam", "amp", "plateau", "sequential", "chained", "onecycle", "swa", "ema"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    return env


def _records(log: Path) -> list[dict]:
    out = []
    if log.exists():
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _run(workdir: Path, setup: str, *extra: str) -> spawn_ranks.Forked | subprocess.Popen:
    cmd = [sys.executable, str(SCRIPT), str(workdir / "ck"), "--setup", setup]
    cmd += ["--total", str(TOTAL), "--every", str(EVERY)]
    cmd += ["--log", str(workdir / "log.jsonl"), "--out", str(workdir / "final.json"), *extra]
    output = workdir / f"output-{time.monotonic_ns()}.txt"
    return spawn_ranks.shared_zygote().spawn(cmd, _env(), output)


def _finish(proc: spawn_ranks.Forked | subprocess.Popen, workdir: Path) -> dict:
    try:
        proc.wait(timeout=RUN_TIMEOUT)
    except (subprocess.TimeoutExpired, TimeoutError):
        proc.kill()
        proc.wait()
        pytest.fail(f"the run in {workdir} did not end in {RUN_TIMEOUT} s")
    outputs = "\n".join(p.read_text() for p in sorted(workdir.glob("output-*.txt")))
    assert proc.returncode == 0, outputs
    return json.loads((workdir / "final.json").read_text())


def _kill_when_held(proc: spawn_ranks.Forked | subprocess.Popen, workdir: Path) -> None:
    """SIGKILL the run once it holds at its point and the checkpoint of step EVERY is
    committed (its folder is renamed into place at the commit)."""
    committed = workdir / "ck" / f"step_{EVERY:09d}"
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (any("hold" in r for r in _records(workdir / "log.jsonl")) and committed.is_dir()):
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc={proc.returncode}) before it could be killed")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run did not hold with step {EVERY} committed in {RUN_TIMEOUT} s")
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _killed_and_resumed(tmp_path: Path, setup: str, *hold: str) -> None:
    (tmp_path / "ref").mkdir()
    reference = _run(tmp_path / "ref", setup)  # runs meanwhile
    run = tmp_path / "run"
    run.mkdir()
    _kill_when_held(_run(run, setup, *hold), run)
    again = _finish(_run(run, setup), run)
    expected = _finish(reference, tmp_path / "ref")
    records = _records(run / "log.jsonl")
    assert [r["restored"] for r in records if "restored" in r] == [0, EVERY]
    resumed = records[[i for i, r in enumerate(records) if "restored" in r][1] :]
    steps = [r["step"] for r in resumed if "step" in r]
    assert steps == list(range(EVERY + 1, TOTAL + 1))  # each later step once
    losses = {r["step"]: r["loss"] for r in records if "step" in r}
    ref_losses = {
        r["step"]: r["loss"] for r in _records(tmp_path / "ref" / "log.jsonl") if "step" in r
    }
    assert losses == ref_losses
    differing = [k for k in expected if expected[k] != again.get(k)]
    assert not differing and again.keys() == expected.keys(), differing


@pytest.mark.parametrize("setup", SETUPS)
def test_killed_after_a_step_resumes_exactly(tmp_path, setup):
    _killed_and_resumed(tmp_path, setup, "--hold-at", str(KILL_AFTER))


@pytest.mark.parametrize("micro", [1, 2])
def test_killed_inside_an_accumulation_window_trains_the_window_again(tmp_path, micro):
    _killed_and_resumed(
        tmp_path, "accumulate", "--hold-at", str(KILL_AFTER), "--hold-micro", str(micro)
    )
