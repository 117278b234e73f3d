"""Retention's deletions run off the save path (trash.py): a save's persist does not wait for
the filesystem to free an older checkpoint's files, the removed checkpoint is out of sight at
once, close() leaves nothing behind, and a preempted close does not wait for it."""

from __future__ import annotations

import logging
import re
import shutil
import threading
import types

import pytest
import torch

from resilient_callbacks import Checkpointer, trash
from resilient_callbacks.catalog import Depth, scan


class BlockedDeletes:
    """Stands in for ``shutil`` in trash.py: every rmtree waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()  # a delete began (on the trash bin's own thread)

    def rmtree(self, path, ignore_errors=False):
        self.entered.set()
        self.release.wait()
        shutil.rmtree(path, ignore_errors=ignore_errors)


def _trashed(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".trash-"))


def test_a_save_does_not_wait_for_retention_to_delete_files(tmp_path, monkeypatch):
    blocked = BlockedDeletes()
    monkeypatch.setattr(trash, "shutil", types.SimpleNamespace(rmtree=blocked.rmtree))
    root = tmp_path / "ck"
    state = {"w": torch.randn(1000)}
    ck = Checkpointer(str(root), keep_last=1, preemption=False)
    try:
        ck.save(1, state)
        ck.flush()
        ck.save(2, state)
        done = threading.Event()
        flusher = threading.Thread(target=lambda: (ck.flush(), done.set()), daemon=True)
        flusher.start()
        # With deletion inside the persist, flush() would wait for the blocked delete forever.
        assert done.wait(120), "the save waited for retention's delete"
        assert [e.name for e in scan(str(root), Depth.SIZE) if e.manifest] == ["step_000000002"]
        # out of sight, and being deleted once the trash bin's thread runs (not necessarily
        # before flush() returns: a loaded machine can run it later)
        assert len(_trashed(root)) == 1 and blocked.entered.wait(60)
    finally:
        blocked.release.set()
        ck.close()
    assert _trashed(root) == []  # close() waited for it
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_000000002"
    ]


def test_close_leaves_no_trash_behind(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(str(root), keep_last=2, preemption=False) as ck:
        for step in range(1, 6):
            ck.save(step, {"w": torch.full((100,), float(step))})
    assert _trashed(root) == []
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_000000004",
        "step_000000005",
    ]


@pytest.mark.parametrize("how", ["preempted", pytest.param("timeout", marks=pytest.mark.slow)])
def test_close_says_what_deletions_it_did_not_wait_for(tmp_path, monkeypatch, caplog, how):
    """A preempted process does not wait for the deletions (its restart sweeps the rest): said
    at INFO, not warned 'after 0.0 s' at every preemption. A close(timeout) that cuts them short
    leaves hidden copies on the disk of a run that may not come back: a warning."""
    blocked = BlockedDeletes()
    monkeypatch.setattr(trash, "shutil", types.SimpleNamespace(rmtree=blocked.rmtree))
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep_last=1, preemption=False, async_save=False)
    try:
        ck.save(1, {"w": torch.zeros(10)})
        ck.save(2, {"w": torch.ones(10)})
        assert ck._dir.trash.pending == 1
        assert not ck._dir.trash.wait(0.01)
        with caplog.at_level(logging.INFO, logger="resilient_callbacks"):
            if how == "preempted":
                ck._dir.trash.abandon()  # what the preemption exit does before close()
                ck.close()  # returns although the delete is still blocked
            else:
                ck.close(timeout=0.05)
        said = [r for r in caplog.records if "still being deleted" in r.getMessage()]
        assert len(said) == 1 and ".trash-" in said[0].getMessage()
        msg = said[0].getMessage()
        if how == "preempted":
            assert said[0].levelno == logging.INFO and "as the preempted process exits" in msg
        else:
            assert said[0].levelno == logging.WARNING
            assert re.search(r"deleted after \d+\.\d s;", msg), msg
        assert len(_trashed(root)) == 1
    finally:
        blocked.release.set()
    # the next writer sweeps what was left
    with Checkpointer(str(root), keep_last=1, preemption=False):
        pass
    assert _trashed(root) == []


def test_a_directory_put_after_the_bin_stopped_is_deleted_without_a_new_thread(tmp_path):
    """An upload thread's retention that outlived its Checkpointer's close (an upload attempt
    longer than close's 1 s join, a dropped Checkpointer's, not joined) put a directory into a
    bin already stopped: a new rc-trash thread started, which nothing stopped (one per such
    run, found 2026-12-07). Now it is deleted in the caller's thread."""
    bin_ = trash.TrashBin()
    first = tmp_path / "first"
    first.mkdir()
    bin_.put(str(first))
    assert bin_.wait(timeout=60)
    bin_.stop()
    before = {t for t in threading.enumerate() if t.name == "rc-trash"}
    late = tmp_path / "late"
    (late / "sub").mkdir(parents=True)
    bin_.put(str(late))
    assert {t for t in threading.enumerate() if t.name == "rc-trash" and t.is_alive()} <= before
    assert not late.exists()
    assert bin_.pending == 0


def test_a_directory_put_while_the_bin_stops_is_deleted(tmp_path, monkeypatch):
    """``put`` took the worker under the bin's lock and submitted to it after releasing the lock:
    a ``stop()`` in between (close's, as an upload thread's retention put a directory) queued
    the worker's end first, so the directory was never deleted (a hidden copy the size of a
    checkpoint left until the next writer's sweep) and ``pending`` never came back to 0. Now a
    directory put while the bin stops is deleted, by the worker or in the caller's thread."""
    submitting, stopped = threading.Event(), threading.Event()

    made: list[trash.BackgroundPersister] = []

    class Gated(trash.BackgroundPersister):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

        def submit(self, job, always=False):
            submitting.set()
            stopped.wait(timeout=1.0)  # (a stop() that waits for put's lock: not before then)
            super().submit(job, always)

        def stop(self, join_s=5.0):
            stopped.set()
            super().stop(join_s)

    monkeypatch.setattr(trash, "BackgroundPersister", Gated)
    bin_ = trash.TrashBin()
    late = tmp_path / "late"
    (late / "sub").mkdir(parents=True)
    putter = threading.Thread(target=bin_.put, args=(str(late),))
    putter.start()
    assert submitting.wait(60)
    stopper = threading.Thread(target=bin_.stop)
    stopper.start()
    putter.join(timeout=60)
    stopper.join(timeout=60)
    assert not putter.is_alive() and not stopper.is_alive()
    for w in made:  # (the worker ends once what it was given is deleted)
        w._thread.join(timeout=60)
        assert not w._thread.is_alive()
    assert not late.exists()
    assert bin_.pending == 0
