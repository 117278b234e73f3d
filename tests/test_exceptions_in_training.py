"""Training that fails by an exception, not by a kill: an error raised part-way through an
optimizer's update, a KeyboardInterrupt (Ctrl-C) at any point of our own code. Whatever the
point, the directory holds only committed, verifying checkpoints, nothing stays locked, and a
re-run resumes from the newest committed one. Injections are deterministic (chosen points,
no timing)."""

from __future__ import annotations

import sys
import threading

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from resilient_callbacks import Checkpointer, CheckpointLockedError, catalog
from resilient_callbacks.catalog import Depth
from resilient_callbacks.lightning import ResilientCheckpoint
from resilient_callbacks.optim import update_began


def _committed(root) -> list[tuple[int, str]]:
    return [
        (e.step, e.manifest.reason)
        for e in catalog.scan(str(root), Depth.FULL)
        if e.manifest is not None and str(e.status) == "valid"
    ]


@pytest.mark.parametrize("how", ["keyword", "positional", "none"])
def test_the_update_counts_as_begun_once_the_closure_returned(how):
    """``step(closure)`` evaluates the closure (forward, backward) before it updates anything:
    an exception in it leaves the weights as they were. ``args`` of a step pre-hook are
    ``step()``'s own, the optimizer first."""
    lin = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    began: list[bool] = []
    handle = opt.register_step_pre_hook(update_began(lambda: began.append(True)))

    def closure(fail: bool):
        def run():
            assert not began  # (nothing marked before the closure ran)
            if fail:
                raise RuntimeError("out of memory in the forward pass")
            opt.zero_grad()
            loss = lin(torch.ones(1, 2)).sum()
            loss.backward()
            return loss

        return run

    def step(fail: bool) -> None:
        if how == "keyword":
            opt.step(closure=closure(fail))
        elif how == "positional":
            opt.step(closure(fail))
        else:
            if fail:
                raise RuntimeError("out of memory in the forward pass")
            closure(False)()
            opt.step()

    with pytest.raises(RuntimeError):
        step(fail=True)
    assert began == []
    step(fail=False)
    assert began == [True]
    handle.remove()


class _TornSGD(torch.optim.SGD):
    """SGD whose ``fail_at``-th step raises part-way through its update: after the closure (the
    forward and backward) and after the first parameter changed, as an out-of-memory error in
    the middle of a step does."""

    fail_at = 0
    calls = 0

    def step(self, closure=None):
        type(self).calls += 1
        if type(self).calls != self.fail_at:
            return super().step(closure)
        if closure is not None:
            closure()
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(100.0)
        raise RuntimeError("out of memory in the middle of the update (simulated)")


class _Module(L.LightningModule):
    def __init__(self, fail_forward_at: int = 0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.fail_forward_at = fail_forward_at

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.fail_forward_at:
            raise RuntimeError("a NaN check in the forward pass (simulated)")
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return _TornSGD(self.parameters(), lr=0.1)


def _fit(root, module: _Module) -> ResilientCheckpoint:
    L.seed_everything(0, verbose=False)
    rc = ResilientCheckpoint(root, every_n_steps=2, save_on_exception=True, preemption=False)
    fit_8_steps(module, rc)
    return rc


def fit_8_steps(module: L.LightningModule, rc: ResilientCheckpoint) -> None:
    """8 steps of ``module`` on CPU with ``rc``, a fixed batch of 64 in 4s, nothing else."""
    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        callbacks=[rc],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)))
    trainer.fit(module, DataLoader(data, batch_size=4))


@pytest.fixture
def torn_at(monkeypatch):
    def at(n: int) -> None:
        monkeypatch.setattr(_TornSGD, "calls", 0)
        monkeypatch.setattr(_TornSGD, "fail_at", n)

    return at


def test_lightning_saves_nothing_after_an_update_that_raised_part_way(tmp_path, torn_at, caplog):
    """The callback watched optimizer steps with a post-hook, which a step that raised in its
    update never reaches: the half-updated weights were saved as the step before (an emergency
    checkpoint the re-run resumed from, its weights off by 100)."""
    torn_at(5)  # the update of step 5 raises
    module = _Module()
    with pytest.raises(RuntimeError, match="middle of the update"):
        _fit(tmp_path / "ck", module)
    assert _committed(tmp_path / "ck") == [(2, "periodic"), (4, "periodic")]
    assert "began updating the weights" in caplog.text
    torn_at(0)
    rc = _fit(tmp_path / "ck", _Module())
    assert rc.restored_step == 4


