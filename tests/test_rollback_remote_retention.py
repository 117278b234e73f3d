"""The remote retention after a roll-back (``resume=`` an older checkpoint): the remote copy
of the checkpoint a process restored from stays until the process's first commit, as its
local copy does (docs/guide.md, "Retention")."""

from __future__ import annotations

import os
import shutil

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
