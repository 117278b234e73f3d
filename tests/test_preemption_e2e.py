"""Preemption end to end: a real signal to a real training process, an emergency checkpoint at
the next step boundary, exit code 75, and an exact resume; also cloud notices and two ranks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import spawn_ranks
from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.checkpointer import RESUMABLE_EXIT_CODE
from spawn_ranks import free_port

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "train_script.py")
STEPS = 40


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def _start(
    cmd: list[str], log: Path, env: dict[str, str] | None = None
) -> spawn_ranks.Forked | subprocess.Popen:
    """Start ``cmd`` (``python train_script.py ...``), its stdout and stderr to ``log``: a
    fresh process in a session of its own, forked from the test session's zygote that
    imported torch and the library once (spawn_ranks.Zygote: seconds of CPU a run)."""
    env = dict(env or _env(), PYTHONHASHSEED="0")  # (the zygote's: else a fresh interpreter)
    return spawn_ranks.shared_zygote().spawn(cmd, env, log)


def _outcome(proc: spawn_ranks.Forked | subprocess.Popen, log: Path, timeout: float = 120) -> str:
    """Wait for ``proc`` to end (``timeout`` only bounds a hang); its output in ``log``."""
    try:
        proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, TimeoutError):
        proc.kill()
        proc.wait()
        raise AssertionError(f"the run hung:\n{log.read_text()[-3000:]}") from None
    return log.read_text()


def _succeeded(proc: spawn_ranks.Forked | subprocess.Popen, log: Path) -> str:
    """Wait for ``proc``, which must succeed; its output."""
    out = _outcome(proc, log)
    assert proc.returncode == 0, out[-3000:]
    return out


def _run(cmd: list[str], log: Path) -> str:
    """Run ``cmd`` (see :func:`_start`) to its end, which must be a success; its output."""
    return _succeeded(_start(cmd, log), log)


def _cmd(ckpt: Path, out: Path, *more: str) -> list[str]:
    return [
        sys.executable,
        SCRIPT,
        str(ckpt),
        "--total-steps",
        str(STEPS),
        "--every-n-steps",
        "10",
        "--out-jsonl",
        str(out / "log.jsonl"),
        "--out-params",
        str(out / "params.safetensors"),
        *more,
    ]


def _losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out[rec["step"]] = rec["loss"]  # a replayed step overwrites: the last one counts
    return out


def _wait_for_step(path: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until the run at ``path`` logged ``step``. Generous: four processes starting
    torch on a loaded 2-core machine took 23 s to reach step 12 (60 s was the limit); a run
    that ends early fails at once."""
    deadline = time.monotonic() + timeout
    while max(_losses(path), default=0) < step:
        assert proc.poll() is None, f"the run ended early: {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.01)


