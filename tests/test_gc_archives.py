"""``resilient-ckpt gc --drop-archives`` and ``--drop-all-archives`` on a run whose archive
points come from two policies: the first run kept every 4th step, the run that resumed it
every 10th.

``--drop-archives`` deleted every archive point, those of the policy the run keeps now too: a
user clearing the archives of an option they dropped lost the ones the run still makes. Now it
deletes only those the newest checkpoint's policy no longer makes (kept forever by the policy
each was written with); ``--drop-all-archives`` deletes every one. The same for the remote tier
(``--remote URL``, its own recorded policy).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from resilient_callbacks import Checkpointer
from test_cli import cli
from test_remote_best import _forget_upload


def _run(root: str, **kw) -> None:
    """Steps 2, 4, ..., 12 kept every 4th, then resumed keeping every 10th: 14, ..., 22."""
    state = {"w": torch.zeros(4)}
    with Checkpointer(root, every_n_steps=2, keep_last=1, keep_every_n_steps=4, **kw) as ck:
        for step in range(1, 13):
            state["w"] += 1
            ck.step(step, state)
    with Checkpointer(root, every_n_steps=2, keep_last=1, keep_every_n_steps=10, **kw) as ck:
        start = ck.restore(state)
        assert start == 12
        for step in range(start + 1, 23):
            state["w"] += 1
            ck.step(step, state)


def _steps(root: str) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_"))


def _deleted(*args: str) -> list[int]:
    r = cli("gc", *args, "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    return sorted(d["step"] for d in json.loads(r.stdout)["delete"])


def test_drop_archives_deletes_only_those_the_policy_no_longer_makes(tmp_path):
    root = str(tmp_path / "ck")
    _run(root)
    assert _steps(root) == [4, 8, 12, 20, 22]  # every archive point kept, both policies'
    assert _deleted(root) == []
    assert _deleted(root, "--drop-archives") == [4, 8, 12]
    assert _deleted(root, "--drop-all-archives") == [4, 8, 12, 20]
    assert cli("gc", root, "--drop-archives").returncode == 0
    assert _steps(root) == [20, 22]  # the archive point of the policy now stays
    assert cli("gc", root, "--drop-all-archives").returncode == 0
    assert _steps(root) == [22]


def test_drop_archives_and_drop_all_archives_together_are_refused(tmp_path):
    """cli.md writes ``[--drop-archives | --drop-all-archives]``, one or the other, but gc
    took both and did what --drop-all-archives says, silently: a usage error now (exit 2),
    before anything is read or deleted."""
    root = str(tmp_path / "ck")
    _run(root)
    r = cli("gc", root, "--drop-archives", "--drop-all-archives")
    assert r.returncode == 2, r.stderr
    assert "--drop-all-archives: not allowed with argument --drop-archives" in r.stderr
    assert _steps(root) == [4, 8, 12, 20, 22]


def test_drop_archives_on_the_remote_deletes_only_those_its_policy_no_longer_makes(tmp_path):
    local, url = str(tmp_path / "local"), f"file://{tmp_path}/durable/run"
    _run(local, remote=url)

    def remote_deleted(*flags: str) -> list[int]:
        r = cli("gc", local, "--remote", url, *flags, "--dry-run", "--json")
        assert r.returncode == 0, r.stderr
        return sorted(d["step"] for d in json.loads(r.stdout)["remote"]["delete"])

    assert remote_deleted() == []
    assert remote_deleted("--drop-archives") == [4, 8, 12]
    assert remote_deleted("--drop-all-archives") == [4, 8, 12, 20]


def test_gc_remote_without_the_runs_dir_drops_archives_a_restart_does_not_upload_again(
    tmp_path, caplog
):
    """``gc URL-only --drop-all-archives`` of a run with ``remote_every_n_saves`` > 1, whose
    local tier keeps its archive points too: the restart of the run uploaded them again,
    saying they "were not uploaded ... before the last run stopped" (they were, and gc deleted
    them). The remote held a later commit of the run, so they had been uploaded (one writer
    uploads in commit order and never skips an archive point): now they stay deleted, the
    restart says why, and gc says that the local copies stay and what deletes them."""
    local, remote = str(tmp_path / "local"), tmp_path / "durable" / "run"
    url = f"file://{remote}"
    kw = {"every_n_steps": 1, "keep_last": 1, "keep_every_n_steps": 4, "remote": url}
    kw |= {"remote_every_n_saves": 2, "remote_keep_last": 1, "async_save": False}
    state = {"w": torch.zeros(4)}
    with Checkpointer(local, **kw) as ck:
        for step in range(1, 13):
            state["w"] += 1
            ck.step(step, state)
    assert _steps(str(remote)) == [4, 8, 12]
    r = cli("gc", str(tmp_path / "not_here"), "--remote", url, "--drop-all-archives")
    assert r.returncode == 0, r.stderr
    assert _steps(str(remote)) == [12] and _steps(local) == [4, 8, 12]
    assert "local directory keeps its own copies of step 4, 8" in r.stderr, r.stderr
    caplog.set_level(logging.INFO, "resilient_callbacks")
    with Checkpointer(local, **kw) as ck:
        assert ck.restore(state) == 12
    said = caplog.text
    assert "were not uploaded" not in said and "uploading them now" not in said, said
    assert "deleted from it since" in said, said
    assert _steps(str(remote)) == [12]  # not uploaded again
    assert _steps(local) == [4, 8, 12]  # nor deleted here


def test_an_archive_point_never_uploaded_is_uploaded_at_a_restart_that_makes_it_due(
    tmp_path, caplog
):
    """A run with ``remote_every_n_saves=3`` of a library that uploaded archive points only
    when due by the interval never uploaded those of steps 4 and 8 (the local tier keeps
    them); the restart uploads every save. The remote holds a later commit of the run (step
    12), and the restart took that as proof that steps 4 and 8 had been uploaded and deleted
    there on purpose: it said so (untrue), uploaded neither, and its local retention
    (``keep_last`` alone once every save is uploaded) then deleted both, so the archive points
    were gone from both tiers. Only a checkpoint the directory's history records as uploaded
    is taken as deleted from the remote since."""
    local, remote = str(tmp_path / "local"), tmp_path / "durable" / "run"
    url = f"file://{remote}"
    kw = {"every_n_steps": 1, "keep_last": 1, "keep_every_n_steps": 4, "remote": url}
    kw |= {"remote_keep_last": 1, "async_save": False}
    state = {"w": torch.zeros(4)}
    with Checkpointer(local, remote_every_n_saves=3, **kw) as ck:
        for step in range(1, 13):
            state["w"] += 1
            ck.step(step, state)
    assert _steps(str(remote)) == [4, 8, 12] and _steps(local) == [4, 8, 12]
    for step in (4, 8):  # (as that library left them: never uploaded)
        shutil.rmtree(remote / f"step_{step:09d}")
        _forget_upload(Path(local) / "history.jsonl", step)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    with Checkpointer(local, **kw) as ck:
        assert ck.restore(state) == 12
        state["w"] += 1
        ck.step(13, state)
    assert "deleted from it since" not in caplog.text, caplog.text
    assert _steps(str(remote)) == [4, 8, 12, 13]
