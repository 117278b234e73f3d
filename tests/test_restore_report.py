"""``Checkpointer.last_restore``: what restore() loaded (path, step, tier) and what it skipped,
for the adapters' resume message (they used to parse the core's log records)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from resilient_callbacks import Checkpointer, ResumeFallbackWarning


def test_report_names_the_checkpoint_the_tier_and_what_was_skipped(tmp_path):
    state = {"w": torch.zeros(4)}
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(5, state)
        state["w"] += 1
        ck.save(10, state)
        newest = ck.last_save.path
    data = Path(newest) / "shared.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # a flipped byte in the tensor data
    data.write_bytes(bytes(raw))

    with Checkpointer(tmp_path / "ck") as ck, pytest.warns(ResumeFallbackWarning):
        assert ck.restore({"w": torch.empty(4)}) == 5
        rep = ck.last_restore
    assert rep is not None
    assert (rep.step, rep.tier, rep.remote_url) == (5, "local", None)
    assert rep.path == ck.restored_from and rep.path.endswith("step_000000005")
    (skipped,) = rep.skipped
    assert skipped.startswith(f"{newest} (step 10): ")
    said = rep.describe("epoch 0")
    assert said.startswith(f"resumed at step 5 (epoch 0) from {rep.path} (local copy)")
    assert "skipped newer checkpoint(s): " + skipped in said


def test_a_restore_that_skipped_a_damaged_blob_says_which_checkpoint_it_loaded(tmp_path, caplog):
    """A plain loop saw only "falling back to an older checkpoint" for each skipped one, and
    nothing named the checkpoint it went on from (the adapters said it; a loop had nothing)."""
    state = {"w": torch.zeros(8192)}  # 32 KiB: a blob
    with Checkpointer(tmp_path / "ck", async_save=False, incremental=True) as ck:
        ck.save(5, state)
        state["w"] += 1
        ck.save(10, state)
        newest = Path(ck.last_save.path)
    (blob,) = [
        b
        for b in (tmp_path / "ck" / "blobs").iterdir()
        if b.name in newest.joinpath("shared.json").read_text()
    ]
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF
    blob.write_bytes(bytes(raw))

    logs = caplog.at_level(logging.WARNING, logger="resilient_callbacks")
    with logs, Checkpointer(tmp_path / "ck") as ck, pytest.warns(ResumeFallbackWarning) as w:
        assert ck.restore({"w": torch.empty(8192)}) == 5
    assert blob.name in str(w[0].message) and str(newest) in str(w[0].message)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed at")]
    assert said == [
        f"resumed at step 5 from {ck.restored_from} (local copy) instead of the 1 newer "
        "checkpoint(s) skipped as said above (step_000000010): the steps after 5 are trained "
        "again"
    ]


def test_no_checkpoint_no_report(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore({"w": torch.empty(4)}) == 0
        assert ck.last_restore is None


def test_the_remote_url_is_whole_on_a_rank_that_does_not_talk_to_the_remote():
    """Only the coordinator opens the remote store; the other ranks' ``last_restore``
    said ``remote_url='step_000000005'`` (the name alone) where rank 0's said the URL."""
    from types import SimpleNamespace

    from resilient_callbacks import restore_remote

    ck = SimpleNamespace(
        _dir=SimpleNamespace(remote=None),
        config=SimpleNamespace(remote="s3://user:pw@bucket/run1/"),
    )
    c = SimpleNamespace(remote="step_000000005")
    assert restore_remote.url_of(ck, c) == "s3://***@bucket/run1/step_000000005"
