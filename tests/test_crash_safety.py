"""Crash safety under real SIGKILL: a process that saves a checkpoint at every step is killed at
random moments (mid-save, mid-retention, mid-startup), over and over, in the same directory.
After every kill:

- every directory with a manifest is a *valid* checkpoint (full checksum scan): nothing torn is
  ever counted as committed;
- every directory without a manifest is a hidden ``.staging-*`` or ``.trash-*`` directory, and the next writer that
  opens the directory removes them all;
- a fresh ``Checkpointer(dir).restore(state)`` never raises and returns the newest committed
  step: the last step the killed process reported as saved, or the one it was saving when it
  died; the restored tensors and values are exactly what was saved at that step.

Three deterministic tests kill a writer at one precise point (inside retention's delete, inside
the update of the ``latest`` pointer, with a forked DataLoader worker alive) and check what the
next writer finds.

Processes are forked from a "zygote" (this file run as a script with ``--zygote``) that has
already imported torch, so a trial costs milliseconds instead of seconds of interpreter start.
The zygote never runs torch computations itself, so forking it is safe.

RC_CRASH_TRIALS raises the number of trials; RC_TEST_SEED changes the kill schedule.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from resilient_callbacks import Checkpointer, CheckpointLockedError, catalog
from resilient_callbacks.catalog import Depth, Status

TRIALS = int(os.environ.get("RC_CRASH_TRIALS", "60"))
SEED = int(os.environ.get("RC_TEST_SEED", "20240611"))
KEEP_LAST = 2
CHILD_MAX_SECONDS = 30.0  # a child that is never killed stops by itself
REPLY_TIMEOUT = 60.0

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------- the saved state


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    # ~4 MB of float32 parameters, so that one save takes ~10 ms on a local disk.
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))
    return {
        "model": model,
        "counter": torch.zeros(4, dtype=torch.int64),
        "extra": {"step": -1, "tag": "", "history": []},
    }


def _base(numel: int, i: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * 1e-3 + 1000.0 * i


def fill_state(state: dict[str, Any], step: int) -> None:
    """Make the whole state a deterministic function of ``step``."""
    with torch.no_grad():
        for i, p in enumerate(state["model"].parameters()):
            p.copy_((_base(p.numel(), i) + step).reshape(p.shape))
    state["counter"].copy_(torch.tensor([step, 2 * step, 3 * step, step % 7]))
    state["extra"]["step"] = step
    state["extra"]["tag"] = f"step-{step}"
    state["extra"]["history"] = list(range(max(0, step - 3), step + 1))


def state_problems(state: dict[str, Any], step: int) -> list[str]:
    """What in ``state`` differs from ``fill_state(step)``."""
    out = []
    with torch.no_grad():
        for i, (name, p) in enumerate(state["model"].named_parameters()):
            want = (_base(p.numel(), i) + step).reshape(p.shape)
            if not torch.equal(p, want):
                out.append(f"model.{name}: max diff {(p - want).abs().max().item()}")
    if state["counter"].tolist() != [step, 2 * step, 3 * step, step % 7]:
        out.append(f"counter={state['counter'].tolist()}")
    want_extra = {
        "step": step,
        "tag": f"step-{step}",
        "history": list(range(max(0, step - 3), step + 1)),
    }
    if state["extra"] != want_extra:
        out.append(f"extra={state['extra']!r}, expected {want_extra!r}")
    return out


# Hidden leftovers an interrupted save (.staging-*) or deletion (.trash-*) may leave; the next
# writer sweeps both. Anything else without a manifest would be a bug.
LEFTOVER_PREFIXES = (".staging-", ".trash-")


def staging_dirs(root: str | Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(root) if n.startswith(LEFTOVER_PREFIXES))
    except FileNotFoundError:
        return []


# ----------------------------------------------------------------------------- the child


def _log(f: Any, rec: dict[str, Any]) -> None:
    f.write(json.dumps(rec) + "\n")
    f.flush()
    os.fsync(f.fileno())


def saver(root: str, log_path: str, crash_at: str | None = None, async_save: bool = False) -> int:
    """Resume from ``root``, check what was restored, then save every step until killed."""
    torch.set_num_threads(1)
    state = make_state()
    with open(log_path, "a") as log:
        ckpt = Checkpointer(root, every_n_steps=1, keep_last=KEEP_LAST, async_save=async_save)
        # Opening the directory swept every staging directory an earlier crash left behind.
        left = staging_dirs(root)
        start = ckpt.restore(state)
        problems = state_problems(state, start) if start else []
        _log(log, {"ready": start, "problems": problems, "staging_after_open": left})
        if crash_at == "retention_delete":
            _crash_inside_retention_delete()
        elif crash_at == "latest_pointer":
            _crash_inside_latest_pointer_update()
        elif crash_at == "dataloader_worker":
            # A DataLoader with a worker process (forked, the Linux default), created after the
            # Checkpointer as in any training script; it stays alive while this process runs.
            from torch.utils.data import DataLoader, TensorDataset

            loader = DataLoader(
                TensorDataset(torch.arange(10_000)),
                batch_size=1,
                num_workers=1,
                multiprocessing_context="fork",
            )
            it = iter(loader)
            next(it)
            _log(log, {"workers": [w.pid for w in getattr(it, "_workers", [])]})
        deadline = time.monotonic() + CHILD_MAX_SECONDS
        step = start
        while time.monotonic() < deadline:
            step += 1
            fill_state(state, step)
            saved = ckpt.step(step, state, metrics={"loss": 1.0 / step})
            if not saved:
                _log(log, {"error": f"step({step}) did not save"})
                return 3
            if crash_at == "retention_delete" and any(
                n.startswith(".trash-") for n in os.listdir(root)
            ):
                # Retention renamed a checkpoint out of sight inside this save; the trash bin's
                # thread deletes it and dies doing so. Save no further meanwhile.
                time.sleep(CHILD_MAX_SECONDS)
                return 4
            _log(log, {"saved": step})
    return 0


def _crash_inside_retention_delete() -> None:
    """Die by SIGKILL in the middle of the first checkpoint deletion retention performs: after
    it removed one data file, before the rest is gone (what a real kill in that window leaves
    behind)."""

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        name = os.path.basename(str(path))
        if name.startswith((".trash-step_", "step_")):
            os.unlink(os.path.join(path, "shared.safetensors"))
            os.kill(os.getpid(), signal.SIGKILL)
        real_rmtree(path, *args, **kwargs)

    real_rmtree = shutil.rmtree
    shutil.rmtree = rmtree


def _crash_inside_latest_pointer_update() -> None:
    """Die by SIGKILL while the advisory ``latest`` pointer of the second save is being
    replaced: its temporary file is written, the rename has not happened."""
    calls = []

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.basename(str(dst)) == "latest":
            calls.append(dst)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst, *args, **kwargs)

    real_replace = os.replace
    os.replace = replace


# ----------------------------------------------------------------------------- the zygote


def zygote_main() -> int:
    """Read JSON requests on stdin, answer one JSON line each on stdout."""

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "spawn":
            pid = os.fork()
            if pid == 0:  # the child: never returns into the zygote's loop
                rc = 1
                try:
                    devnull = os.open(os.devnull, os.O_RDWR)
                    os.dup2(devnull, 0)
                    os.dup2(devnull, 1)
                    err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(err, 2)
                    rc = saver(
                        req["root"], req["log"], req.get("crash_at"), bool(req.get("async_save"))
                    )
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


class Zygote:
    def __init__(self, workdir: Path) -> None:
        self.stderr_path = workdir / "zygote.stderr"
        self._err = open(self.stderr_path, "w")  # noqa: SIM115 - lives as long as the zygote
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )
        self.children: set[int] = set()
        self._read()  # the zygote has imported torch and is ready

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(
                f"the zygote did not answer (rc={self.proc.poll()}):\n{self.stderr_path.read_text()}"
            )
        return json.loads(line)

    def _request(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def spawn(
        self,
        root: Path,
        log: Path,
        stderr: Path,
        crash_at: str | None = None,
        async_save: bool = False,
    ) -> int:
        pid = self._request(
            cmd="spawn",
            root=str(root),
            log=str(log),
            stderr=str(stderr),
            crash_at=crash_at,
            async_save=async_save,
        )["pid"]
        self.children.add(pid)
        return pid

    def wait(self, pid: int) -> int:
        code = self._request(cmd="wait", pid=pid)["exitcode"]
        self.children.discard(pid)
        return code

    def close(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.wait(pid)
        with contextlib.suppress(Exception):
            self._request(cmd="quit")
        with contextlib.suppress(Exception):
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


if __name__ == "__main__" and "--zygote" in sys.argv:
    sys.exit(zygote_main())


# ----------------------------------------------------------------------------- parent helpers


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


@contextlib.contextmanager
def preserved_global_rng():
    """restore() sets the global RNGs to the checkpoint's; keep the test process's own."""
    import random as pyrandom

    py, npy, tch = pyrandom.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        pyrandom.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(tch)


def check_directory(root: Path) -> tuple[int | None, list[str], list[str]]:
    """The invariants that must hold whenever no writer is running. Returns the newest valid
    committed step (None if there is none), the staging directories present, and the other
    directories without a manifest (there should be none: the caller asserts it)."""
    names = sorted(os.listdir(root)) if root.exists() else []
    no_manifest = [
        n for n in names if (root / n).is_dir() and not (root / n / "manifest.json").exists()
    ]
    staging = [n for n in no_manifest if n.startswith(LEFTOVER_PREFIXES)]
    strays = [n for n in no_manifest if not n.startswith(LEFTOVER_PREFIXES)]
    entries = catalog.scan(str(root), Depth.FULL)
    committed = catalog.committed(entries)
    bad = [(e.name, str(e.status), e.problem) for e in committed if e.status is not Status.VALID]
    assert not bad, f"a checkpoint with a manifest is not valid (torn commit?): {bad}"
    for e in entries:
        if e.manifest is None:  # never counted as a checkpoint
            assert e.status is Status.INCOMPLETE, e
    # Every committed checkpoint is a complete one of this test's state.
    for e in committed:
        assert e.manifest is not None
        assert {f.path for f in e.manifest.files} == {
            "shared.json",
            "shared.safetensors",
            "rank_00000.json",
            "rank_00000.safetensors",
        }
    newest = max((e.step for e in committed), default=None)
    if committed:
        # Commit order (seq) and step order agree: the newest commit is the highest step.
        assert committed[-1].step == newest
        assert len(committed) <= KEEP_LAST + 1, [e.name for e in committed]
    return newest, staging, strays


def restore_fresh(root: Path) -> tuple[int, list[str]]:
    """A fresh Checkpointer(root).restore(state) in this process; no warning may be raised
    (a fallback warning would mean a committed checkpoint could not be loaded)."""
    state = make_state()
    with preserved_global_rng(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpointer(root) as ck:
            step = ck.restore(state)
    return step, (state_problems(state, step) if step else [])


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    try:
        yield z
    finally:
        z.close()


def _wait_for(pred: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize(  # suite time budget: sync -m slow
    "async_save", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "background"]
)
def test_random_sigkills_during_saves_never_tear_or_lose_a_checkpoint(tmp_path, zygote, async_save):
    """With background saves a logged "saved" step is one whose snapshot was taken: the commit
    of the step before it is complete (one save in flight at most), its own may or may not be.
    The content check then also proves a background save never mixes two steps' tensors."""
    root = tmp_path / "ckpt"
    rng = random.Random(SEED)
    known = 0  # the newest step known to be committed (0: none yet)
    maybe_next = False  # True when known + 1 may have been committed by a killed save
    killed_mid_save = 0
    swept_by_child = 0
    restores_in_parent = 0
    last_restored = 0
    stray_dirs: dict[str, int] = {}  # manifest-less non-staging directory -> trial first seen

    def check_restored(r: int, problems: list[str], who: str) -> None:
        nonlocal known, maybe_next, last_restored
        allowed = {known, known + 1} if maybe_next else {known}
        if async_save and maybe_next:
            allowed = {s for s in (known - 1, known, known + 1) if s >= last_restored}
        assert r in allowed, (
            f"trial {trial}: {who} restored step {r}; the newest committed step is "
            f"{' or '.join(map(str, sorted(allowed)))}"
        )
        assert not problems, (
            f"trial {trial}: {who} restored step {r} with wrong content: {problems}"
        )
        assert r >= last_restored
        known, maybe_next, last_restored = r, False, r

    for trial in range(TRIALS):
        log = tmp_path / f"trial{trial:03d}.log"
        err = tmp_path / f"trial{trial:03d}.stderr"
        stale = staging_dirs(root)
        early = trial % 6 == 5  # some kills land while the child opens the directory/restores
        pid = zygote.spawn(root, log, err, async_save=async_save)
        if early:
            time.sleep(rng.uniform(0.0, 0.03))
        else:

            def ready_or_dead(log: Path = log, err: Path = err) -> bool:
                recs = read_log(log)
                return any("ready" in r or "error" in r for r in recs) or (
                    err.exists() and "Traceback" in err.read_text()
                )

            _wait_for(ready_or_dead, f"trial {trial}'s child to restore")
            time.sleep(rng.uniform(0.0, 0.2))
        os.kill(pid, signal.SIGKILL)
        code = zygote.wait(pid)
        recs = read_log(log)
        stderr = err.read_text() if err.exists() else ""
        assert code == -signal.SIGKILL, (
            f"trial {trial}: the child exited with {code} before it was killed\n"
            f"log: {recs}\nstderr:\n{stderr}"
        )
        assert not [r for r in recs if "error" in r], recs
        assert "Traceback" not in stderr, f"trial {trial}: the child failed:\n{stderr}"

        ready = [r for r in recs if "ready" in r]
        if ready:
            # The child's own fresh Checkpointer restored the previous trial's state.
            rec = ready[0]
            check_restored(rec["ready"], rec["problems"], "the child")
            assert rec["staging_after_open"] == [], rec
            if stale:
                swept_by_child += 1
            saved = [r["saved"] for r in recs if "saved" in r]
            assert saved == list(range(rec["ready"] + 1, rec["ready"] + 1 + len(saved)))
            if saved:
                known = saved[-1]
            maybe_next = True  # the save after the last logged one may have committed

        newest, leftover, strays = check_directory(root)
        if leftover:
            killed_mid_save += 1
        for name in strays:
            stray_dirs.setdefault(name, trial)
        allowed = {known, known + 1} if maybe_next else {known}
        if async_save and maybe_next:
            allowed = {s for s in (known - 1, known, known + 1) if s >= last_restored}
        assert (newest or 0) in allowed, (trial, newest, known, maybe_next)

        if trial % 2 == 1 or trial == TRIALS - 1:
            # A fresh restore in this process as well (this one sweeps the staging dirs).
            r, problems = restore_fresh(root)
            restores_in_parent += 1
            check_restored(r, problems, "a fresh Checkpointer in the test process")
            assert staging_dirs(root) == []
            assert check_directory(root)[1] == []

    assert known > 0, "no checkpoint was ever committed"
    # Directories without a manifest may only be hidden staging/trash directories, which the
    # next writer removes.
    assert not stray_dirs, (
        "directories without a manifest that are not staging directories (first seen after "
        f"trial N) and were still there at the end: "
        f"{ {n: t for n, t in stray_dirs.items() if (root / n).exists()} }; all: {stray_dirs}"
    )
    # The kills did land in the middle of saves, and children swept what they found.
    assert killed_mid_save >= 3, f"only {killed_mid_save} kills landed mid-save"
    assert swept_by_child >= 1
    assert restores_in_parent >= TRIALS // 2


