"""Node-local mode after a roll-back (``resume=<step>`` of an older checkpoint): the checkpoint
the run restored from stays on every node's disk until the run's first commit, as in shared
mode (docs/guide.md, "Retention"). Two ranks, each its own "node" (the worker of
tests/test_nodelocal_failures.py)."""

from __future__ import annotations

import os

import pytest

from test_nodelocal_failures import _run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _kept(tmp, node: int) -> list[str]:
    return sorted(n for n in os.listdir(tmp / f"node{node}") if n.startswith("step_"))


def test_a_roll_back_keeps_the_checkpoint_restored_until_the_first_commit(tmp_path):
    """Steps 2, 4 and 6 on both disks, none uploaded (a kill). A re-run rolls back to step 2
    with keep_last=1: the restore queues step 6 for upload again, and each node's retention
    after that upload deleted step 2 (only the abandoned 6 counted, no commit had recorded
    the roll-back yet), on every disk and never uploaded. Killed before its first save, the
    same command again (resume=2) found no step 2 anywhere. Now each node keeps it until the
    run's first commit, and then it goes under keep_last as any other."""
    _run(tmp_path, "first", 2, "--steps", "6", "--remote-every", "10", "--kill-at", "6", expect=-9)
    for node in (0, 1):
        assert _kept(tmp_path, node) == [f"step_00000000{s}" for s in (2, 4, 6)]
    back = {"RC_RESUME": 2, "RC_KEEP_LAST": 1}
    out = _run(
        tmp_path, "back", 2, "--steps", "6", expect=-9, RC_KILL_ONCE_RESTORE_UPLOADED=1, **back
    )
    for rank in out:
        assert rank[0]["restored"] == 2, rank
        assert "step_000000002" in rank[1]["kept"], rank  # and 6, held for its remote commit
    out = _run(tmp_path, "again", 2, "--steps", "4", **back)
    assert [rank[0]["restored"] for rank in out] == [2, 2], out
    for rank in out:
        assert rank[-1]["event"] == "closed", rank
    for node in (0, 1):  # the first commit (step 4 of the new branch) ended the protection
        assert "step_000000002" not in _kept(tmp_path, node), _kept(tmp_path, node)


def test_a_roll_back_keeps_the_remote_copy_restored_from_until_the_first_commit(tmp_path):
    """Steps 2 and 4 committed remotely, 6 and 8 on the disks only (a kill); a roll-back to
    2 with keep_last=1 that ends before its first save: close() commits 8 remotely (the
    restore queued it again), and the remote retention after that commit deleted the remote
    copy of 2, the state the run went back to. It stays until the run's first commit."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: 2 and 4 committed remotely
    _run(tmp_path, "on", 2, "--steps", "8", "--remote-every", "10", "--kill-at", "8", expect=-9)
    out = _run(tmp_path, "back", 2, "--steps", "2", RC_RESUME=2, RC_KEEP_LAST=1)
    assert [rank[0]["restored"] for rank in out] == [2, 2], out
    remote = tmp_path / "remote"
    committed = sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))
    assert committed == ["step_000000002", "step_000000008"], committed


def test_a_roll_back_keeps_the_remote_copy_restored_from_until_the_branch_is_committed_there(
    tmp_path,
):
    """Steps 2 and 4 committed remotely, 6 and 8 on the disks only (a kill); a roll-back to 2
    with keep_last=1. The restore queues 8 again; its parts arrive in the gather of the new
    branch's first save (4), so it is committed remotely after that save's local commit,
    which ended the protection: the remote retention after 8's commit deleted the remote copy
    of 2, with the branch's 4 not committed there yet. Both nodes lost then, the remote held
    only the abandoned timeline. 2 stays until the branch's first remote commit."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: 2 and 4 committed remotely
    _run(tmp_path, "on", 2, "--steps", "8", "--remote-every", "10", "--kill-at", "8", expect=-9)
    back = {"RC_RESUME": 2, "RC_KEEP_LAST": 1, "RC_COMMIT_AFTER_FIRST_SAVE": 1}
    out = _run(tmp_path, "back", 2, "--steps", "4", "--kill-at", "4", expect=-9, **back)
    assert [rank[0]["restored"] for rank in out] == [2, 2], out
    committed = sorted(p.parent.name for p in (tmp_path / "remote").glob("step_*/manifest.json"))
    assert committed == ["step_000000002", "step_000000008"], committed