def test_lightning_saves_the_last_step_after_an_error_in_the_forward_pass(tmp_path, torn_at):
    """The forward and backward run inside the closure Lightning hands ``optimizer.step()``:
    an exception there changed no weight, and the last completed step is saved."""
    torn_at(0)
    with pytest.raises(RuntimeError, match="NaN check"):
        _fit(tmp_path / "ck", _Module(fail_forward_at=6))
    assert _committed(tmp_path / "ck")[-1] == (5, "emergency")


# ----------------------------------------------------------------------------- Ctrl-C


class _CtrlC:
    """A KeyboardInterrupt raised at one chosen point of our code, as Ctrl-C delivers it to the
    main thread: on entering function ``func`` of ``module``, or at its line (any function's,
    with ``func=None``) that contains ``line`` (deterministic: chosen points, not timing). Fires once."""

    def __init__(self, module: str, func: str | None, line: str | None = None) -> None:
        import importlib

        self.file = importlib.import_module(f"resilient_callbacks.{module}").__file__
        self.func, self.line, self.fired = func, line, False

    def _global(self, frame, event, arg):
        code = frame.f_code
        if self.fired or code.co_filename != self.file or self.func not in (None, code.co_name):
            return None
        if self.line is None:
            self.fired = True
            raise KeyboardInterrupt
        return self._local

    def _local(self, frame, event, arg):
        import linecache

        line = linecache.getline(self.file, frame.f_lineno) if event == "line" else ""
        if not self.fired and self.line in line:
            self.fired = True
            raise KeyboardInterrupt
        return self._local

    def __enter__(self) -> _CtrlC:
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)


@pytest.mark.parametrize(
    "where",
    [
        ("lock", None, "os.ftruncate(fd, 0)"),  # flocked, its fd a local of the frame
        ("commit", "sweep_staging", None),  # locked; the Directory not yet the Checkpointer's
        ("directory_open", "open_directory", "return d"),  # opened, not yet returned
        ("telemetry", "__init__", None),  # the Checkpointer's parts half made, its thread started
        ("exit_hook", "at_exit", None),  # everything made but the exit hook
    ],
    ids=lambda w: f"{w[0]}.{w[1] or w[2]}",
)
def test_ctrl_c_while_a_checkpointer_opens_leaves_nothing_locked_or_running(tmp_path, where):
    """A Ctrl-C in a notebook while ``Checkpointer(...)`` opened its directory: the half-built
    Checkpointer, which no one can close, lived on in the traceback the notebook keeps, with the
    directory locked: re-running the cell failed with "this process already has a writer open"
    until the kernel restarted (from the lock itself: an fd never closed, for good)."""
    root = tmp_path / "ck"
    Checkpointer(root, preemption=False).close()  # the directory exists: its sweep runs
    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt) as caught, _CtrlC(*where) as ctrl_c:
        Checkpointer(root, every_n_steps=1)
    assert ctrl_c.fired
    kept = caught.value.__traceback__  # (a notebook's sys.last_traceback)
    for t in set(threading.enumerate()) - before:
        t.join(timeout=60)
        assert not t.is_alive(), t.name
    with Checkpointer(root, preemption=False) as ck:  # the cell run again
        assert ck.restore({"w": torch.zeros(2)}) == 0
        ck.save(1, {"w": torch.ones(2)})
    assert [s for s, _ in _committed(root)] == [1]
    del kept


_COLLECTED_INSIDE = r"""
import gc, mmap, os, sys, tempfile
from resilient_callbacks import mapped
import torch

path = os.path.join(tempfile.mkdtemp(), "f")
with open(path, "wb") as f:
    f.write(b"x" * 8192)
with open(path, "rb") as f:
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
mapped.register(mm, path)
cycle = [mm]
cycle.append(cycle)  # freed by the cyclic collector only, as frames an exception's traceback held
del cycle, mm
gc.disable()

def collect_inside(frame, event, arg):  # the collector runs at an allocation in the lock
    if frame.f_code.co_filename == mapped.__file__ and frame.f_code.co_name == "is_mapped":
        def local(frame, event, arg):
            if event == "line" and "return any" in open(mapped.__file__).readlines()[frame.f_lineno - 1]:
                gc.collect()
            return local
        return local
    return None

sys.settrace(collect_inside)
mapped.is_mapped(torch.zeros(3))
sys.settrace(None)
print("returned", mapped.still_mapped(os.path.dirname(path)))
"""