def test_kill_inside_retention_delete_leaves_nothing_the_next_writer_keeps(tmp_path, zygote):
    """Retention first renames a checkpoint to a hidden ``.trash-*`` name (atomic: it stops
    being a checkpoint at once), then deletes its files. A kill in the middle of that deletion
    leaves the ``.trash-*`` directory: it is never restored, and the next writer removes it."""
    root = tmp_path / "ckpt"
    log, err = tmp_path / "child.log", tmp_path / "child.stderr"
    pid = zygote.spawn(root, log, err, crash_at="retention_delete")
    code = zygote.wait(pid)  # returns once the child has killed itself
    assert code == -signal.SIGKILL, (code, read_log(log), err.read_text() if err.exists() else "")
    saved = [r["saved"] for r in read_log(log) if "saved" in r]
    # step 3 was committed, then the deletion of step 1 that its retention queued died
    assert saved == [1, 2]

    names = sorted(n for n in os.listdir(root) if (root / n).is_dir())
    trash = [n for n in names if n.startswith(".trash-step_000000001-")]
    assert len(trash) == 1 and "step_000000001" not in names, names
    entries = {e.name: e for e in catalog.scan(str(root), Depth.FULL)}
    assert entries[trash[0]].status is Status.INCOMPLETE
    assert [e.step for e in catalog.committed(entries.values())] == [2, 3]
    assert all(e.status is Status.VALID for e in catalog.committed(entries.values()))

    # Never restored: the newest valid checkpoint is.
    r, problems = restore_fresh(root)
    assert r == 3 and not problems

    # The next writer opening the directory removes the half-deleted checkpoint.
    with Checkpointer(root, every_n_steps=1, keep_last=KEEP_LAST):
        pass
    left = [
        n
        for n in os.listdir(root)
        if (root / n).is_dir() and not (root / n / "manifest.json").exists()
    ]
    assert left == [], f"{left} survived the next writer opening the directory"


