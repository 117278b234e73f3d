"""The directory's ``.lock`` deleted by hand while a writer is live (a cleanup script, ``rm -rf
dir/.*``): a second writer could open the directory beside the first, and both saved, numbered
commits and applied retention over each other's checkpoints."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from resilient_callbacks import Checkpointer, CheckpointLockedError, CheckpointWriteError


def _state(v: float) -> dict:
    return {"w": torch.full((10,), v)}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_writer_whose_lock_file_was_deleted_stops_beside_a_second_writer(
    tmp_path, caplog, async_save
):
    root = tmp_path / "ck"
    a = Checkpointer(root, keep_last=1, async_save=async_save, preemption=False)
    try:
        a.save(1, _state(1.0))
        a.flush()
        os.unlink(root / ".lock")
        b = Checkpointer(root, keep_last=1, resume="never", preemption=False)  # opens: no lock
        try:
            with pytest.raises(CheckpointWriteError) as ei:
                a.save(2, _state(2.0))
                a.flush()
            said = str(ei.value)
            assert "was deleted or replaced while this writer held it" in said, said
            assert [e.step for e in a.checkpoints()] == [1]
            assert not [n for n in os.listdir(root) if n.startswith(".staging")]
        finally:
            b.close()
        # the other writer is gone: this one takes the directory again and saves
        caplog.set_level(logging.WARNING, logger="resilient_callbacks")
        a.save(3, _state(3.0))
        a.flush()
        assert any("locked it again" in r.getMessage() for r in caplog.records)
        assert 3 in [e.step for e in a.checkpoints()]
        with pytest.raises(CheckpointLockedError):  # and holds its lock: no third writer
            Checkpointer(root, keep_last=1, preemption=False)
    finally:
        a.close()
