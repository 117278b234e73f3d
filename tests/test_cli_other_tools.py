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
    assert r.returncode == (0 if command in ("ls", "gc") else 1), said
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