def test_kill_inside_latest_pointer_update_leaves_no_stray_files(tmp_path, zygote):
    """commit.py: 'A crash at any point leaves either no checkpoint or a complete one; leftovers
    are hidden .staging-* directories that sweep_staging removes when the next writer starts.'
    A kill while the advisory ``latest`` pointer is replaced leaves its ``.latest.<hex>``
    temporary file; after the next writer opened the directory none may remain."""
    root = tmp_path / "ckpt"
    log, err = tmp_path / "child.log", tmp_path / "child.stderr"
    pid = zygote.spawn(root, log, err, crash_at="latest_pointer")
    code = zygote.wait(pid)  # returns once the child has killed itself
    assert code == -signal.SIGKILL, (code, read_log(log), err.read_text() if err.exists() else "")
    assert [r["saved"] for r in read_log(log) if "saved" in r] == [1]
    newest, staging, strays = check_directory(root)
    assert newest == 2 and staging == [] and strays == []  # step 2 was committed before the kill
    assert (root / "latest").read_text().strip() == "step_000000001"  # advisory, stale: fine

    r, problems = restore_fresh(root)  # opens the directory as the next writer
    assert r == 2 and not problems
    with Checkpointer(root, every_n_steps=1, keep_last=KEEP_LAST):
        pass
    leftovers = sorted(n for n in os.listdir(root) if n.startswith(".latest."))
    assert leftovers == [], (
        f"temporary files of the 'latest' pointer left by a killed save survive the next "
        f"writer and accumulate: {leftovers}"
    )


