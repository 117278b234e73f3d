"""The error of a node-local close that gave up (close_uploads.py), in the mixed case: one
checkpoint still waits for a node's part, another had every part and its remote commit was
given up on the store. Both are named, each with its own reason. In-process: the coordinator's
real RemoteCommitter over a ``file://`` store, its commits of one checkpoint made to fail."""

from __future__ import annotations

from resilient_callbacks.close_uploads import not_uploaded_error
from resilient_callbacks.errors import UploadIncompleteError
from resilient_callbacks.nodelocal import NodeDirectory
from resilient_callbacks.remote import RemoteStore
from resilient_callbacks.remote_commit import RemoteCommitter
from resilient_callbacks.retention import RetentionPolicy
from resilient_callbacks.topology import Topology

PART = "step_000000002"  # node 1's part never arrives
STUCK = "step_000000004"  # every part arrived; the store refuses its manifest
LATE = "step_000000003"  # older, its parts arrived last: committed after STUCK was given up


def test_a_close_names_a_missing_part_and_a_commit_given_up_each_with_its_reason(tmp_path):
    """The given-up commit's error was the committer's last one, which the later successful
    commit of an older checkpoint cleared ("last error: None"); and the missing part was said
    as "their nodes' parts did not all arrive", "their" naming no checkpoint beside the
    given-up one's clause."""
    store = RemoteStore(f"file://{tmp_path / 'remote'}")
    c = RemoteCommitter(store, 2, RetentionPolicy(keep_last=3), max_attempts=1, retry_base_s=0)
    committed: list[str] = []

    def commit_one(p):
        if p.name == STUCK:
            raise ConnectionError("the store refuses the manifest")
        committed.append(p.name)  # (accepted: nothing to list or put for this test)

    c.commit_one = commit_one  # type: ignore[method-assign]
    c._retention = lambda protect, run: None  # type: ignore[method-assign]
    try:
        for seq, name in ((1, PART), (2, LATE), (3, STUCK)):
            c.expect(("run", seq), name, b"{}")
        c.report(0, {"key": ["run", 1], "name": PART})
        for key, name in ((["run", 3], STUCK), (["run", 2], LATE)):
            for node in (0, 1):
                c.report(node, {"key": key, "name": name})
            assert c.wait(timeout=120) is False  # (the part of PART still waits)
        assert committed == [LATE] and c.last_error is None
        assert c.given_up() == [STUCK] and c.missing() == {PART: [1]}
    finally:
        c.stop()
    d = NodeDirectory.__new__(NodeDirectory)  # the coordinator's, as close() leaves it
    d.dirpath, d.remote, d.committer, d.uploader = str(tmp_path / "node0"), store, c, None
    d.topology = Topology(0, 2, ((0,), (1,)))
    d.nodes_left = {1: {PART: "its upload failed: disk read error"}}
    e = not_uploaded_error(d, [PART, STUCK], 30.0)
    assert isinstance(e, UploadIncompleteError)
    msg = str(e)
    assert f"2 checkpoint(s) never committed remotely at {store.url}: {PART}, {STUCK}" in msg
    assert f"The remote commit of {STUCK} failed 1 time(s), given up (last error: " in msg, msg
    assert "ConnectionError: the store refuses the manifest" in msg, msg
    assert f"not every node's part arrived: node 1's part of {PART} never arrived: " in msg
    assert "its upload failed: disk read error" in msg, msg
    assert "stopped answering" not in msg, msg  # (no outage was waited out)
    assert sorted(e.pending) == [PART, STUCK]
