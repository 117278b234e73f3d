"""Replication to a peer node (``replicas=1``, docs/multinode.md) when one end fails before or
while the files travel: a part file gone from the sending node's disk, a receiving node that
cannot store the copy. Both leaders finish the exchange together and go on training (the
checkpoint stays committed on each disk); the node whose end failed says so, naming itself.
Before, the other leader waited in a receive until the process group's timeout (30 min by
default). Each run's process group timeout (900 s) is far beyond the ranks' deadline
(spawn_ranks, 150 s): a hang fails the test. The worker is tests/test_nodelocal_failures.py's."""

from __future__ import annotations

import shutil

import pytest

from resilient_callbacks import catalog
from resilient_callbacks.remote import RemoteStore
from test_nodelocal_failures import _run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LONG_PG = {"RC_PG_TIMEOUT_S": 900, "RC_REPLICAS": 1, "RC_CAPTURE_LOG": 1}


def _replicas(tmp, node: int, of: int) -> list[str]:
    root = tmp / f"node{node}" / ".replicas" / f"ranks_{of:05d}-{of:05d}"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


@pytest.mark.parametrize("lost", ["manifest.json", "rank_00001.safetensors"])
def test_a_part_file_gone_before_replication_does_not_hang_the_peer(tmp_path, lost):
    """Node 1's part of step 4 loses a file once committed: node 1 cannot send it (its
    manifest: before anything travels; a tensor file: part-way). Both ranks go on to step 6."""
    out = _run(
        tmp_path, "run", 2, "--steps", "6", "--remote-every", "10",
        RC_LOSE_FILE_AT=f"1:4:{lost}", **LONG_PG,
    )  # fmt: skip
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    said = out[1][-1]["log"]
    assert "node 1: replicating step_000000004" in said, said
    assert "rank 1 could not send step_000000004: FileNotFoundError" in said, said
    assert "replicating" not in out[0][-1]["log"]  # (node 0 logs it at INFO)
    assert "step_000000004" not in _replicas(tmp_path, 0, of=1)
    assert "step_000000006" in _replicas(tmp_path, 0, of=1)  # the next save replicated
    assert "step_000000004" in _replicas(tmp_path, 1, of=0)  # the other direction did


def test_a_node_that_cannot_store_a_replica_does_not_hang_the_sender(tmp_path):
    """Node 0's replica folder for node 1 is a file (made after the restore): node 0 cannot store node 1's copy. Both
    ranks go on, node 0 names itself, node 1's copies of node 0's part arrive."""
    out = _run(
        tmp_path, "run", 2, "--steps", "4", "--remote-every", "10", RC_BLOCK_REPLICAS_OF=1,
        **LONG_PG,
    )  # fmt: skip
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    said = out[0][-1]["log"]
    assert "node 0: replicating step_000000002" in said, said
    assert "rank 0 could not store step_000000002: FileExistsError" in said, said
    assert "replicating" not in out[1][-1]["log"]
    assert _replicas(tmp_path, 1, of=0) == ["step_000000002", "step_000000004"]


def test_a_replica_that_cannot_be_sent_at_restore_does_not_hang_the_replaced_node(tmp_path):
    """Node 1 is replaced (its disk wiped); node 0's replica of its part loses a file as node 0
    sends it. Node 1 no longer waits for it: the restore goes on on both ranks, from the
    remote copy."""
    _run(tmp_path, "first", 2, "--steps", "4", **LONG_PG)  # closed: committed remotely
    shutil.rmtree(tmp_path / "node1")
    out = _run(
        tmp_path, "second", 2, "--steps", "6", RC_REPLICA_FILE_GONE="rank_00001.safetensors",
        **LONG_PG,
    )  # fmt: skip
    assert [rank[0].get("restored") for rank in out] == [4, 4], out
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    assert "node 1's 4 file(s) of step 4 from the remote copy" in out[1][-1]["log"]


def test_the_global_manifest_node_0_cannot_keep_is_said_naming_node_0(tmp_path):
    """docs/distributed.md "What a multi-rank run prints": a condition of one node's disk is
    said by that node's leader, naming the node (it named none)."""
    out = _run(
        tmp_path, "run", 2, "--steps", "2", RC_LOSE_FILE_AT="0:2:remote_manifest.json/",
        RC_CAPTURE_LOG=1,
    )  # fmt: skip
    said = out[0][-1]["log"]
    assert "node 0: could not keep the global manifest next to its part " in said, said
    assert "global manifest" not in out[1][-1]["log"]