def test_restart_right_after_sigkill_is_not_locked_out_by_a_forked_dataloader_worker(
    tmp_path, zygote
):
    """lock.py: 'The lock dies with its process (SIGKILL included), so a crashed run never
    leaves the directory locked.' A training process has DataLoader workers, forked after the
    Checkpointer opened the directory; they inherit the flock'ed descriptor. When the trainer is
    SIGKILLed they live on for a few seconds (until their watchdog notices), and a supervisor
    that restarts the run at once must still be able to open the directory."""
    root = tmp_path / "ckpt"
    log, err = tmp_path / "child.log", tmp_path / "child.stderr"
    pid = zygote.spawn(root, log, err, crash_at="dataloader_worker")
    workers: list[int] = []
    try:
        _wait_for(
            lambda: (
                any("saved" in r for r in read_log(log))
                or (err.exists() and "Traceback" in err.read_text())
            ),
            "the child to start its DataLoader worker and save",
        )
        workers = next(r["workers"] for r in read_log(log) if "workers" in r)
        os.kill(pid, signal.SIGKILL)
        code = zygote.wait(pid)
        assert code == -signal.SIGKILL, (code, err.read_text() if err.exists() else "")
        assert workers, "could not find the DataLoader worker's pid"
        # Precondition: the orphaned worker is still alive (it checks its parent every 5 s).
        assert _alive(workers[0])

        try:
            with Checkpointer(root) as ck:  # the restarted run
                step = ck.restore(make_state())
        except CheckpointLockedError as e:
            pytest.fail(
                "the directory is still locked after its writer was SIGKILLed, because a forked "
                f"DataLoader worker (pid {workers[0]}) inherited the lock's descriptor: {e}"
            )
        assert step >= 1
    finally:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False
