"""Crash torture of incremental checkpoints under real SIGKILL: processes that save at every
step with ``incremental=True`` (retention deleting checkpoints and their unused blobs after
each save), and processes running ``resilient-ckpt gc``, are killed at random moments, over and
over, in the same directory. After every kill:

- every committed checkpoint is valid at full depth: every file and every blob it refers to is
  present with its size and checksum (0 committed checkpoints with a missing or wrong
  reference);
- a fresh restore returns the newest committed step, with exactly the state of that step.

At the end, one ``gc`` leaves exactly the blobs the committed manifests name (0 blobs leaked
for ever) and no temporary file.

Processes are forked from a zygote (this file run with ``--zygote``) that imported torch once.
The default suite runs a few kills; ``-m slow`` runs RC_INC_CRASH_TRIALS (default 220).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.blobs import live_blobs
from resilient_callbacks.catalog import Depth, Status

SEED = int(os.environ.get("RC_TEST_SEED", "20261123"))
SLOW_TRIALS = int(os.environ.get("RC_INC_CRASH_TRIALS", "220"))
CHILD_MAX_SECONDS = 20.0

pytestmark = pytest.mark.timeout(900)


# ----------------------------------------------------------------------------- the state


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    trunk = nn.Linear(256, 512)  # frozen: stored once
    trunk.requires_grad_(False)
    head = nn.Linear(512, 64)  # changes at every step
    return {"trunk": trunk, "head": head, "ema": torch.zeros(128, 128), "meta": {"step": -1}}


def fill(state: dict[str, Any], step: int) -> None:
    """The state as a deterministic function of ``step``: the head changes at every step, the
    EMA every third step, the trunk never."""
    with torch.no_grad():
        for i, p in enumerate(state["head"].parameters()):
            p.copy_(torch.full(p.shape, float(step) + 0.25 * i))
        if step % 3 == 0:
            state["ema"].fill_(float(step))
    state["meta"]["step"] = step


def problems(state: dict[str, Any], step: int) -> list[str]:
    want = make_state()
    fill(want, step)
    if step % 3:  # the EMA holds the value of the last multiple of 3 saved
        with torch.no_grad():
            want["ema"].fill_(float(step - step % 3))
    out = []
    for k in ("trunk", "head"):
        for (n, a), b in zip(
            state[k].state_dict().items(), want[k].state_dict().values(), strict=True
        ):
            if not torch.equal(a, b):
                out.append(f"{k}.{n}")
    if not torch.equal(state["ema"], want["ema"]):
        out.append("ema")
    if state["meta"] != want["meta"]:
        out.append(f"meta={state['meta']}")
    return out


# ----------------------------------------------------------------------------- the children


def saver(root: str, log_path: str, async_save: bool) -> int:
    torch.set_num_threads(1)
    state = make_state()
    with open(log_path, "a") as log:
        ck = Checkpointer(
            root, every_n_steps=1, keep_last=2, incremental=True, async_save=async_save
        )
        start = ck.restore(state)
        if start:
            # the EMA of a resumed run holds what was saved: continue from there
            state["meta"]["step"] = start
        log.write(json.dumps({"ready": start}) + "\n")
        log.flush()
        deadline = time.monotonic() + CHILD_MAX_SECONDS
        step = start
        while time.monotonic() < deadline:
            step += 1
            fill(state, step)
            ck.step(step, state)
    return 0


def gc_runner(root: str) -> int:
    from resilient_callbacks.cli import main

    deadline = time.monotonic() + CHILD_MAX_SECONDS
    while time.monotonic() < deadline:
        main(["gc", root, "--keep-last", "1"])
    return 0


def zygote_main() -> int:
    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "spawn":
            pid = os.fork()
            if pid == 0:
                rc = 1
                try:
                    devnull = os.open(os.devnull, os.O_RDWR)
                    os.dup2(devnull, 0)
                    os.dup2(devnull, 1)
                    err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(err, 2)
                    if req["kind"] == "gc":
                        rc = gc_runner(req["root"])
                    else:
                        rc = saver(req["root"], req["log"], req["kind"] == "async")
                except BaseException:
                    traceback.print_exc()
                finally:
                    with contextlib.suppress(Exception):
                        sys.stderr.flush()
                    os._exit(rc)
            reply({"pid": pid})
        elif req["cmd"] == "wait":
            _, status = os.waitpid(req["pid"], 0)
            reply({"exitcode": os.waitstatus_to_exitcode(status)})
        elif req["cmd"] == "quit":
            break
    return 0


if __name__ == "__main__" and "--zygote" in sys.argv:
    sys.exit(zygote_main())


class Zygote:
    def __init__(self, workdir: Path) -> None:
        self.err_path = workdir / "zygote.stderr"
        self._err = open(self.err_path, "w")  # noqa: SIM115 - lives as long as the zygote
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"the zygote did not answer:\n{self.err_path.read_text()}")
        return json.loads(line)

    def request(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.request(cmd="quit")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


# ----------------------------------------------------------------------------- the checks


def check_committed(root: Path) -> int | None:
    """Every committed checkpoint is valid at full depth (blobs included); the newest step."""
    entries = catalog.committed(catalog.scan(str(root), Depth.FULL))
    bad = [f"{e.name}: {e.problem}" for e in entries if e.status is not Status.VALID]
    assert not bad, f"committed checkpoints with a missing or wrong reference: {bad}"
    return max((e.manifest.step for e in entries if e.manifest), default=None)


def check_restore(root: Path, newest: int | None) -> None:
    state = make_state()
    with Checkpointer(root, async_save=False, preemption=False) as ck:
        got = ck.restore(state)
    assert got == (newest or 0)
    if newest:
        assert problems(state, newest) == [], (newest, problems(state, newest))


def torture(tmp_path: Path, trials: int) -> dict[str, int]:
    root = tmp_path / "ckpt"
    rng = random.Random(SEED)
    zygote = Zygote(tmp_path)
    kills = {"save": 0, "async": 0, "gc": 0, "left_mid_write": 0}
    try:
        for i in range(trials):
            kind = rng.choices(["save", "async", "gc"], weights=[4, 3, 2])[0]
            if kind == "gc" and not root.exists():
                kind = "save"
            log = tmp_path / f"log{i}.jsonl"
            pid = zygote.request(
                cmd="spawn",
                kind=kind,
                root=str(root),
                log=str(log),
                stderr=str(tmp_path / "children.stderr"),
            )["pid"]
            time.sleep(rng.uniform(0.2, 1.2))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            code = zygote.request(cmd="wait", pid=pid)["exitcode"]
            assert code == -signal.SIGKILL, (
                f"trial {i} ({kind}) ended by itself ({code}):\n"
                + (tmp_path / "children.stderr").read_text()[-3000:]
            )
            kills[kind] += 1
            # what the kill interrupted: a blob or a staging directory being written
            leftovers = [n for n in os.listdir(root) if n.startswith((".staging-", ".trash-"))]
            if os.path.isdir(root / "blobs"):
                leftovers += [n for n in os.listdir(root / "blobs") if n.startswith(".tmp-")]
            kills["left_mid_write"] += bool(leftovers)
            newest = check_committed(root)
            check_restore(root, newest)
    finally:
        zygote.close()
    # a later gc reclaims everything the crashes left
    from resilient_callbacks.cli import main

    assert main(["gc", str(root)]) == 0
    blobs = set(os.listdir(root / "blobs"))
    assert blobs == live_blobs(str(root)), "blobs leaked (or missing) after the final gc"
    check_committed(root)
    return kills


def test_sigkill_during_incremental_saves_and_gc_short(tmp_path):
    kills = torture(tmp_path, 8)
    assert kills["save"] + kills["async"] + kills["gc"] == 8


@pytest.mark.slow
def test_sigkill_during_incremental_saves_and_gc_torture(tmp_path):
    kills = torture(tmp_path, SLOW_TRIALS)
    assert kills["save"] + kills["async"] + kills["gc"] >= 200
    print(f"SIGKILLs: {kills}")