def test_a_mapping_freed_by_the_collector_inside_the_registry_lock_does_not_deadlock(tmp_path):
    """The callback that drops a freed mapping from the registry took its lock, which the same
    thread may hold already: the cyclic collector, freeing a mapping that a Ctrl-C'd restore's
    traceback held, runs at any allocation, one inside a locked section too. The thread hung
    there for good (found with a KeyboardInterrupt injected into a restore, then restoring
    again)."""
    import subprocess

    import spawn_ranks

    try:  # a process of its own, forked from the session's zygote (torch imported once)
        out = spawn_ranks.run_python([sys.executable, "-c", _COLLECTED_INSIDE], timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("is_mapped() deadlocked when the collector freed a mapping inside its lock")
    assert out.returncode == 0, out.stderr
    assert "returned []" in out.stdout


def test_ctrl_c_while_close_waits_abandons_the_save_and_keeps_the_directory_locked(
    tmp_path, monkeypatch
):
    """A Ctrl-C while ``close()`` waited for a background save ("waiting for 1 checkpoint(s)
    still being written"): the lock was released at once while the save went on writing, so
    the writer the notebook opened next swept its staging directory from under it. Now it is
    as a ``close(timeout)`` that ran out: the save is abandoned (never committed) and the
    directory stays locked until it stopped."""
    from resilient_callbacks import persisting
    from resilient_callbacks.lock import DirLock

    orig = persisting.layout.write_part
    gate, writing = threading.Event(), threading.Event()

    def gated(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            writing.set()
            assert gate.wait(60)
        return orig(*a, **k)

    root = tmp_path / "ck"
    ck = Checkpointer(root, preemption=False)
    ck.save(1, {"w": torch.ones(2)})
    ck.flush()
    monkeypatch.setattr(persisting.layout, "write_part", gated)
    ck.save(2, {"w": torch.full((2,), 2.0)})  # being written in the background, held
    try:
        assert writing.wait(60)  # (a save abandoned before it began writing holds nothing)
        with pytest.raises(KeyboardInterrupt), _CtrlC("background", "wait_all", "self._cond.wait"):
            ck.close()
        with pytest.raises(CheckpointLockedError):
            DirLock(str(root)).acquire()  # the abandoned save still runs: still locked
    finally:
        gate.set()
    persister = ck._saver.persister
    assert persister is not None and persister.wait_all(60)
    got = {"w": torch.zeros(2)}
    with Checkpointer(root, preemption=False) as again:  # released once it stopped
        assert again.restore(got) == 1  # abandoned: never committed
    assert torch.equal(got["w"], torch.ones(2))
    assert _committed(root) == [(1, "forced")]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize(
    "where",
    [
        ("closing", "_answered_elsewhere_s", None),  # close()'s first steps
        ("closing", "_sinks_deadline", None),  # the release's argument
        ("recorder", "closed", None),
        ("trash", "stop", None),
        ("closing", None, "users_exit()"),
    ],
    ids=lambda w: f"{w[0]}.{w[1] or w[2]}",
)
def test_ctrl_c_inside_close_still_releases_the_lock_and_threads(tmp_path, where, async_save):
    """A Ctrl-C in the middle of ``close()``'s release (the history's last record, a thread's
    stop, the signal handlers' check) skipped the rest of it: the Checkpointer was closed
    (a second close() does nothing) but the directory stayed locked and its threads ran on."""
    root = tmp_path / "ck"
    before = set(threading.enumerate())
    ck = Checkpointer(root, async_save=async_save, keep_last=1)
    ck.save(1, {"w": torch.ones(2)})
    ck.save(2, {"w": torch.full((2,), 2.0)})
    ck.flush()  # (one still being written when close() is interrupted is abandoned: above)
    with pytest.raises(KeyboardInterrupt), _CtrlC(*where) as ctrl_c:
        ck.close()
    assert ctrl_c.fired and ck.closed
    ck.close()  # (nothing more to do)
    for t in set(threading.enumerate()) - before:
        t.join(timeout=60)
        assert not t.is_alive(), t.name
    got = {"w": torch.zeros(2)}
    with Checkpointer(root, preemption=False) as again:  # the notebook's next writer
        assert again.restore(got) == 2
    assert torch.equal(got["w"], torch.full((2,), 2.0))
    assert _committed(root) == [(2, "forced")]
