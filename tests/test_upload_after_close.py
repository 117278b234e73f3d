"""An upload attempt that outlives its Checkpointer's ``close()`` (close gave up on it: a
timeout, a stalled store) and the next writer of the same directory and remote, opened right
after in the same process (a notebook, a sweep): the two upload threads must not write the same
remote checkpoint out of order. The store is moto's real S3 server; the old attempt is held
inside its file upload by an event (no sleeps, no timing asserts)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

from resilient_callbacks import Checkpointer, upload_thread, upload_wait


@pytest.fixture(autouse=True)
def _looks_often(monkeypatch):
    """The waits here end by events: each look at them is made often (close()'s at the uploads,
    the next writer's at the previous attempt, 1 s each by default) and stop()'s join of an
    attempt held by the test is short (1 s by default), so no test waits real seconds."""
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)
    monkeypatch.setattr(upload_thread, "HANDOVER_LOOK_S", 0.05)
    monkeypatch.setattr(upload_thread, "STOP_JOIN_S", 0.1)


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v))}


def _old_writer(local, s3_remote) -> tuple[Checkpointer, threading.Thread, Any]:
    """The first writer of the store (keep_last=1), its upload thread and its filesystem."""
    url, options = s3_remote
    old = Checkpointer(local, remote=url, remote_options=options, keep_last=1, preemption=False)
    assert old._dir.sync is not None
    return old, old._dir.sync._thread, old.remote.fs


@pytest.mark.parametrize("held_in", ["files", "manifest"])
def test_an_upload_close_gave_up_on_never_overlaps_the_next_writers_uploads(
    tmp_path, s3_remote, monkeypatch, caplog, held_in
):
    """The old thread, held in its upload of step 1 (its files, or its manifest: the commit
    point) while close(timeout) returned and the next writer uploaded step 1 itself, then step
    2, and its retention (keep_last=1) deleted step 1 from the store: released just before its
    manifest, the old thread committed step 1 again, its files deleted (a damaged checkpoint in
    the store). Now the next writer's uploads wait for the old attempt to end."""
    url, options = s3_remote
    local = tmp_path / "local"
    old, old_thread, fs = _old_writer(local, s3_remote)
    method = "put" if held_in == "files" else "pipe_file"  # (the manifest: the commit point)
    orig = getattr(fs, method)
    inside, go = threading.Event(), threading.Event()

    def held(*a, **k):
        path = str(a[0] if a else "")
        if threading.current_thread() is old_thread and (
            held_in == "files" or path.endswith("/manifest.json")
        ):
            inside.set()
            go.wait(120)
        return orig(*a, **k)

    monkeypatch.setattr(fs, method, held)
    waiting = threading.Event()

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for the upload" in record.getMessage():
                waiting.set()

    said = Said()
    caplog.set_level(logging.INFO, logger="resilient_callbacks")  # (the wait is said at INFO)
    logging.getLogger("resilient_callbacks").addHandler(said)
    try:
        old.save(1, _state(1))
        assert inside.wait(60)
        old.close(timeout=0.0)  # gives up on the upload under way
        with Checkpointer(
            local, remote=url, remote_options=options, keep_last=1, preemption=False
        ) as new:
            assert new.restore(_state(0)) == 1
            new.save(2, _state(2))
            new.flush()
            assert new._dir.sync is not None and new._dir.sync._thread is not old_thread
            # the new writer uploads step 1 and step 2 and deletes step 1 remotely, unless it
            # waits for the old attempt to end (it says so): either way, the old one goes on
            for _ in range(600):
                if waiting.is_set() or new._dir.sync.wait(timeout=0.2):
                    break
            go.set()
    finally:
        go.set()
        logging.getLogger("resilient_callbacks").removeHandler(said)
    old_thread.join(timeout=120)
    assert not old_thread.is_alive()
    committed = {e.manifest.step: e for e in old.remote.scan() if e.manifest is not None}
    assert max(committed) == 2
    for e in committed.values():  # every committed checkpoint in the store is whole
        assert e.manifest is not None
        missing = [f.path for f in e.manifest.files if e.sizes.get(f.path) != f.size]
        assert not missing, f"{e.name} is committed with {missing} missing"


def test_the_next_writers_close_gives_up_on_a_previous_attempt_that_never_returns(
    tmp_path, s3_remote, monkeypatch, caplog
):
    """The old thread's attempt never returns (a store that stopped answering, held here by an
    event): the next writer's thread waits for it, and its close() (no timeout) waited with it
    for ever, where its own stalled upload is given up after the outage limit. Now the wait
    counts as a stall: close() gives up after the limit and raises UploadIncompleteError
    naming what is only local. Its warning says it waited for the previous writer's upload
    (it said "last error: none: still uploading")."""
    from resilient_callbacks import checkpointer
    from resilient_callbacks.errors import UploadIncompleteError

    url, options = s3_remote
    local = tmp_path / "local"
    old, old_thread, fs = _old_writer(local, s3_remote)
    orig = fs.put
    inside, go = threading.Event(), threading.Event()

    def held(*a, **k):
        if threading.current_thread() is old_thread:
            inside.set()
            go.wait(300)
        return orig(*a, **k)

    monkeypatch.setattr(fs, "put", held)
    monkeypatch.setattr(checkpointer, "CLOSE_OUTAGE_S", 0.5)  # (the attempt hangs on an event)
    outcome: list[BaseException | None] = []
    try:
        old.save(1, _state(1))
        assert inside.wait(60)
        old.close(timeout=0.0)  # gives up on the upload under way
        new = Checkpointer(local, remote=url, remote_options=options, preemption=False)
        new.restore(_state(0))
        new.save(2, _state(2))
        new.flush()

        def close() -> None:
            try:
                new.close()
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        caplog.clear()  # (the old writer's close rightly said "still uploading")
        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        closer.join(timeout=120)  # (the outage limit is 0.5 s)
        assert not closer.is_alive(), "close() still waits for the previous writer's attempt"
    finally:
        go.set()
    old_thread.join(timeout=120)
    assert len(outcome) == 1 and isinstance(outcome[0], UploadIncompleteError), outcome
    assert "step_000000002" in str(outcome[0])
    assert "waited for the upload of the previous writer of this store" in caplog.text
    assert "still uploading" not in caplog.text


def test_a_checkpoint_the_previous_writer_committed_late_counts_for_keep_last(
    tmp_path, s3_remote, monkeypatch, caplog
):
    """The old thread, held in its upload of step 3, commits it after the next writer opened
    (which waits for it, then skips step 3, step 4 being queued): that commit is this
    process's, not another live process's. It was left out of the new writer's remote
    retention (and warned about as another process's): the store kept more than
    ``keep_last`` checkpoints for good. Now it counts and goes."""
    url, options = s3_remote
    local = tmp_path / "local"
    old, old_thread, fs = _old_writer(local, s3_remote)
    old.save(1, _state(1))
    old.flush()
    assert old._dir.sync.wait(timeout=120)
    orig = fs.pipe_file
    inside, go = threading.Event(), threading.Event()

    def held(*a, **k):
        if threading.current_thread() is old_thread and str(a[0]).endswith("/manifest.json"):
            inside.set()
            go.wait(120)
        return orig(*a, **k)

    monkeypatch.setattr(fs, "pipe_file", held)
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    try:
        old.save(3, _state(3))
        assert inside.wait(60)
        old.close(timeout=0.0)  # gives up on the upload of step 3, held before its manifest
        new = Checkpointer(local, remote=url, remote_options=options, keep_last=1, preemption=False)
        assert new.restore(_state(0)) == 3
        new.save(4, _state(4))
        new.flush()  # (queued behind step 3: the new writer uploads only step 4)
        go.set()  # the old attempt commits step 3 remotely while the new writer waits for it
        new.close()
    finally:
        go.set()
    old_thread.join(timeout=120)
    committed = sorted(e.manifest.step for e in old.remote.scan() if e.manifest is not None)
    assert committed == [4]
    assert "another live process" not in caplog.text


def test_a_close_nested_in_a_signal_handler_that_gave_up_on_uploads_ends_the_outer_close(
    tmp_path, s3_remote, monkeypatch
):
    """close() (no timeout) waits for uploads; a user's signal handler calls close(timeout=0)
    in the same thread (the close lock is reentrant): that nested close gives up on the
    uploads and stops the upload thread, which then ends its attempt under way and leaves the
    rest queued. The outer close waited on for ever: the stopped thread shows no failure and
    no stall. Now it ends, nothing being left to wait for, and adds no second end record."""
    import os
    import signal

    from resilient_callbacks import history

    url, options = s3_remote
    local = tmp_path / "local"
    ck = Checkpointer(local, remote=url, remote_options=options, preemption=False)
    assert ck._dir.sync is not None
    thread = ck._dir.sync._thread
    fs = ck.remote.fs
    orig = fs.put
    inside, go, waiting, nested, done = (threading.Event() for _ in range(5))

    def held(*a, **k):
        if threading.current_thread() is thread:
            inside.set()
            go.wait(120)
        return orig(*a, **k)

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "to upload to" in record.getMessage():
                waiting.set()

    def handler(signum, frame):
        if nested.is_set():  # (the watchdog's: the outer close still waits)
            raise AssertionError("the outer close() still waits after the nested one ended")
        nested.set()
        ck.close(timeout=0.0)  # gives up on the uploads
        go.set()  # the attempt under way ends; the stopped thread leaves step 2 queued

    def watchdog() -> None:
        if waiting.wait(120):
            os.kill(os.getpid(), signal.SIGUSR2)
            if not done.wait(120):
                os.kill(os.getpid(), signal.SIGUSR2)

    monkeypatch.setattr(fs, "put", held)
    said = Said()
    logging.getLogger("resilient_callbacks").addHandler(said)
    previous = signal.signal(signal.SIGUSR2, handler)
    dog = threading.Thread(target=watchdog, daemon=True)
    try:
        ck.save(1, _state(1))
        assert inside.wait(60)
        ck.save(2, _state(2))
        ck.flush()
        dog.start()
        ck.close()  # (no error raised: the nested close had a timeout)
        done.set()
    finally:
        done.set()
        go.set()
        signal.signal(signal.SIGUSR2, previous)
        logging.getLogger("resilient_callbacks").removeHandler(said)
    dog.join(timeout=120)
    thread.join(timeout=120)
    assert nested.is_set() and ck._released and not ck._dir.lock.held
    events = [r["event"] for r in history.records(str(local)) if r["event"] in ("end", "failed")]
    assert events == ["end"], events
