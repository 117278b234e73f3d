"""``Checkpointer.last_restore``: what restore() loaded (path, step, tier) and what it skipped,
for the adapters' resume message (they used to parse the core's log records)."""

from __future__ import annotations

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
