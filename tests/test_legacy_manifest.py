"""Manifests written before they carried their own checksum (older versions of the library):
one damaged is skipped with a fallback to an older checkpoint, loudly, as a damaged current one
is, by restore and by ``resilient-ckpt verify``; an undamaged one is read as before."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from resilient_callbacks import Checkpointer, ResumeFallbackWarning
from resilient_callbacks.manifest import SELF_CHECKSUM
from test_checkpointer import _fresh, _make_run, _step_dir
from test_cli import cli


def _legacy_run(root) -> None:
    """Steps 10, 20, 30, each manifest as an older version wrote it: no checksum of itself."""
    _make_run(root)
    for step in (10, 20, 30):
        path = os.path.join(_step_dir(root, step), "manifest.json")
        with open(path) as f:
            m = json.load(f)
        del m[SELF_CHECKSUM]
        with open(path, "w") as f:
            json.dump(m, f, indent=1)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        # a digit of the step flipped: the old code resumed "step 38" (or 20) from the files of
        # step 30, silently, and verify said ok
        ('"step": 38,', "the manifest says step 38, but its checkpoint is named step_000000030"),
        ('"step": 20,', "the manifest says step 20, but its checkpoint is named step_000000030"),
        ("truncated", "unreadable manifest"),
    ],
)
def test_a_damaged_legacy_manifest_is_skipped_loudly_with_a_fallback(tmp_path, damage, said):
    root = tmp_path / "ck"
    _legacy_run(root)
    newest = os.path.join(_step_dir(root, 30), "manifest.json")
    with open(newest) as f:
        text = f.read()
    assert '"step": 30,' in text
    with open(newest, "w") as f:
        f.write(
            text[: len(text) // 2] if damage == "truncated" else text.replace('"step": 30,', damage)
        )
    state = _fresh()
    with Checkpointer(root) as ck, pytest.warns(ResumeFallbackWarning, match="step_000000030"):
        assert ck.restore(state) == 20
    assert state["extra"]["tag"] == 20 and torch.equal(state["w"], torch.full((64,), 20.0))
    out = cli("verify", str(root))
    assert out.returncode == 1, out
    assert said in out.stdout + out.stderr and "CORRUPT" in out.stdout, out


def test_an_undamaged_legacy_manifest_is_read_under_any_name(tmp_path):
    """Its step matches its name: restored. A copy under a name of another form (made by hand)
    is not checked against it: ``inspect`` shows it."""
    root = tmp_path / "ck"
    _legacy_run(root)
    with Checkpointer(root) as ck:
        assert ck.restore(_fresh()) == 30
    copy = tmp_path / "step_30.bak"
    shutil.copytree(_step_dir(root, 30), copy)
    out = cli("inspect", str(copy), "--json")
    assert out.returncode == 0, out
    assert json.loads(out.stdout)["step"] == 30
