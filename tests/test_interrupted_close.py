"""A ``close()`` that a Ctrl-C interrupts, and a Checkpointer dropped after its close: whatever
the point of the interruption, a second ``close()`` (or dropping the object) frees the lock and
the threads, the history says how the run ended (never a clean ``end`` for a close that did not
finish, never no record at all), and a Checkpointer closed normally does nothing more when it
is dropped. Interruptions are injected at chosen points (``sys.settrace``), never by timing."""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

from resilient_callbacks import Checkpointer, CheckpointLockedError, history
from resilient_callbacks.lock import DirLock
from resilient_callbacks.report import analyse
from test_exceptions_in_training import _committed, _CtrlC

# points of close() before it reaches its try/finally (Checkpointer.close, after _closed is set)
_BEFORE_TRY = [
    ("dist", "peer_errors", None),  # the with statement around closing.close
    ("preemption.exiting", "closing", None),  # closing.close's decorator
    ("closing", "close", "persister = ck._saver.persister"),  # its first lines
]


def _ended(root) -> list[tuple[str, str | None]]:
    return [(lf["ended"], lf["error"]) for lf in analyse(str(root))["lives"]]


def _threads_end(before: set[threading.Thread]) -> None:
    for t in set(threading.enumerate()) - before:
        t.join(timeout=60)
        assert not t.is_alive(), t.name


@pytest.mark.parametrize("then", ["close_again", "drop"])
@pytest.mark.parametrize("where", _BEFORE_TRY, ids=lambda w: f"{w[0]}.{w[1] or w[2]}")
def test_ctrl_c_before_close_reaches_its_try_is_finished_by_a_second_close_or_the_drop(
    tmp_path, where, then
):
    """A Ctrl-C in close()'s first lines, after it marked the Checkpointer closed but before
    its try/finally: nothing was released, and a second close() returned at once (closed), so
    the directory stayed locked and the threads ran on for the life of the process (a
    notebook's next writer: "this process already has a writer open"). Now a second close()
    does the whole close (the pending save commits, the history gets its end), and dropping
    the object releases what it holds."""
    root = tmp_path / "ck"
    before = set(threading.enumerate())
    ck = Checkpointer(root, keep_last=1, preemption=False)
    ck.save(1, {"w": torch.ones(2)})
    ck.save(2, {"w": torch.full((2,), 2.0)})
    with pytest.raises(KeyboardInterrupt) as caught, _CtrlC(*where) as ctrl_c:
        ck.close()
    assert ctrl_c.fired and ck.closed
    del caught  # (its traceback holds the Checkpointer)
    if then == "close_again":
        ck.close()
        assert not ck._dir.lock.held
        assert _ended(root) == [("clean", None)]  # it did close, the second time
    else:
        assert ck._saver.persister is not None and ck._saver.persister.wait_all(60)
        del ck
        gc.collect()
    _threads_end(before)
    lock = DirLock(str(root))
    lock.acquire(wait_s=0.0)  # free
    lock.release()
    got = {"w": torch.zeros(2)}
    with Checkpointer(root, preemption=False) as again:
        assert again.restore(got) == 2
    assert torch.equal(got["w"], torch.full((2,), 2.0))


@pytest.mark.parametrize(
    "where",
    [
        ("closing", "_answered_elsewhere_s", None),  # close()'s first steps, in its try
        ("closing", "_sinks_deadline", None),  # the release's argument
        ("recorder", "closed", None),  # the release's first step
    ],
    ids=lambda w: f"{w[0]}.{w[1] or w[2]}",
)
def test_a_close_interrupted_before_its_end_record_records_the_interruption(tmp_path, where):
    """A Ctrl-C in close() before the history's end record: the life had no record of how it
    ended (the report said "killed", or "running" while the lock stayed held), or, interrupted
    while it waited, a clean ``end`` though it never finished. Now it is a failure, with the
    exception's name, as a Ctrl-C during training is."""
    root = tmp_path / "ck"
    ck = Checkpointer(root, every_n_steps=1, preemption=False)
    ck.restore({"w": torch.zeros(2)})
    ck.step(1, {"w": torch.ones(2)})
    ck.flush()
    with pytest.raises(KeyboardInterrupt), _CtrlC(*where) as ctrl_c:
        ck.close()
    assert ctrl_c.fired and not ck._dir.lock.held
    assert _ended(root) == [("failed", "KeyboardInterrupt")]
    ck.close()  # (nothing more to do: no second record)
    events = [r["event"] for r in history.records(str(root)) if r["event"] in ("end", "failed")]
    assert events == ["failed"]


def test_ctrl_c_while_close_waits_for_a_save_is_recorded_as_a_failure_not_an_end(
    tmp_path, monkeypatch
):
    """A Ctrl-C while close() waited for a background save abandons it (never committed):
    the history said ``end``, a clean stop whose restart is no failure, though the save was
    lost."""
    root = tmp_path / "ck"
    ck, gate = _save_held(root, monkeypatch, 60, step=2)
    try:
        with pytest.raises(KeyboardInterrupt), _CtrlC("background", "wait_all", "self._cond.wait"):
            ck.close()
    finally:
        gate.set()
    persister = ck._saver.persister
    assert persister is not None and persister.wait_all(60)
    assert _committed(root) == [(1, "periodic")]
    assert _ended(root) == [("failed", "KeyboardInterrupt")]


