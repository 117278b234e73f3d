"""Retention's deletions run off the save path (trash.py): a save's persist does not wait for
the filesystem to free an older checkpoint's files, the removed checkpoint is out of sight at
once, close() leaves nothing behind, and a preempted close does not wait for it."""

from __future__ import annotations

import logging
import re
import shutil
import threading
import types

import torch

from resilient_callbacks import Checkpointer, trash
from resilient_callbacks.catalog import Depth, scan


class BlockedDeletes:
    """Stands in for ``shutil`` in trash.py: every rmtree waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []

    def rmtree(self, path, ignore_errors=False):
        self.started.append(path)
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
        assert len(_trashed(root)) == 1 and blocked.started  # out of sight, being deleted
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


def test_an_abandoned_bin_does_not_wait_and_close_says_what_is_left(tmp_path, monkeypatch, caplog):
    blocked = BlockedDeletes()
    monkeypatch.setattr(trash, "shutil", types.SimpleNamespace(rmtree=blocked.rmtree))
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep_last=1, preemption=False, async_save=False)
    try:
        ck.save(1, {"w": torch.zeros(10)})
        ck.save(2, {"w": torch.ones(10)})
        assert ck._dir.trash.pending == 1
        assert not ck._dir.trash.wait(0.01)
        ck._dir.trash.abandon()  # what the preemption exit does before close()
        with caplog.at_level(logging.INFO, logger="resilient_callbacks"):
            ck.close()  # returns although the delete is still blocked
        said = [r for r in caplog.records if "still being deleted" in r.getMessage()]
        assert len(said) == 1 and ".trash-" in said[0].getMessage()
        # expected at every preemption exit (its restart sweeps the rest): no warning, and no
        # "after 0.0 s" of a wait that was never made
        assert said[0].levelno == logging.INFO, said[0].getMessage()
        assert "as the preempted process exits" in said[0].getMessage()
        assert len(_trashed(root)) == 1
    finally:
        blocked.release.set()
    # the next writer sweeps what was left
    with Checkpointer(str(root), keep_last=1, preemption=False):
        pass
    assert _trashed(root) == []


def test_a_close_whose_timeout_cuts_the_deletes_short_warns(tmp_path, monkeypatch, caplog):
    """close(timeout) of a run that may not come back: hidden copies stay on the disk until
    another writer opens the directory, which is worth a warning."""
    blocked = BlockedDeletes()
    monkeypatch.setattr(trash, "shutil", types.SimpleNamespace(rmtree=blocked.rmtree))
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep_last=1, preemption=False, async_save=False)
    try:
        ck.save(1, {"w": torch.zeros(10)})
        ck.save(2, {"w": torch.ones(10)})
        with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
            ck.close(timeout=0.05)
        said = [r for r in caplog.records if "still being deleted" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert re.search(r"deleted after \d+\.\d s;", said[0].getMessage()), said[0].getMessage()
    finally:
        blocked.release.set()
