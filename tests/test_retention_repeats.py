"""A retention failure that persists is said once, not after every save (repeats.py): an old
checkpoint folder that cannot be deleted logged the same ERROR at each save's retention pass,
thousands of lines in a long run."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.repeats import REMIND_EVERY, Repeats


def _undeletable(path) -> object:
    """Makes the checkpoint folder ``path`` one no rename moves, really: a bind mount of it onto
    itself (a mount point: its rename fails with EBUSY), which needs root. A user cannot make a
    folder unrenamable inside a parent it may write: chmod 0555 on the folder does not stop
    retention's rename to ``.trash-*`` beside it (only a rename into another folder needs write
    permission on the folder itself, for its ``..``); it stops the deletion of its files after
    the rename, another failure than this test's. So the test is skipped for a user. Returns the
    function that undoes it."""
    if os.geteuid() != 0:
        pytest.skip("only root can make a folder unrenamable (a bind mount onto itself)")
    r = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"root cannot bind-mount here to make a folder undeletable: {r.stderr}")
    return lambda: subprocess.run(["umount", str(path)], check=True)


def test_an_old_checkpoint_that_cannot_be_deleted_is_an_error_once(tmp_path, caplog):
    """keep_last=1: step 1's folder cannot be deleted; each of the 10 saves after it tried,
    and each logged the same complete ERROR. Now the first is said whole, once; the others
    try again quietly; the checkpoints deletable go as usual."""
    root = tmp_path / "ck"
    old = root / "step_000000001"
    state = {"w": torch.zeros(10)}
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(str(root), keep_last=1, preemption=False) as ck:
        ck.save(1, state)
        ck.flush()
        undo = _undeletable(old)
        try:
            for step in range(2, 12):
                ck.save(step, state)
                ck.flush()
        finally:
            undo()
    said = [
        r
        for r in caplog.records
        if r.levelno == logging.ERROR and "could not delete" in r.getMessage()
    ]
    assert len(said) == 1, [r.getMessage() for r in said]
    msg = said[0].getMessage()
    assert f"could not delete {old}: " in msg and f"rm -r {old}" in msg, msg  # complete
    assert "times in a row" not in msg, msg
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert kept == ["step_000000001", "step_000000011"], kept


def test_the_same_failure_is_said_again_with_another_reason_a_success_or_its_count():
    said = Repeats()
    assert said.due("a", "EACCES") == 1
    assert said.due("a", "EACCES") is None
    assert said.due("b", "EACCES") == 1  # another path
    assert said.due("a", "EBUSY") == 1  # another reason: said again at once
    said.cleared("a")  # deleted once: a later failure is new
    assert said.due("a", "EBUSY") == 1
    counts = [said.due("a", "EBUSY") for _ in range(2 * REMIND_EVERY)]
    assert [n for n in counts if n is not None] == [REMIND_EVERY, 2 * REMIND_EVERY]
