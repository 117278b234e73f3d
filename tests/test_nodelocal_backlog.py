"""Node-local mode when the uploads fall behind the saves (docs/multinode.md, "Uploads behind
the saves"): as in shared mode, the checkpoints the remote retention would delete once the
newer ones are committed are not uploaded, and no longer held on the nodes' disks; the
coordinator decides, never drops the oldest still being uploaded (so the remote commits go on
with one slow node), and what a fast node uploaded of a dropped checkpoint is removed. Two
ranks, each its own "node" (the worker of tests/test_nodelocal_failures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_nodelocal_failures import _run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _assert_remote_sound(remote: Path) -> None:
    """Every remote checkpoint with a manifest has every file it lists, with its size; a
    folder without one holds no file (a dropped checkpoint's parts were removed)."""
    for ckpt in sorted(remote.glob("step_*")):
        manifest = ckpt / "manifest.json"
        if not manifest.exists():
            assert [p for p in ckpt.rglob("*") if p.is_file()] == [], ckpt
            continue
        for f in json.loads(manifest.read_text())["files"]:
            assert (ckpt / f["path"]).stat().st_size == f["size"], (ckpt, f)


def _kept(tmp: Path, node: int) -> list[str]:
    return sorted(n.name for n in (tmp / f"node{node}").glob("step_*"))


def test_a_slow_node_keeps_a_bounded_backlog_and_the_remote_commits_go_on(tmp_path):
    """Node 1's first upload lasts until step 12 is saved, each of its uploads then takes
    0.5 s; keep_last=3, 20 saves. Node 1's queue stays bounded (it held every checkpoint not
    uploaded yet: 19 at the end), the checkpoint it is uploading is never dropped (a first
    attempt dropped it at each save: no remote commit all run), so step 2 is committed
    remotely; nothing incomplete is committed, and node 0's parts of the dropped checkpoints
    are removed."""
    out = _run(
        tmp_path,
        "slow",
        2,
        "--steps",
        "40",
        RC_SLOW_UPLOADS=0.5,
        RC_SLOW_NODE=1,
        RC_HOLD_FIRST_UPLOAD_UNTIL=12,
        RC_CAPTURE_LOG=1,
        RC_LOG_INFO=1,
    )
    for rank in out:
        assert rank[-1]["event"] == "closed", rank
    # at flush(): the oldest still being uploaded, keep_last=3 newest, one cancelled under way
    assert out[1][-2]["status"]["pending"] <= 5, out[1][-2]
    log = out[0][-1]["log"]
    assert "/step_000000002 remotely (2 nodes' parts)" in log, log
    assert "uploads are behind; not uploading" in log, log
    _assert_remote_sound(tmp_path / "remote")
    for node in (0, 1):
        assert _kept(tmp_path, node) == ["step_000000036", "step_000000038", "step_000000040"]


def test_a_restart_uploads_again_only_what_the_remote_retention_keeps(tmp_path):
    """Both nodes killed at step 40 while node 1 had uploaded nothing: its disk held all 20
    checkpoints, and the re-run queued every one again (one re-run spent over a minute on 324
    and a rank timed out in a barrier). Now the disks hold a bounded backlog, the re-run
    queues only the 3 the remote retention keeps, and commits them."""
    _run(
        tmp_path,
        "first",
        2,
        "--steps",
        "40",
        "--kill-at",
        "40",
        expect=-9,
        RC_SLOW_UPLOADS=0.5,
        RC_SLOW_NODE=1,
        RC_HOLD_FIRST_UPLOAD_UNTIL=40,
    )
    assert len(_kept(tmp_path, 1)) <= 5, _kept(tmp_path, 1)
    out = _run(tmp_path, "second", 2, "--steps", "40", RC_CAPTURE_LOG=1)
    for rank in out:
        assert rank[0]["restored"] == 40, rank
        queued = rank[-1]["log"].count("uploading step_")
        assert queued <= 3, rank[-1]["log"]
    committed = sorted(p.parent.name for p in (tmp_path / "remote").glob("step_*/manifest.json"))
    assert committed == ["step_000000036", "step_000000038", "step_000000040"], committed
    _assert_remote_sound_committed(tmp_path / "remote")
    for node in (0, 1):
        assert _kept(tmp_path, node) == ["step_000000036", "step_000000038", "step_000000040"]


def test_a_restart_with_other_options_uploads_the_archive_points_it_held(tmp_path):
    """A first run with keep_every_n_steps=4 is killed at step 16 while node 1 had uploaded
    nothing; the re-run has no keep_every_n_steps. Steps 4 and 8 were archive points when
    they were written (kept forever, remotely: the nodes' disks keep no archives with a
    remote), but the re-run planned their upload under its own options, did not upload
    them again and then deleted them locally: lost in both tiers. Now they are committed."""
    _run(
        tmp_path,
        "first",
        2,
        "--steps",
        "16",
        "--kill-at",
        "16",
        expect=-9,
        RC_KEEP_EVERY=4,
        RC_SLOW_UPLOADS=0.5,
        RC_SLOW_NODE=1,
        RC_HOLD_FIRST_UPLOAD_UNTIL=16,
    )
    assert {"step_000000004", "step_000000008"} <= set(_kept(tmp_path, 1)), _kept(tmp_path, 1)
    out = _run(tmp_path, "second", 2, "--steps", "16", RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [16, 16]
    committed = sorted(p.parent.name for p in (tmp_path / "remote").glob("step_*/manifest.json"))
    want = ["step_000000004", "step_000000008", "step_000000012", "step_000000014"]
    assert committed == [*want, "step_000000016"], (committed, out[0][-1]["log"])
    _assert_remote_sound_committed(tmp_path / "remote")


def test_a_restart_with_other_options_and_slow_uploads_commits_the_archive_points(tmp_path):
    """As above, and the re-run goes on to step 24 while node 1's uploads stay slow: the
    coordinator dropped the earlier run's archive points it was waiting for as "uploads are
    behind" under the re-run's options."""
    slow = {"RC_SLOW_UPLOADS": 0.5, "RC_SLOW_NODE": 1}
    _run(tmp_path, "first", 2, "--steps", "16", "--kill-at", "16", expect=-9, RC_KEEP_EVERY=4,
         RC_HOLD_FIRST_UPLOAD_UNTIL=16, **slow)  # fmt: skip
    assert {"step_000000004", "step_000000008"} <= set(_kept(tmp_path, 1)), _kept(tmp_path, 1)
    out = _run(tmp_path, "second", 2, "--steps", "24", RC_CAPTURE_LOG=1, RC_LOG_INFO=1, **slow)
    committed = sorted(p.parent.name for p in (tmp_path / "remote").glob("step_*/manifest.json"))
    assert {"step_000000004", "step_000000008"} <= set(committed), (committed, out[0][-1]["log"])
    assert committed[-1] == "step_000000024", committed
    _assert_remote_sound_committed(tmp_path / "remote")


def _assert_remote_sound_committed(remote: Path) -> None:
    for manifest in remote.glob("step_*/manifest.json"):
        for f in json.loads(manifest.read_text())["files"]:
            assert (manifest.parent / f["path"]).stat().st_size == f["size"], (manifest, f)


def test_a_fast_node_keeps_its_uploaded_part_until_the_remote_commit(tmp_path):
    """Every 5th save uploaded (step 10), keep_last=3; node 0 uploads slowly, node 1 uploads
    its part of step 10 at once, and both are killed at step 16 before node 0's part arrived.
    Node 1's retention had deleted its copy of step 10 as soon as it was uploaded: the re-run
    (same disks) uploaded node 0's part again, but node 1 had nothing to upload or report, so
    step 10, the newest checkpoint due for the remote, was never committed and a resume on
    fresh nodes found nothing there. Node 1 now keeps its part until the remote commit."""
    _run(
        tmp_path,
        "first",
        2,
        "--steps",
        "16",
        "--remote-every",
        "5",
        "--kill-at",
        "16",
        expect=-9,
        RC_SLOW_UPLOADS=60,
        RC_SLOW_NODE=0,
        RC_KILL_ONCE_UPLOADED=1,
    )
    assert "step_000000010" in _kept(tmp_path, 1), _kept(tmp_path, 1)
    out = _run(tmp_path, "second", 2, "--steps", "16", "--remote-every", "5")
    assert [rank[0]["restored"] for rank in out] == [16, 16]
    committed = sorted(p.parent.name for p in (tmp_path / "remote").glob("step_*/manifest.json"))
    assert committed == ["step_000000010"], committed
    _assert_remote_sound_committed(tmp_path / "remote")
