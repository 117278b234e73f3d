"""``DirLock.release`` from two threads at once: the background save thread (a release queued
after an abandoned save) and the main thread (``Checkpointer.__del__`` or ``close()``). Both
passed the ``_fd`` check and both closed the same fd number; the second close could close a file
another thread had just opened. Each interleaving here is made exact by pausing the first thread
inside the real OS call."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from resilient_callbacks import lock as lockmod
from resilient_callbacks.lock import DirLock

WAIT_S = 60.0


def _pause_in(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, when: Callable[..., bool]
) -> tuple[threading.Event, threading.Event]:
    """Wrap the real ``module.name`` so that the thread named ``"first"``, once ``when(*args)``,
    stops before the real call (``inside`` set) until ``go`` is set."""
    real = getattr(module, name)
    inside, go = threading.Event(), threading.Event()

    def wrapper(*args: Any, **kw: Any) -> Any:
        if threading.current_thread().name == "first" and not inside.is_set() and when(*args):
            inside.set()
            assert go.wait(WAIT_S), "never let go"
        return real(*args, **kw)

    monkeypatch.setattr(module, name, wrapper)
    return inside, go


def _run(target: Callable[[], None], errors: list[BaseException], name: str) -> threading.Thread:
    def body() -> None:
        try:
            target()
        except BaseException as e:  # reported by the test
            errors.append(e)

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t


def _count_closes(monkeypatch: pytest.MonkeyPatch, fds: set[int]) -> list[int]:
    closed: list[int] = []
    real = os.close

    def counting(fd: int) -> None:
        if fd in fds:
            closed.append(fd)
        real(fd)

    monkeypatch.setattr(os, "close", counting)
    return closed


@pytest.mark.parametrize("pause_in", ["flock", "close"])
def test_two_releases_at_once_close_the_fd_once(tmp_path, monkeypatch, pause_in):
    lk = DirLock(str(tmp_path))
    lk.acquire()
    fd = lk._fd
    assert fd is not None
    closed = _count_closes(monkeypatch, {fd})
    if pause_in == "flock":
        inside, go = _pause_in(
            monkeypatch, fcntl, "flock", lambda f, op: f == fd and op == fcntl.LOCK_UN
        )
    else:
        inside, go = _pause_in(monkeypatch, os, "close", lambda f: f == fd)
    errors: list[BaseException] = []
    first = _run(lk.release, errors, "first")  # (the save thread's queued release)
    try:
        assert inside.wait(WAIT_S), "the first release never reached the OS call"
        second = _run(lk.release, errors, "second")  # (the main thread's __del__ / close())
        second.join(WAIT_S)
        assert not second.is_alive(), "the second release waited for the first"
    finally:
        go.set()
        first.join(WAIT_S)
    assert not first.is_alive()
    assert errors == []
    assert closed == [fd]
    assert not lk.held
    lk.release()  # (idempotent)
    assert closed == [fd]
    again = DirLock(str(tmp_path))  # the lock is free
    again.acquire(wait_s=0.0)
    again.release()


def test_a_release_while_verify_relocks_leaves_nothing_locked_and_closes_each_fd_once(
    tmp_path, monkeypatch
):
    """``verify`` (on the save thread) finds ``.lock`` deleted and locks a new one; ``release``
    (closing, on the main thread) runs in between: the old fd was closed twice and the new lock
    was kept, after the release, for the life of the process."""
    lk = DirLock(str(tmp_path))
    lk.acquire()
    old = lk._fd
    assert old is not None
    os.unlink(lk.path)
    opened: list[int] = []
    real_open = os.open

    def recording_open(path: Any, *a: Any, **kw: Any) -> int:
        fd = real_open(path, *a, **kw)
        if os.fspath(path) == lk.path:
            opened.append(fd)
        return fd

    monkeypatch.setattr(os, "open", recording_open)
    closed_all: list[int] = []
    real_close = os.close

    def counting(fd: int) -> None:
        if fd == old or fd in opened:
            closed_all.append(fd)
        real_close(fd)

    monkeypatch.setattr(os, "close", counting)
    # pause verify's thread in the flock of the new file (after its open, before it is kept)
    inside, go = _pause_in(
        monkeypatch, fcntl, "flock", lambda f, op: f in opened and op & fcntl.LOCK_EX
    )
    errors: list[BaseException] = []
    saver = _run(lk.verify, errors, "first")
    try:
        assert inside.wait(WAIT_S), "verify never locked the new file"
        closer = _run(lk.release, errors, "second")
        closer.join(WAIT_S)
        assert not closer.is_alive(), "release waited for verify"
    finally:
        go.set()
        saver.join(WAIT_S)
    assert not saver.is_alive()
    assert errors == []
    assert not lk.held
    assert len(opened) == 1
    assert sorted(closed_all) == sorted([old, opened[0]])  # each once
    assert lockmod._held_here(lk.path) is False
    again = DirLock(str(tmp_path))  # nothing of this process holds the new file
    again.acquire(wait_s=0.0)
    again.release()


def test_a_writer_waiting_for_a_command_takes_the_lock_it_releases(tmp_path, monkeypatch):
    """A writer waits for a ``resilient-ckpt gc`` that holds the directory. The command's
    ``release`` clears ``.lock`` before it unlocks: a writer that read the file in between
    found no command named there, stopped waiting, failed to lock the file (still locked) and
    raised "another process is writing checkpoints" (a run started beside an operator's gc
    crashed as it finished). It goes on waiting: here the command clears the file at the
    writer's first pause (its lock kept) and unlocks at the second."""
    gc = DirLock(str(tmp_path), command="gc")  # (its own open file: a lock apart)
    gc.acquire()
    real_sleep = lockmod.time.sleep
    pauses: list[float] = []
    # (time.sleep is patched for the whole process: another test's thread still running that
    # sleeps meanwhile is not the writer; and the file's blank moment is waited for however
    # long this loaded machine stalls between the writer's two looks, not 2 s of it)
    writer_thread = threading.current_thread()
    monkeypatch.setattr(lockmod, "_BLANK_S", WAIT_S, raising=False)

    def sleep(s: float) -> None:
        if threading.current_thread() is not writer_thread:
            return real_sleep(s)
        pauses.append(s)
        if len(pauses) == 1:
            assert gc._fd is not None
            os.ftruncate(gc._fd, 0)  # the command's release, up to its unlock
        elif len(pauses) == 2:
            gc.release()
        real_sleep(0)

    monkeypatch.setattr(lockmod.time, "sleep", sleep)
    writer = DirLock(str(tmp_path))
    try:
        writer.acquire(wait_s=WAIT_S)
        assert writer.held and len(pauses) >= 2
        with open(writer.path) as f:
            assert f'"pid": {os.getpid()}' in f.read()
    finally:
        writer.release()
        gc.release()
