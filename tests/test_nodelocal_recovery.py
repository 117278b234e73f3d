"""Node-local mode: the recovery of the uploads a stop cut off (docs/multinode.md, "After a
restore") when a node cannot read its disk. Two gloo ranks, one node each, through the worker
and harness of tests/test_nodelocal_failures.py (a hang fails at the spawn deadline)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from test_nodelocal_failures import _run
from test_remote_best import _forget_upload

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_a_node_that_cannot_read_its_disk_to_recover_uploads_resumes_with_an_error(tmp_path):
    """Node 1's directory cannot be listed as the restore queues the uploads a stop cut off
    again: only that rank raised, and node 0 went on into the first save's collectives,
    alone (a hang until the process group's timeout, or a peer's closed connection). Every
    rank now skips the recovery together, resumes, and each node's leader logs an ERROR
    naming node 1 and what failed; the new checkpoints are committed remotely as usual."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    out = _run(
        tmp_path,
        "second",
        2,
        "--steps",
        "6",
        RC_RECOVERY_DENIED=1,
        RC_CAPTURE_LOG=1,
        RC_LOG_LEVELS=1,
    )
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    for rank in out:
        said = rank[-1]["log"]
        lines = [x for x in said.splitlines() if "not queued again on any node" in x]
        assert len(lines) == 1 and lines[0].startswith("ERROR "), said
        assert "node 1: PermissionError" in lines[0] and "Permission denied" in lines[0]
        assert "those newer than commit" in lines[0], lines[0]
    assert (tmp_path / "remote" / "step_000000006" / "manifest.json").exists()


def test_a_global_manifest_the_restore_cannot_read_is_said_not_committed(tmp_path):
    """The uploads of steps 2 and 4 failed, then a kill; at the restart node 0 could not read
    the global manifest kept beside its copies (an I/O error; here a folder in the file's
    place). The error was swallowed: every node uploaded its part again, no remote commit was
    expected, and the parts lay uncommitted in the store without a word. Node 0 now logs an
    ERROR naming the file, the error and the checkpoint that stays uncommitted."""
    _run(tmp_path, "first", 2, "--steps", "4", "--kill-at", "4", expect=-9, RC_UPLOADS_FAIL=1)
    kept = sorted((tmp_path / "node0").glob("step_*/remote_manifest.json"))
    assert kept
    for p in kept:
        p.unlink()
        p.mkdir()
    out = _run(tmp_path, "second", 2, "--steps", "6", RC_CAPTURE_LOG=1, RC_LOG_LEVELS=1)
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    said = out[0][-1]["log"]
    lines = [x for x in said.splitlines() if "remote_manifest.json cannot be read" in x]
    assert len(lines) == len(kept), said
    for p, line in zip(kept, lines, strict=True):
        assert line.startswith("ERROR node 0: "), line
        assert str(p) in line and "IsADirectoryError" in line, line
        assert f"{p.parent.name} is not committed remotely" in line, line
        assert "restart the job before its next remote commit" in line, line
    assert "remote_manifest.json cannot be read" not in out[1][-1]["log"]
    assert (tmp_path / "remote" / "step_000000006" / "manifest.json").exists()


def _archive_point_never_uploaded(tmp_path: Path) -> Path:
    """A first run of 8 steps, every 3rd save uploaded, archive points every 4 steps (steps 4
    and 8 uploaded as they are saved, and 6); then step 4 as a library that uploaded archive
    points only by the interval left it: not in the store, no remote commit recorded."""
    _run(tmp_path, "first", 2, "--steps", "8", "--remote-every", "3", RC_KEEP_EVERY=4)
    remote = tmp_path / "remote"
    first = sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))
    assert first == ["step_000000004", "step_000000006", "step_000000008"], first
    shutil.rmtree(remote / "step_000000004")
    _forget_upload(tmp_path / "node0" / "history.jsonl", 4)
    return remote


def test_an_archive_point_never_uploaded_is_uploaded_at_a_restart_that_makes_it_due(tmp_path):
    """remote_every_n_saves=3: the archive point of step 4 (commit 2) was not due for a
    library that uploaded archive points only by the interval, never uploaded; step 6
    (commit 3) is committed remotely. The restart (every 2nd save) makes it due, but it
    skipped every local checkpoint older than the store's newest commit of the run, taking it
    as uploaded: step 4 stayed on the nodes' disks only (a node replaced lost it), without a
    word. The coordinator's history now records each remote commit: one older than the newest
    that it does not record is uploaded and committed (as in shared mode). One it records,
    deleted from the store since (by `gc --remote --drop-archives`), is not uploaded again by
    the next restart."""
    remote = _archive_point_never_uploaded(tmp_path)
    for node in (0, 1):
        assert (tmp_path / f"node{node}" / "step_000000004").is_dir()
    out = _run(tmp_path, "second", 2, "--steps", "8", "--remote-every", "2", RC_KEEP_EVERY=4,
               RC_CAPTURE_LOG=1)  # fmt: skip
    assert [rank[0]["restored"] for rank in out] == [8, 8], out
    committed = sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))
    want = ["step_000000004", "step_000000006", "step_000000008"]
    assert committed == want, (committed, out[0][-1]["log"])
    for rank in out:
        assert (
            "uploading its part of step_000000004, an archive point the store lacks"
            in (rank[-1]["log"])
        ), rank[-1]["log"]
    shutil.rmtree(remote / "step_000000004")  # (what gc --remote --drop-archives does)
    out = _run(tmp_path, "third", 2, "--steps", "8", "--remote-every", "2", RC_KEEP_EVERY=4,
               RC_CAPTURE_LOG=1, RC_LOG_INFO=1)  # fmt: skip
    assert "not uploading step 4 (commit 2) again: committed remotely" in out[0][-1]["log"]
    assert not (remote / "step_000000004").exists()
    assert (tmp_path / "node1" / "step_000000004").is_dir()  # (its copies stay)


@pytest.mark.slow  # two runs of two ranks (about 5 s)
def test_an_archive_point_whose_global_manifest_is_unreadable_is_not_uploaded_at_each_restart(
    tmp_path,
):
    """As above, the archive point of step 4 (commit 2) was never uploaded; the global manifest
    the coordinator kept beside node 0's part (what its remote commit writes) is gone. Every
    node uploaded its part all the same, which no commit could ever name: a full checkpoint's
    bytes sent again at every restart, left in the store uncommitted. Now no node uploads it,
    and the coordinator's ERROR names the file and what commits it."""
    _archive_point_never_uploaded(tmp_path)
    (tmp_path / "node0" / "step_000000004" / "remote_manifest.json").unlink()
    out = _run(tmp_path, "second", 2, "--steps", "8", "--remote-every", "2", RC_KEEP_EVERY=4,
               RC_CAPTURE_LOG=1)  # fmt: skip
    assert [rank[0]["restored"] for rank in out] == [8, 8], out
    assert not (tmp_path / "remote" / "step_000000004").exists(), out[1][-1]["log"]
    said = out[0][-1]["log"]
    assert "step 4 (commit 2) is an archive point the store" in said, said
    assert "remote_manifest.json cannot be read" in said, said
    for rank in out:
        assert "uploading its part of step_000000004" not in rank[-1]["log"], rank[-1]["log"]
    for node in (0, 1):  # (its parts stay on the disks)
        assert (tmp_path / f"node{node}" / "step_000000004").is_dir()
