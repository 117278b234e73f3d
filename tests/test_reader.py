"""reader.py: the one selection of the newest valid checkpoint, and opening it verified."""

from __future__ import annotations

import os

import pytest
import torch

from resilient_callbacks import Checkpointer, reader
from resilient_callbacks.catalog import Depth
from resilient_callbacks.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    NoValidCheckpointError,
)
from test_cli import flip_byte


def make_run(root: str, steps=(10, 20, 30)) -> dict[int, torch.Tensor]:
    """Checkpoints of ``steps``; the model weight saved at each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    saved = {}
    with Checkpointer(root) as ck:
        for s in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(s, {"model": model})
            saved[s] = model.weight.detach().clone()
    return saved


def ckpt(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:09d}")


def shared_tensors(root: str, step: int) -> str:
    return os.path.join(ckpt(root, step), "shared.safetensors")


def test_newest_valid_is_chosen_and_opened(tmp_path):
    root = str(tmp_path / "ck")
    saved = make_run(root)
    sel = reader.select(root)
    assert sel.step == 30 and sel.name == "step_000000030" and sel.skipped == ()
    assert sel.manifest.step == 30
    opened = reader.open_checkpoint(sel.path)
    assert opened.manifest.step == 30
    assert os.path.isabs(opened.path)
    # the part read back holds the weight saved at step 30
    assert any(torch.equal(t, saved[30]) for t in opened.part.tensors.values())


def test_a_corrupt_newest_is_skipped_with_the_reason(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    flip_byte(shared_tensors(root, 30))
    sel = reader.select(root)
    assert sel.step == 20
    assert [e.name for e in sel.skipped] == ["step_000000030"]
    assert "shared.safetensors" in (sel.skipped[0].problem or "")
    # a check of sizes alone cannot see a flipped byte: it keeps the newest
    assert reader.select(root, depth=Depth.SIZE).step == 30


def test_an_unreadable_manifest_newer_than_the_chosen_is_reported(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    with open(os.path.join(ckpt(root, 30), "manifest.json"), "w") as f:
        f.write("{not json")
    sel = reader.select(root)
    assert sel.step == 20
    assert [e.name for e in sel.skipped] == ["step_000000030"]
    assert sel.skipped[0].problem


def test_an_explicit_step_that_is_corrupt_raises_instead_of_falling_back(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    flip_byte(shared_tensors(root, 20))
    with pytest.raises(CheckpointCorruptError, match=r"step_000000020.*corrupt"):
        reader.select(root, step=20)
    assert reader.select(root, step=10).step == 10
    # one checkpoint given as the directory: also never a fallback
    with pytest.raises(CheckpointCorruptError):
        reader.select(ckpt(root, 20))
    assert reader.select(ckpt(root, 30)).step == 30


def test_an_explicit_step_that_is_missing_names_the_steps_there_are(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint of step 99 .*10, 20, 30"):
        reader.select(root, step=99)


def test_an_empty_or_missing_directory_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no checkpoints in"):
        reader.select(empty)
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        reader.select(tmp_path / "nowhere")


def test_no_valid_checkpoint_lists_each_with_why(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, steps=(1, 2))
    for s in (1, 2):
        flip_byte(shared_tensors(root, s))
    with pytest.raises(NoValidCheckpointError) as info:
        reader.select(root)
    msg = str(info.value)
    assert "all 2 are corrupt" in msg
    assert "step_000000001 (step 1)" in msg and "step_000000002 (step 2)" in msg


def test_open_checkpoint_verifies_what_it_reads(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, steps=(1,))
    flip_byte(shared_tensors(root, 1))
    with pytest.raises(CheckpointCorruptError):
        reader.open_checkpoint(ckpt(root, 1))