def test_a_node_gone_at_close_is_said_by_the_others_naming_their_node(tmp_path):
    """Node 1 leaves the process group before close()'s last exchange: node 0 cannot learn which checkpoints
    are committed remotely and says it keeps its parts, naming itself (it named no node)."""
    out = _run(
        tmp_path, "run", 2, "--steps", "2", expect=None, RC_GONE_IN_CLOSE=1, RC_CAPTURE_LOG=1
    )
    said = out[0][-1]["log"]
    assert "close(): node 0 could not learn which checkpoints are committed remotely" in said


def test_a_manifest_gone_before_the_upload_is_queued_does_not_hang_the_peer(tmp_path):
    """Node 1's manifest of step 4 is gone once committed, and step 4 is due for upload: the
    leader read it back to queue the upload, raised before replicating (and only it, at its
    next save), and node 0 waited in the replica exchange until the process group's timeout.
    The upload now takes its list from the commit itself: both ranks replicate, go on to step
    6 and close, node 1 naming its replication failure."""
    out = _run(tmp_path, "run", 2, "--steps", "6", RC_LOSE_FILE_AT="1:4:manifest.json", **LONG_PG)
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    said = out[1][-1]["log"]
    assert "rank 1 could not send step_000000004: FileNotFoundError" in said, said
    assert "step_000000006" in _replicas(tmp_path, 0, of=1)
    assert "step_000000004" in _replicas(tmp_path, 1, of=0)


@pytest.mark.parametrize("stray", [".replicas/notes.txt", ".replicas"])
def test_a_stray_file_among_the_replicas_does_not_hang_the_restore(tmp_path, stray):
    """A file of the user's under node 1's ``.replicas/`` (or in its place): listing the
    replicas at the restore raised NotADirectoryError on node 1 only, and node 0 waited for
    it in the next collective until node 1 exited. It is skipped, named, and both ranks resume
    from their disks."""
    _run(tmp_path, "first", 2, "--steps", "4", **LONG_PG)
    if stray == ".replicas":
        shutil.rmtree(tmp_path / "node1" / ".replicas")
    (tmp_path / "node1" / stray).write_text("a note of the user's")
    out = _run(tmp_path, "second", 2, "--steps", "6", **LONG_PG)
    assert [rank[0].get("restored") for rank in out] == [4, 4], out
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    said = out[1][-1]["log"]
    assert f"node 1: {tmp_path / 'node1' / stray} is not a folder" in said, said


@pytest.mark.parametrize("async_save", ["1", ""])
def test_a_failure_after_a_nodes_commit_says_the_checkpoint_is_committed(tmp_path, async_save):
    """Node 1's retention pass after its commits of steps 4 to 6 fails (an I/O error reading
    its disk): said once, not after each (said again at each save before). The checkpoint was committed on every node and a restore takes it, but node 1's
    leader raised alone: "the save of step 4 stopped on rank 1 ... Its uncommitted files are
    removed", recorded it as a failed save, and every rank raised at the next save (a
    synchronous save: rank 1 alone, and rank 0 waited in the next save until the deadline).
    Now node 1 says the checkpoint is committed, what failed
    after the commit and what that leaves undone (said as in every mode:
    after_commit_work.py); every rank records it as committed and goes on; the next save's
    retention deletes what was kept."""
    from resilient_callbacks import history

    out = _run(
        tmp_path, "run", 2, "--steps", "8", "--remote-every", "10", RC_KEEP_LAST=1,
        RC_RETENTION_FAILS_AT="1:4,5,6", RC_ASYNC_SAVE=async_save, **LONG_PG,
    )  # fmt: skip
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    assert [rank[-2]["committed_saves"] for rank in out] == [4, 4], out
    said = out[1][-1]["log"]
    assert "checkpoint for step 4 was committed (" in said, said
    assert "step_000000004, on every node): it is valid and a restore takes it" in said, said
    assert "node 1's work after the commit failed: OSError: [Errno 5] Input/output" in said
    assert "are kept until the next retention pass" in said, said
    assert said.count("work after the commit failed") == 1, said
    assert "uncommitted" not in said and "not committed" not in said, said
    assert "after the commit" not in out[0][-1]["log"]  # (node 0 did its part)
    for node in (0, 1):
        assert history.records(str(tmp_path / f"node{node}"), ("save_failed",)) == []
    assert sorted(p.name for p in (tmp_path / "node1").glob("step_*")) == ["step_000000008"]


