"""The hand-over of a store between two writers of one process (upload_thread.UploadThread:
the next writer's thread waits for the stopped thread of the previous one), as close() sees
that wait: how long no byte has moved (``_waited_stall_s``), and its bound without a close()
(the outage limit). Real threads; a store in this process that hangs (GatedFS) for the last."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import torch

from resilient_callbacks.progress import Progress
from resilient_callbacks.upload_thread import UploadThread
from test_remote_backends import GatedFS, gated  # noqa: F401 (the fixture: a store that hangs)

TIMEOUT_S = 60.0


@pytest.fixture(autouse=True)
def _looks_often(monkeypatch):
    """The next writer looks at the previous attempt (1 s apart by default) 20 times a second,
    close() at its uploads too, and stop()'s join of an attempt held by the test is short:
    what ends the waits here is an event or an outage limit set to 0 or 0.5 s."""
    from resilient_callbacks import upload_thread, upload_wait

    monkeypatch.setattr(upload_thread, "HANDOVER_LOOK_S", 0.05)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)
    monkeypatch.setattr(upload_thread, "STOP_JOIN_S", 0.1)


class Writer(UploadThread):
    """An upload thread: waits for the previous writer's, then (once ``go`` is set) uploads
    10 bytes and goes on with work that moves none (a delete, a commit) until ``end``."""

    def __init__(self, key: str, url: str = "memory://handover") -> None:
        super().__init__(f"rc-test-{key[-6:]}")
        self.url = url
        self.go, self.moved, self.end = threading.Event(), threading.Event(), threading.Event()
        self.past_wait = threading.Event()
        self._after_previous(key)
        self._start()

    def _run(self) -> None:
        if not self._wait_previous(self.url):
            return
        self.past_wait.set()
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


@pytest.mark.usefixtures("gated")
def test_the_next_writer_gives_up_on_a_previous_attempt_that_hangs_and_uploads_its_own(
    tmp_path, caplog, monkeypatch
):
    """Without a close() of its own, the next writer of a store waited for ever for a stopped
    previous writer's attempt that hung (a store that stopped answering it), saying so in an
    INFO line: none of its checkpoints went up for the rest of the process. It now gives up
    after the outage limit (set low here: the attempt really hangs until the test lets it go),
    says so in a warning, uploads what was queued meanwhile, and the previous attempt, once
    its request returns, commits nothing (the store is the next writer's)."""
    from resilient_callbacks import Checkpointer, upload_thread
    from resilient_callbacks.remote import RemoteStore

    monkeypatch.setattr(upload_thread, "HANDOVER_OUTAGE_S", 0.5)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    url = f"rcgate://rc-{uuid.uuid4().hex[:10]}/run"
    opts = {"remote": url, "remote_keep_last": 2, "keep_last": 2, "async_save": False}
    old = Checkpointer(tmp_path / "old", **opts)
    GatedFS.held = "/step_000000001/"  # (its upload hangs)
    old.save(1, {"w": torch.ones(8)})
    assert GatedFS.inside.wait(TIMEOUT_S)
    old_thread = old._dir.sync._thread
    old.close(timeout=0.2)  # (gives up on it, said: the attempt goes on in its thread)
    new = Checkpointer(tmp_path / "new", **opts)
    try:
        new.save(2, {"w": torch.full((8,), 2.0)})
        assert new._dir.sync.wait(TIMEOUT_S), "the next writer never uploaded"
        assert old_thread.is_alive()  # (still hung: given up on, not ended)
        said = [r for r in caplog.records if "stops waiting for it" in r.getMessage()]
        assert said and said[0].levelno == logging.WARNING, said
        assert old_thread.name in said[0].getMessage()
        # which writer's thread it was: every shared-mode upload thread was named "rc-upload"
        assert old_thread.name != new._dir.sync._thread.name
        assert f"({tmp_path / 'old'}; its close() gave up" in said[0].getMessage()
        GatedFS.go.set()  # the old attempt's request returns: it must not commit step 1
        old_thread.join(TIMEOUT_S)
        assert not old_thread.is_alive()
        committed = sorted(e.name for e in RemoteStore(url).scan() if e.problem is None)
        assert committed == ["step_000000002"], committed
        # its refused commit is no failure "retrying with backoff" (it never retries): INFO
        ended = [r for r in caplog.records if "uploading step_000000001 failed" in r.getMessage()]
        assert not ended, [r.getMessage() for r in ended]
        assert any("close() gave up on ended" in r.getMessage() for r in caplog.records)
    finally:
        GatedFS.go.set()
        new.close()


def test_an_upload_counts_the_bytes_of_the_blobs_it_puts(tmp_path):
    """An incremental checkpoint's tensors go up as blobs, put with no progress: an upload of
    mostly blobs counted only its small files, so one of more than the outage limit read as
    a stalled store (to close() and to the next writer's hand-over wait). The blobs' bytes
    now count, the total grown by them."""
    from resilient_callbacks import Checkpointer
    from resilient_callbacks.manifest import read_manifest
    from resilient_callbacks.remote import RemoteStore

    with Checkpointer(tmp_path / "local", incremental=True, async_save=False) as ck:
        ck.save(1, {"w": torch.ones(65536)})  # (256 KiB, a blob)
    local = str(tmp_path / "local" / "step_000000001")
    m = read_manifest(local)
    assert m.blob_bytes > m.total_bytes  # (mostly blobs)
    progress = Progress(m.total_bytes, "test upload", bar=False)
    store = RemoteStore(f"memory://b-{uuid.uuid4().hex}")  # (a store that counts put bytes)
    store.upload(local, m, "step_000000001", progress)
    assert progress.done >= m.total_bytes + m.blob_bytes, (progress.done, m.blob_bytes)
    assert progress.total >= m.total_bytes + m.blob_bytes


def test_a_previous_attempt_given_up_on_is_not_waited_for_again_by_a_later_writer(monkeypatch):
    """Once a writer gave up on a hung attempt of the previous one (fenced: it commits and
    deletes nothing more), each later writer of the store in that process waited for that
    same attempt again, the outage limit each time (5 minutes of no upload), and warned
    again. A later writer now goes on at once."""
    from resilient_callbacks import upload_thread

    key = f"memory://handover-{uuid.uuid4().hex}"
    monkeypatch.setattr(upload_thread, "HANDOVER_OUTAGE_S", 0.0)  # (given up at once)
    hung = Writer(key)  # (never goes on: an attempt hung in its store)
    hung.stop(join_s=0)
    writers = [hung]
    try:
        nxt = Writer(key)
        writers.append(nxt)
        assert nxt.past_wait.wait(TIMEOUT_S), "the next writer never gave up waiting"
        assert hung._thread in upload_thread._superseded
        nxt.go.set()
        nxt.end.set()
        nxt._thread.join(TIMEOUT_S)
        assert not nxt._thread.is_alive()
        monkeypatch.setattr(upload_thread, "HANDOVER_OUTAGE_S", 3600.0)
        later = Writer(key)  # (before: waited for the hung attempt for an hour)
        writers.append(later)
        # (the hung one ends at TIMEOUT_S: this wait ends first)
        assert later.past_wait.wait(TIMEOUT_S / 2), "a later writer waited for a fenced attempt"
    finally:
        for w in writers:
            w.stop(join_s=0)
            w.go.set()
            w.end.set()
        for w in writers:
            w._thread.join(TIMEOUT_S)
    assert not any(w._thread.is_alive() for w in writers)


def test_a_previous_copy_into_a_local_store_is_waited_for_past_the_outage_limit(
    tmp_path, monkeypatch, caplog
):
    """A copy of the previous writer into a local store that moves no byte (hung in the file
    system; before, also a long copy: fsspec's local put counted no byte until it ended) read
    as hung after the outage limit, and the next writer gave up on it and copied into the same
    folder while it went on (two writers of one folder: a file torn). For a local store the
    next writer now keeps waiting, said once in a warning."""
    from resilient_callbacks import upload_thread

    caplog.set_level(logging.INFO, "resilient_callbacks")
    url = f"file://{tmp_path}/store"
    key = f"{url}-{uuid.uuid4().hex}"
    monkeypatch.setattr(upload_thread, "HANDOVER_OUTAGE_S", 0.0)  # (past it at once)
    slow = Writer(key, url)  # (a copy that moves no counted byte until the test lets it go)
    slow.stop(join_s=0)
    nxt = Writer(key, url)
    try:
        _until(
            lambda: any("keeps waiting for it" in r.getMessage() for r in caplog.records),
            "the next writer never said it keeps waiting",
        )
        assert not nxt.past_wait.is_set(), "the next writer stopped waiting for a local copy"
        assert slow._thread not in upload_thread._superseded
        slow.go.set()
        slow.end.set()
        assert nxt.past_wait.wait(TIMEOUT_S), "the next writer never went on"
        said = [r for r in caplog.records if "keeps waiting for it" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
    finally:
        for w in (slow, nxt):
            w.stop(join_s=0)
            w.go.set()
            w.end.set()
        for w in (slow, nxt):
            w._thread.join(TIMEOUT_S)
    assert not slow._thread.is_alive() and not nxt._thread.is_alive()
