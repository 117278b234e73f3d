"""``resilient-ckpt`` pointed at a directory of another tool's checkpoints (``torch.save``,
the HF Trainer's ``checkpoint-<n>`` folders, Lightning's ``.ckpt``): "no checkpoints" alone
read as if the files were not there, or unreadable; it now says they are another tool's."""

from __future__ import annotations

import os

import pytest
import torch

from test_cli import cli, make_run


@pytest.mark.parametrize("command", ["ls", "verify", "inspect", "gc"])
def test_a_directory_of_another_tools_checkpoints_is_named_as_such(tmp_path, command):
    """Each said only "no checkpoints in DIR" of a directory holding ``model.pt`` and a
    Trainer's ``checkpoint-100/pytorch_model.bin``."""
    other = tmp_path / "other"
    (other / "checkpoint-100").mkdir(parents=True)
    sd = torch.nn.Linear(2, 2).state_dict()
    torch.save(sd, other / "model.pt")
    torch.save(sd, other / "checkpoint-100" / "pytorch_model.bin")
    r = cli(command, str(other))
    said = r.stdout + r.stderr
    assert "it holds files another tool saved" in said, said
    assert "checkpoint-100/pytorch_model.bin" in said and "model.pt" in said, said
    assert r.returncode == (0 if command in ("ls", "gc") else 3), said  # nothing to act on
    assert sorted(os.listdir(other)) == ["checkpoint-100", "model.pt"]  # gc deleted nothing


def test_our_own_leftovers_are_not_called_another_tools(tmp_path):
    """A directory of ours whose checkpoints are all gone but its blobs, or a folder of ours
    without its manifest: no note about another tool."""
    root = tmp_path / "ck"
    make_run(str(root))
    for name in os.listdir(root):
        if name.startswith("step_"):
            os.remove(root / name / "manifest.json")
    r = cli("verify", str(root))
    assert "another tool" not in r.stdout + r.stderr, r.stderr


def test_gc_in_a_hugging_face_cache_folder_takes_no_lock_and_says_it_holds_nothing(tmp_path):
    """A ``blobs`` folder made gc take the directory for one of ours (an incremental run's):
    in a Hugging Face cache folder (``blobs/<sha>``, ``snapshots/``) it wrote its ``.lock``
    there and printed "0 deleted, 0 kept" of a directory it has no business in."""
    hub = tmp_path / "models--gpt2"
    (hub / "blobs").mkdir(parents=True)
    (hub / "snapshots" / "abc").mkdir(parents=True)
    (hub / "blobs" / ("0123456789abcdef" * 2 + "01234567")).write_text("{}")
    before = sorted(p.name for p in hub.rglob("*"))
    r = cli("gc", str(hub))
    assert r.returncode == 0 and "nothing to delete: no checkpoints in" in r.stdout, r.stdout
    assert sorted(p.name for p in hub.rglob("*")) == before  # no .lock, nothing deleted


def test_gc_still_collects_the_blobs_of_ours_when_no_checkpoint_is_left(tmp_path):
    """The other side of the test above: an incremental run's ``blobs`` with every checkpoint
    gone are ours, and gc deletes them."""
    import shutil

    from resilient_callbacks import Checkpointer

    root = tmp_path / "ck"
    state = {"model": torch.nn.Linear(128, 64)}  # 32 KiB of weight: stored as a blob
    with Checkpointer(str(root), incremental=True) as ck:
        ck.save(10, state)
    assert os.listdir(root / "blobs")
    shutil.rmtree(root / "step_000000010")
    r = cli("gc", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.listdir(root / "blobs") == [], r.stdout