def test_a_replica_travels_in_pieces_bit_exact_and_a_piece_that_flips_is_caught(tmp_path):
    """Replica files travel in pieces of at most ``peers.CHUNK_BYTES`` (lowered to 256 bytes
    here: a rank's files of about 10 kB are 40 pieces each), not whole: a multi-GB shard was
    held in memory twice on each end. Node 1's copies of node 0's parts arrive bit-exact; one
    byte of node 1's part of step 2 flips in flight (in a later piece of its tensor file):
    node 0's check of the checksums refuses that copy, naming itself, and the next save's
    replica arrives. (16-byte pieces, about 1,500 a node, took 4 s more.)"""
    out = _run(
        tmp_path, "run", 2, "--steps", "4", "--remote-every", "10", RC_REPLICA_CHUNK=256,
        RC_REPLICA_ROT="step_000000002/rank_00001.safetensors", **LONG_PG,
    )  # fmt: skip
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    for rank in out:
        pieces = next(r["pieces"] for r in rank if "pieces" in r)
        assert max(pieces) <= 256 and len(pieces) > 40, pieces
    said = out[0][-1]["log"]
    assert "rank 0 could not store step_000000002: CheckpointCorruptError" in said, said
    assert "checksum" in said, said
    assert _replicas(tmp_path, 0, of=1) == ["step_000000004"]
    assert _replicas(tmp_path, 1, of=0) == ["step_000000002", "step_000000004"]
    for step in ("step_000000002", "step_000000004"):
        mine = tmp_path / "node0" / step
        copy = tmp_path / "node1" / ".replicas" / "ranks_00000-00000" / step
        names = sorted(p.name for p in mine.iterdir())
        assert names and names == sorted(p.name for p in copy.iterdir()), (names, copy)
        for name in names:
            assert (mine / name).read_bytes() == (copy / name).read_bytes(), name


def test_close_names_the_node_whose_part_never_arrived_not_the_store(tmp_path):
    """Node 1's uploads fail (its part of step 2 rotted on its disk first: never uploaded);
    node 0's go up, and the store answers rank 0 throughout. Rank 0's close raised "The store
    failed or stopped answering for more than 2 s (last error: no byte moved for 2 s)". It
    now names node 1's part of each checkpoint and why it never arrived, as node 1 said."""
    out = _run(
        tmp_path, "run", 2, "--steps", "4", expect=5, RC_UPLOADS_FAIL_ON=1, RC_OUTAGE_S=2,
        RC_ROT_BEFORE_UPLOAD=1, RC_CAPTURE_LOG=1,
    )  # fmt: skip
    assert [rank[-1]["error"] for rank in out] == ["UploadIncompleteError"] * 2, out
    msg = out[0][-1]["msg"]
    assert sorted(out[0][-1]["pending"]) == ["step_000000002", "step_000000004"], msg
    assert "The store failed" not in msg and "no byte moved" not in msg, msg
    assert "node 1's part of step_000000002 never arrived: its local copy is damaged" in msg
    assert (
        "node 1's part of step_000000004 never arrived: its upload did not finish (last "
        "error: ConnectionError: endpoint unreachable)" in msg
    ), msg
    assert "not committed remotely: node 1's part of step_000000002" in out[0][-1]["log"]
    assert "node 1's part of" in out[1][-1]["msg"]  # (node 1 names its own, as before)


def test_a_retention_that_fails_after_an_upload_or_at_close_is_an_error_close_completes(
    tmp_path,
):
    """keep_last=1. Node 0's retention passes after each upload and at close fail (its
    directory cannot be listed); node 1 cannot delete step 2 (its rename to the trash is
    denied), nor the files of step 4 once in the trash. close() raised the PermissionError on
    rank 0 (a job with every checkpoint committed and uploaded failed), and node 1 said only
    warnings. Now every checkpoint is counted committed and uploaded, both ranks close, and
    each node logs an ERROR naming what it did not delete and how to delete it, once (not
    after every upload)."""
    out = _run(
        tmp_path, "run", 2, "--steps", "6", RC_KEEP_LAST=1, RC_RETENTION_DENIED=0,
        RC_TRASH_DENIED="1:step_000000002", RC_TRASH_STAYS="step_000000004", RC_LOG_LEVELS=1,
        **LONG_PG,
    )  # fmt: skip
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    assert [rank[-2]["committed_saves"] for rank in out] == [3, 3], out
    store = RemoteStore(f"file://{tmp_path}/remote")
    assert {e.manifest.step for e in store.scan() if e.manifest is not None} >= {6}  # (closed:
    # no UploadIncompleteError, every part uploaded and committed)
    zero = out[0][-1]["log"]
    assert f"ERROR node 0: the retention pass of {tmp_path / 'node0'} " in zero, zero
    assert "PermissionError: [Errno 13] Permission denied" in zero, zero
    assert "keep_last=1" in zero and "delete them by hand" in zero, zero
    assert zero.count("the retention pass of") == 1, zero  # each upload's, close's: said once
    one = out[1][-1]["log"]
    gone = tmp_path / "node1" / "step_000000002"
    assert f"ERROR retention: could not delete {gone}: [Errno 13] Permission denied" in one, one
    assert f"rm -r {gone}" in one, one
    assert gone.is_dir() and not (tmp_path / "node1" / "step_000000004").exists()
    trash = next((tmp_path / "node1").glob(".trash-step_000000004-*"))
    assert f"ERROR retention: could not delete {trash} completely" in one, one
    assert f"rm -r {trash}" in one, one


