"""The hand-over of a store between two writers of one process (upload_thread.UploadThread:
the next writer's thread waits for the stopped thread of the previous one), as close() sees
that wait: how long no byte has moved (``_waited_stall_s``). Real threads, no store needed."""

from __future__ import annotations

import threading
import time
import uuid

from resilient_callbacks.progress import Progress
from resilient_callbacks.upload_thread import UploadThread

TIMEOUT_S = 60.0


class Writer(UploadThread):
    """An upload thread: waits for the previous writer's, then (once ``go`` is set) uploads
    10 bytes and goes on with work that moves none (a delete, a commit) until ``end``."""

    def __init__(self, key: str) -> None:
        super().__init__(f"rc-test-{key[-6:]}")
        self.go, self.moved, self.end = threading.Event(), threading.Event(), threading.Event()
        self._after_previous(key)
        self._start()

    def _run(self) -> None:
        if not self._wait_previous("memory://handover"):
            return
        if not self.go.wait(TIMEOUT_S):
            return
        with self._transfer(Progress(10, "test upload", bar=False)) as p:
            p.update(10)
        self.moved.set()
        self.end.wait(TIMEOUT_S)  # (a request that moves no byte)


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_next_writers_wait_is_no_stall_while_the_previous_one_moved_bytes():
    """The wait's stall (what close() gives up on) counted from the start of the wait unless
    the previous writer's transfer was under way at that moment: one that had just uploaded
    for an hour and gone on to its deletes or its commit was a stall of an hour, so the next
    writer's close() gave up at once on uploads nothing held back. A transfer's last byte now
    counts also once the transfer ended."""
    key = f"memory://handover-{uuid.uuid4().hex}"
    prev = Writer(key)
    try:
        prev.stop(join_s=0)  # (its close() gave up on it: it finishes its attempt)
        nxt = Writer(key)
        try:
            _until(lambda: nxt._waiting_since is not None, "the next writer never waited")
            nxt._waiting_since -= 3600.0  # (the wait began an hour ago)
            assert nxt._waited_stall_s() >= 3600.0  # (nothing moved since)
            prev.go.set()
            assert prev.moved.wait(TIMEOUT_S)  # its upload ended; a delete under way now
            assert nxt._waited_stall_s() < 1800.0, "a byte moved just now"
        finally:
            nxt.stop(join_s=0)
    finally:
        prev.go.set()
        prev.end.set()
        prev._thread.join(TIMEOUT_S)
    nxt._thread.join(TIMEOUT_S)
    assert not prev._thread.is_alive() and not nxt._thread.is_alive()