def _same_params(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    _run(_cmd(out / "ckpt", out), out / "run.log")
    return out


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGTERM, id="SIGTERM"),
        # the same path with another signal; the in-process SIGUSR1 test below runs by default
        pytest.param(signal.SIGUSR1, id="SIGUSR1", marks=pytest.mark.slow),
    ],
)
def test_signal_saves_at_next_step_exits_75_and_resume_is_exact(tmp_path, reference, sig):
    ckpt, out = tmp_path / "ckpt", tmp_path
    # the run waits at step 13 for the signal: it lands there however loaded the machine
    proc = _start(_cmd(ckpt, out, "--hold-at", "13"), out / "run1.log")
    _wait_for_step(out / "log.jsonl", 13, proc)
    os.kill(proc.pid, sig)
    err = _outcome(proc, out / "run1.log", timeout=60)
    assert proc.returncode == RESUMABLE_EXIT_CODE, err
    last = max(_losses(out / "log.jsonl"))
    assert last in (13, 14), err  # at the step boundary after the signal, or at 13's own
    committed = [e for e in catalog.scan(str(ckpt), catalog.Depth.FULL) if e.manifest]
    newest = committed[-1]
    # the emergency checkpoint is of the very step the run stopped at, not the last periodic one
    assert newest.step == last and newest.manifest.reason == "emergency", err
    assert last % 10 != 0 or newest.manifest.reason == "emergency"
    assert "preemption" in err and f"exiting with code {RESUMABLE_EXIT_CODE}" in err

    again = _run(_cmd(ckpt, out), out / "run2.log")
    assert f"restored step {last}" in again
    assert _losses(out / "log.jsonl") == _losses(reference / "log.jsonl")
    assert _same_params(out / "params.safetensors", reference / "params.safetensors")


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGTERM, id="SIGTERM"),
        pytest.param(signal.SIGUSR1, id="SIGUSR1", marks=pytest.mark.slow),
    ],
)
def test_a_signal_to_the_process_group_spares_the_dataloader_workers(tmp_path, sig):
    """Slurm signals every process of a job step (`--signal`, the time limit), and `kill --
    -PGID` every process of a group: DataLoader workers too. They died of it (SIGTERM through
    the handler torch sets in each worker), the loader then raised in the training process (a
    worker "killed by signal", from torch's SIGCHLD handler, anywhere in the step), and the run
    ended without its emergency checkpoint. A worker now lets the first such signal pass while
    its trainer lives: the trainer saves, exits 75, and its loader stops the workers."""
    loader = ("--loader", "resumable")  # its position counts what the loop got, not prefetches
    ref = tmp_path / "reference"
    ref.mkdir()
    reference = _start(_cmd(ref / "ckpt", ref, *loader), ref / "run.log")  # (beside the run)
    out = tmp_path / "run"
    out.mkdir()
    ckpt = out / "ckpt"
    cmd = _cmd(ckpt, out, *loader, "--hold-at", "13", "--num-workers", "2")
    proc = _start(cmd, out / "run1.log")  # (a session of its own: its group is its workers)
    try:
        _wait_for_step(out / "log.jsonl", 13, proc)
        os.killpg(proc.pid, sig)
        err = _outcome(proc, out / "run1.log", timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == RESUMABLE_EXIT_CODE, err[-3000:]
    last = max(_losses(out / "log.jsonl"))
    newest = [e for e in catalog.scan(str(ckpt), catalog.Depth.FULL) if e.manifest][-1]
    assert newest.step == last and newest.manifest.reason == "emergency", err[-3000:]
    _run(_cmd(ckpt, out, *loader), out / "run2.log")
    _succeeded(reference, ref / "run.log")
    assert _losses(out / "log.jsonl") == _losses(ref / "log.jsonl")
    assert _same_params(out / "params.safetensors", ref / "params.safetensors")


def test_exit_on_preemption_false_returns_and_flags(tmp_path):
    w = torch.zeros(4)
    with Checkpointer(tmp_path / "ck", every_n_steps=100, exit_on_preemption=False) as ck:
        assert ck.restore({"w": w}) == 0
        for s in range(1, 4):
            assert ck.step(s, {"w": w}) is False
        os.kill(os.getpid(), signal.SIGUSR1)  # handled as a flag only
        assert ck.step(4, {"w": w}) is True
        assert ck.preempted
        assert ck.last_save is not None and ck.last_save.step == 4
        assert ck.last_save.reason == "emergency"


def test_handlers_are_restored_on_close(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(tmp_path / "ck"):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    with Checkpointer(tmp_path / "ck2", preemption=False):
        assert signal.getsignal(signal.SIGTERM) is before


class _Notice(BaseHTTPRequestHandler):
    notice = False

    def do_GET(self) -> None:
        body = b"terminate" if type(self).notice else b""
        self.send_response(200 if type(self).notice else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_cloud_notice_triggers_the_emergency_save(tmp_path):
    handler = type("Handler", (_Notice,), {"notice": False})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    ).start()  # (shutdown() waits for a poll: 0.5 s by default)
    url = f"http://127.0.0.1:{server.server_address[1]}/notice"
    w = torch.zeros(4)
    try:
        with Checkpointer(
            tmp_path / "ck",
            every_n_steps=1000,
            exit_on_preemption=False,
            metadata_notices={"kind": "custom", "url": url, "interval_s": 0.02},
        ) as ck:
            for s in range(1, 6):
                assert ck.step(s, {"w": w}) is False
                time.sleep(0.03)
            handler.notice = True
            deadline = time.monotonic() + 60
            s = 6
            while not ck.preempted:
                assert time.monotonic() < deadline, "the notice was not noticed"
                ck.step(s, {"w": w})
                s += 1
                time.sleep(0.01)
            assert ck.watcher is not None and ck.watcher.request.source.startswith("metadata")
            assert ck.last_save.reason == "emergency"
    finally:
        server.shutdown()


def _launch_ranks(
    ckpt: Path, out: Path, port: int, *more: str, forked: bool = False
) -> list[tuple[spawn_ranks.Forked | subprocess.Popen, Path]]:
    """Two ranks of ``train_script.py --distributed``, each with its log. ``forked``: forked
    from the zygote (:func:`_start`); else fresh interpreters, each with its own random hash
    seed, as torchrun starts a job's ranks."""
    procs = []
    for rank in range(2):
        env = _env(
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        cmd = _cmd(ckpt, out, "--distributed", *more)
        log = out / f"{ckpt.name}.{time.time_ns()}.rank{rank}.log"
        if forked:
            procs.append((_start(cmd, log, env), log))
        else:
            with open(log, "w") as f:
                procs.append((subprocess.Popen(cmd, env=env, stdout=f, stderr=f), log))
    return procs


@pytest.mark.distributed
def test_signal_to_one_rank_stops_both_at_the_same_step(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    # the uninterrupted reference runs beside the signalled run (suite time)
    ref_procs = _launch_ranks(ref / "ckpt", ref, free_port(), forked=True)
    # rank 1 waits at step 12 for its signal (rank 0 waits for it in step 13's all_reduce).
    # Steps of >= 0.05 s space the decision steps <= 20 apart (max_delay_s=1): the one that
    # acts on the signal comes before step 40 (without the sleep, 100 apart: the run ended
    # first, with no emergency save for the signal after its last decision step)
    procs = _launch_ranks(
        run / "ckpt", run, free_port(), "--sleep", "0.05", "--hold-at", "12", "--hold-rank", "1"
    )
    _wait_for_step(run / "log.jsonl.rank1", 12, procs[1][0])
    procs[1][0].send_signal(signal.SIGTERM)  # only rank 1 is told
    errs = []
    for p, log in procs:
        err = _outcome(p, log)
        errs.append(err)
        assert p.returncode == RESUMABLE_EXIT_CODE, err
    for p, log in ref_procs:
        _succeeded(p, log)
    last = [max(_losses(run / f"log.jsonl.rank{r}")) for r in range(2)]
    assert last[0] == last[1], (last, errs)
    newest = [e for e in catalog.scan(str(run / "ckpt"), catalog.Depth.FULL) if e.manifest][-1]
    assert newest.step == last[0] and newest.manifest.reason == "emergency"

    procs = _launch_ranks(run / "ckpt", run, free_port())
    for p, log in procs:
        assert f"restored step {last[0]}" in _succeeded(p, log)
    for r in range(2):
        assert _losses(run / f"log.jsonl.rank{r}") == _losses(ref / f"log.jsonl.rank{r}")
        assert _same_params(
            run / f"params.safetensors.rank{r}", ref / f"params.safetensors.rank{r}"
        )


_KILLED_WHILE_CLOSING = """
import os, sys, torch
from resilient_callbacks import Checkpointer, closing
closing.close = lambda *a, **k: os._exit(137)  # SIGKILLed while close() waits for uploads
state = {"w": torch.zeros(4)}
ck = Checkpointer(sys.argv[1], every_n_steps=2)
ck.restore(state)
for step in range(1, 4):
    ck.step(step, state)
ck.watcher.trigger("SIGTERM")
ck.step(4, state)
"""


def test_a_kill_after_the_emergency_save_committed_is_no_failure(tmp_path):
    """The preemption's emergency checkpoint committed, then close() waited for uploads with
    what was left of the grace period, and the process was killed before it wrote its 'end'
    record (a grace period shorter than assumed). The resume from that checkpoint, which lost
    nothing, counted as a failure and shortened the learned MTBF. The end of a preempted
    life is now recorded as soon as its emergency checkpoint is committed."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_CLOSING, str(tmp_path / "ck")],
        env=_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 137, proc.stderr
    with Checkpointer(tmp_path / "ck", adaptive=True) as ck:
        assert ck.restore({"w": torch.zeros(4)}) == 4
        assert ck.schedule is not None
        assert ck.schedule.failures_observed == 0
        assert ck.metrics()["resilient_ckpt_restarts_total"] == 0