def test_dropping_a_checkpointer_closed_normally_does_nothing(tmp_path):
    """``__del__`` ran the whole drop (threads told to stop, the lock released, the signal
    handlers restored) on a Checkpointer already closed, the next writer of its directory
    already open: no I/O, no thread or lock of the next writer's touched."""
    root = tmp_path / "ck"
    ck = Checkpointer(root, every_n_steps=1, remote=f"file://{tmp_path}/remote")
    ck.step(1, {"w": torch.ones(2)})
    ck.close()
    nxt = Checkpointer(root, every_n_steps=1, remote=f"file://{tmp_path}/remote")
    seen: list[str] = []
    watching = threading.Event()

    def audit(event: str, args: object) -> None:
        if watching.is_set() and threading.current_thread() is threading.main_thread():
            seen.append(event)

    sys.addaudithook(audit)  # (cannot be removed: gated by the event)
    calls: list[str] = []
    release = ck._dir.lock.release
    ck._dir.lock.release = lambda: (calls.append("lock.release"), release())  # type: ignore
    try:
        watching.set()
        ck.__del__()
    finally:
        watching.clear()
    assert seen == [] and calls == []
    assert nxt._dir.lock.held
    with pytest.raises(CheckpointLockedError):
        DirLock(str(root)).acquire(wait_s=0.0)
    nxt.close()


_INTERRUPTED_THEN_EXIT = """
import sys, torch
from resilient_callbacks import Checkpointer, dist
ck = Checkpointer(sys.argv[1], every_n_steps=1, preemption=False)
ck.restore({"w": torch.zeros(2)})
ck.step(1, {"w": torch.ones(2)})
orig = dist.peer_errors
def ctrl_c(*a, **k):  # close()'s first lines: before its try/finally
    dist.peer_errors = orig
    raise KeyboardInterrupt
dist.peer_errors = ctrl_c
try:
    ck.close()
except KeyboardInterrupt:
    print("interrupted", ck.closed, flush=True)
"""


def test_a_close_interrupted_before_its_try_is_finished_at_exit(tmp_path):
    """The program caught the Ctrl-C of a close() interrupted in its first lines and ended, the
    Checkpointer still referenced: the exit hook skipped it (closed), so its pending save was
    never waited for and the history had no record of how the run ended (the report: killed).
    Now the exit finishes the close."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    root = tmp_path / "ck"
    p = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_THEN_EXIT, str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0 and "interrupted True" in p.stdout, p.stderr
    assert _committed(root) == [(1, "periodic")]
    assert _ended(root) == [("clean", None)]


def _save_held(
    root, monkeypatch, hold_s: float, step: int = 1
) -> tuple[Checkpointer, threading.Event]:
    """A Checkpointer at ``root`` whose background save of ``step`` is held in its write (up
    to ``hold_s``) until the returned event is set; the steps before it are committed."""
    from resilient_callbacks import persisting

    orig = persisting.layout.write_part
    gate, writing = threading.Event(), threading.Event()

    def gated(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            writing.set()
            assert gate.wait(hold_s)
        return orig(*a, **k)

    ck = Checkpointer(root, every_n_steps=1, preemption=False)
    ck.restore({"w": torch.zeros(2)})
    for before in range(1, step):
        ck.step(before, {"w": torch.full((2,), float(before))})
        ck.flush()
    monkeypatch.setattr(persisting.layout, "write_part", gated)
    ck.step(step, {"w": torch.full((2,), float(step))})
    assert writing.wait(60)
    return ck, gate


def _closing_in_a_thread(ck: Checkpointer, close) -> threading.Thread:
    """``close()`` started in a thread, returned once it has begun (it marked ``ck`` closed)."""
    first = threading.Thread(target=close)
    first.start()
    for _ in range(600):
        if ck.closed:
            break
        first.join(timeout=0.1)
    assert ck.closed
    return first


def test_a_close_from_a_second_thread_during_a_close_waits_for_it_and_adds_nothing(
    tmp_path, monkeypatch
):
    """A close() from a second thread while the first one waited for a background save (the
    exit hook, a framework's teardown): it found the Checkpointer closed but not yet released,
    as after an interrupted close, and must not run a second close beside the first one (a
    second end record, a second release); it returns once the first one has ended."""
    root = tmp_path / "ck"
    ck, gate = _save_held(root, monkeypatch, 60)
    first_done, second_done = threading.Event(), threading.Event()

    def close_and(done: threading.Event) -> None:
        ck.close()
        done.set()

    _closing_in_a_thread(ck, lambda: close_and(first_done))
    second = threading.Thread(target=close_and, args=(second_done,))
    second.start()
    gate.set()
    assert first_done.wait(60)
    second.join(timeout=60)
    assert second_done.is_set()
    events = [r["event"] for r in history.records(str(root)) if r["event"] in ("end", "failed")]
    assert events == ["end"]
    assert _committed(root) == [(1, "periodic")]


def test_a_second_threads_close_with_a_timeout_waits_no_longer_for_the_first(
    tmp_path, monkeypatch, caplog
):
    """close(timeout) from a second thread while the first close waited for a held background
    save (a preemption's exit, bounded by its grace period, beside a close in another thread):
    it waited for the first close to end, however long, past its own timeout. It now returns
    after its timeout (said in a warning); the first close still finishes the work."""
    root = tmp_path / "ck"
    ck, gate = _save_held(root, monkeypatch, 120)
    second_done = threading.Event()
    try:
        first = _closing_in_a_thread(ck, ck.close)
        second = threading.Thread(target=lambda: (ck.close(timeout=0.2), second_done.set()))
        second.start()
        second.join(timeout=60)  # (its timeout is 0.2 s; the save stays held meanwhile)
        assert second_done.is_set(), "close(timeout=0.2) waited for the other thread's close"
        assert "another thread's close()" in caplog.text
    finally:
        gate.set()
    first.join(timeout=120)
    assert not first.is_alive()
    assert _committed(root) == [(1, "periodic")]