@pytest.mark.slow
@pytest.mark.parametrize("retention_too", [False, True])
def test_a_nodes_upload_not_queued_is_said_with_what_becomes_of_it(tmp_path, retention_too):
    """Node 1's upload queue refuses its part of step 2 after the commit (every save is
    uploaded); its retention pass succeeds. The ERROR said only retention's words ("Older
    checkpoints ... are kept until the next retention pass", not so: the pass ran), not that
    node 1's part is not uploaded, so the remote store never commits that checkpoint. Now it
    says so, that `resilient-ckpt push` cannot upload a node's part, and that the next saves
    are uploaded as usual, as they are: step 4 is committed remotely and close() completes.
    ``retention_too``: node 1's retention pass after that commit fails as well (an I/O error):
    only the queueing was named; both are now."""
    both = {"RC_RETENTION_FAILS_AT": "1:2"} if retention_too else {}
    out = _run(
        tmp_path, "run", 2, "--steps", "4", RC_KEEP_LAST=1, RC_QUEUE_FAILS_AT="1:2",
        RC_CAPTURE_LOG=1, RC_OUTAGE_S=30, **both,
    )  # fmt: skip
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    assert [rank[-2]["committed_saves"] for rank in out] == [2, 2], out
    said = out[1][-1]["log"]
    assert said.count("work after the commit failed") == 1, said
    assert "checkpoint for step 2 was committed (" in said, said
    assert "node 1's work after the commit failed: RuntimeError: the upload queue refused" in said
    assert (
        "Node 1's part of it is not queued for upload to file://" in said
        and "so this checkpoint is not committed remotely (`resilient-ckpt push` refuses a "
        "node's directory"
        in said
        and "the next saves are uploaded and committed remotely as usual." in said
    ), said
    if retention_too:
        assert "; its retention pass failed too: OSError: [Errno 5] Input/output" in said, said
        assert "are kept until the next retention pass." in said, said
    else:
        assert "kept until the next retention pass" not in said, said
    assert "after the commit" not in out[0][-1]["log"]  # (node 0 did its part)
    committed = [e.step for e in catalog.committed(catalog.scan(str(tmp_path / "remote")))]
    assert committed == [4], committed


@pytest.mark.slow
def test_a_final_upload_held_that_a_node_cannot_queue_is_said_at_close(tmp_path):
    """remote_every_n_saves=10: step 6, saved by the schedule, is held; the final save of it
    (the DeepSpeed launcher's end) queues its upload, which node 1's queue refuses. The
    RuntimeError left node 1's final save (its job failed, alone, its close never ran) and
    rank 0's close named only a part that "never arrived". Now node 1's final save returns, it
    says the run's last checkpoint is not committed remotely as an ERROR, kept and said again
    at its close, which completes; rank 0's close raises UploadIncompleteError as before,
    naming why node 1's part never arrived."""
    out = _run(
        tmp_path, "last", 2, "--steps", "6", "--remote-every", "10", expect=None,
        RC_FINAL_SAVE=1, RC_QUEUE_FAILS_AT="1:6", RC_CAPTURE_LOG=1, RC_OUTAGE_S=30,
    )  # fmt: skip
    assert out[1][-1]["event"] == "closed", out[1]
    error = out[1][-2]["after_error"]
    assert error.startswith("the run's last checkpoint, of step 6 ("), error
    assert "failed on node 1: RuntimeError: the upload queue refused step_000000006" in error
    assert "Node 1's part of it is not queued for upload to file://" in error, error
    assert "`resilient-ckpt push` refuses a node's directory" in error, error
    said = out[1][-1]["log"]
    assert said.count(error) == 2 and "close(): the work after the commit of the newest" in said
    assert out[0][-1]["error"] == "UploadIncompleteError", out[0]
    assert (
        "node 1's part of step_000000006 never arrived: queueing its upload failed: "
        "RuntimeError: the upload queue refused step_000000006" in out[0][-1]["msg"]
    ), out[0][-1]["msg"]
