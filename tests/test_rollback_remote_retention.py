"""The remote retention after a roll-back (``resume=`` an older checkpoint): the remote copy
of the checkpoint a process restored from stays until the process's first commit, as its
local copy does (docs/guide.md, "Retention")."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from resilient_callbacks import Checkpointer


@pytest.mark.parametrize("local_copy", [True, False], ids=["local-copy", "remote-only"])
def test_the_remote_copy_restored_from_stays_until_the_first_commit(tmp_path, local_copy):
    """Steps 1-3 uploaded, 4 and 5 saved without the remote (local only); a roll-back to 1
    (from its local copy, or from the remote one where the directory lost it) with
    keep_last=1: the restore queues 5 for upload, and the remote retention after it deleted
    the remote copy of 1 (only the abandoned 5 counted, no commit had recorded the roll-back
    yet): the state the run went back to was no longer durable. It stays until the first
    commit, and then goes under keep_last as any other."""
    root, remote = tmp_path / "ck", tmp_path / "remote"
    url = f"file://{remote}"
    model = torch.nn.Linear(2, 2)
    with Checkpointer(root, remote=url, keep_last=None, preemption=False) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"m": model})
    with Checkpointer(root, keep_last=None, preemption=False) as ck:  # not uploaded
        assert ck.restore({"m": model}) == 3
        for step in (4, 5):
            ck.save(step, {"m": model})
    if not local_copy:
        shutil.rmtree(root / "step_000000001")
    ck = Checkpointer(root, keep_last=1, remote=url, resume=1, preemption=False)
    try:
        assert ck.restore({"m": model}) == 1
        assert ck._dir.sync is not None and ck._dir.sync.wait(60)  # 5, and its retention
        assert (remote / "step_000000001" / "manifest.json").exists(), sorted(os.listdir(remote))
        assert (root / "step_000000001").is_dir()
        ck.save(2, {"m": model})  # the new branch's first commit
        ck.flush()
        assert ck._dir.sync.wait(60)
    finally:
        ck.close()
    kept = sorted(n for n in os.listdir(remote) if n.startswith("step_"))
    assert len(kept) == 1 and kept[0].startswith("step_000000002"), kept


def test_the_remote_copy_restored_from_stays_until_the_new_branch_is_uploaded(tmp_path):
    """A roll-back to 1 with keep_last=1 while the abandoned 5's upload (queued by the
    restore) is under way: the new branch's first save (2) commits locally, then 5's upload
    ends. The remote retention after it deleted the remote copy of 1 (the protection had
    ended at 2's local commit, and 2 was not on the remote yet): until 2's upload, the remote
    held only the abandoned 5, and a node lost then resumed that timeline. 1 stays until a
    checkpoint of the new branch is committed remotely."""
    root, remote = tmp_path / "ck", tmp_path / "remote"
    url = f"file://{remote}"
    model = torch.nn.Linear(2, 2)
    with Checkpointer(root, remote=url, keep_last=None, preemption=False) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"m": model})
    with Checkpointer(root, keep_last=None, preemption=False) as ck:  # not uploaded
        assert ck.restore({"m": model}) == 3
        for step in (4, 5):
            ck.save(step, {"m": model})
    ck = Checkpointer(root, keep_last=1, remote=url, resume=1, preemption=False)
    real, started = ck.remote.upload, {5: threading.Event(), 2: threading.Event()}
    gates = {5: threading.Event(), 2: threading.Event()}

    def gated(local_dir, manifest, name, progress=None):
        started[manifest.step].set()
        assert gates[manifest.step].wait(60)
        return real(local_dir, manifest, name, progress)

    ck.remote.upload = gated
    try:
        assert ck.restore({"m": model}) == 1
        assert started[5].wait(60)  # the abandoned 5's upload under way
        ck.save(2, {"m": model})  # the new branch's first commit, local only for now
        ck.flush()
        gates[5].set()
        assert started[2].wait(60)  # 5 uploaded, and the remote retention after it done
        committed = sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))
        assert "step_000000001" in committed, committed
        gates[2].set()
        assert ck._dir.sync is not None and ck._dir.sync.wait(60)
    finally:
        for gate in gates.values():
            gate.set()
        ck.close()
    # 2 uploaded: the lineage now says what to keep (keep_last=1: 2 alone)
    kept = sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))
    assert len(kept) == 1 and kept[0].startswith("step_000000002"), kept
