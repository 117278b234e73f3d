"""Node-local mode when a node's disk or the remote tier fails (docs/multinode.md): two ranks on
this machine, each "node" with its own checkpoint directory (``<base>/node<N>``), the remote a
``file://`` directory. A restart never starts from scratch silently where the run has
checkpoints; close does not hang through an outage; adding ranks per node resumes a
``PerRank(..., new_ranks="rank0")`` state; ``push`` refuses one node's part. (The S3 and
torchrun variants: tests/test_multinode.py.)"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import spawn_ranks
from resilient_callbacks import catalog
from resilient_callbacks.remote import RemoteStore

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _run(tmp: Path, name: str, nprocs: int, *args: str, expect=0, per_node: int = 1, **env):
    """Run the worker below on ``nprocs`` ranks, each a fresh process forked from a zygote that
    imported torch and the library once (seconds of CPU a rank); each rank's OUT records.
    ``RC_CAPTURE_LOG=1``: the last record also holds the library's log lines of that rank."""
    argv = [sys.executable, __file__, str(tmp), *args]
    env = {"RC_PER_NODE": str(per_node), **{k: str(v) for k, v in env.items()}}
    ranks = spawn_ranks.run(
        argv, nprocs, tmp, name, expect=expect, env=env, zygote=spawn_ranks.shared_zygote()
    )
    return [
        [json.loads(line[4:]) for line in out.splitlines() if line.startswith("OUT ")]
        for out in ranks.outputs
    ]


def _committed_then_both_disks_wiped(tmp: Path) -> None:
    """A first run of 4 steps, closed (committed remotely); then both nodes' disks are empty."""
    _run(tmp, "first", 2, "--steps", "4")
    shutil.rmtree(tmp / "node0")
    shutil.rmtree(tmp / "node1")


def _flip_a_byte(ckpt: Path) -> None:
    """Flip a byte in the middle of the largest file of checkpoint folder ``ckpt``."""
    _flip_a_byte_of(
        max((p for p in ckpt.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    )


def _flip_a_byte_of(victim: Path) -> Path:
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim


def test_a_node_replaced_before_any_remote_commit_refuses_to_start_from_scratch(tmp_path):
    """Both nodes killed before any remote commit (remote_every_n_saves=10), node 1's disk lost:
    node 0 still holds the run's checkpoints, which node 1 cannot load. That is an error, not a
    fresh start (which would also have called node 0's checkpoints another run's)."""
    _run(tmp_path, "first", 2, "--steps", "6", "--remote-every", "10", "--kill-at", "6", expect=-9)
    shutil.rmtree(tmp_path / "node1")
    out = _run(tmp_path, "second", 2, "--steps", "8", "--remote-every", "10", expect=4)
    for rank in out:
        assert rank[-1]["error"] == "NoValidCheckpointError", rank
        assert "node 1 has no copy of its files" in rank[-1]["msg"]


def test_a_wiped_node_resumes_a_compressed_checkpoint_from_the_remote(tmp_path):
    """compression="zstd" stores the replicated tensors as ``shared.safetensors.zst``: a node
    whose disk was wiped fetches it with its own ranks' files (it fetched ``shared.json``
    only, and the restore refused every remote copy: "the manifest does not list
    shared.safetensors"), and only node 0 uploads it."""
    _run(tmp_path, "first", 2, "--steps", "4", RC_COMPRESSION="zstd")  # closed: committed
    shutil.rmtree(tmp_path / "node1")
    out = _run(tmp_path, "second", 2, "--steps", "6", RC_COMPRESSION="zstd")
    assert [rank[0].get("restored") for rank in out] == [4, 4], out
    assert sorted(p.name for p in (tmp_path / "node1" / "step_000000004").iterdir()) == [
        "manifest.json",
        "rank_00001.json",
        "rank_00001.safetensors.zst",
        "remote_manifest.json",
        "shared.json",
        "shared.safetensors.zst",
    ]


def test_a_wiped_nodes_download_cut_part_way_fetches_only_what_did_not_arrive(tmp_path):
    """Node 1's disk is wiped and its download is cut by a reset connection after half of its
    files arrived whole: the next try fetched every file again (after an outage, each node of a
    large job downloaded its part twice). It now fetches only the files that did not arrive;
    every checksum is still verified, and both ranks resume from step 4."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    shutil.rmtree(tmp_path / "node1")
    out = _run(tmp_path, "second", 2, "--steps", "6", RC_GETS_FAIL_PARTWAY=1, RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    first, again = out[1][0]["gets"]  # node 1: the try cut part-way, then the next one
    assert sorted(first) == [
        "rank_00001.json",
        "rank_00001.safetensors",
        "shared.json",
        "shared.safetensors",
    ], first
    arrived = first[: len(first) // 2]
    assert sorted(again) == sorted(set(first) - set(arrived)), (first, again)
    said = out[1][-1]["log"]  # (node 1's leader says it, naming node 1: a merged log of 8)
    assert "2 of 4 file(s) of node 1's part of file://" in said and "fetching the other 2" in said
    assert out[0][0]["gets"] == []  # node 0 restores from its disk
    assert "skipping" not in out[0][-1]["log"] + out[1][-1]["log"]  # no fallback


def test_a_file_kept_from_a_cut_try_that_fails_its_checksum_is_fetched_again(tmp_path):
    """As above, but a file that arrived in the cut try has its size and a wrong byte (a
    transfer of that try still writing it, a torn write): the checksum verification after the
    download catches it and that file is fetched again, loudly: both ranks resume from step 4
    (step 4 was skipped on every rank for step 2, where a fresh fetch got it whole), never
    loaded with the wrong byte."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    shutil.rmtree(tmp_path / "node1")
    env = {"RC_GETS_FAIL_PARTWAY": 1, "RC_GETS_ROT": 1, "RC_CAPTURE_LOG": 1}
    out = _run(tmp_path, "second", 2, "--steps", "6", **env)
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    first, _again, rotten = out[1][0]["gets"]  # node 1: cut, its next try, the rotten file
    assert rotten == first[:1], out[1][0]["gets"]
    said = out[1][-1]["log"]
    lines = [x for x in said.splitlines() if "fail their checksum: fetching them again" in x]
    assert lines and "1 file(s) of node 1's part of file://" in lines[0], said  # (names it)
    assert "skipping" not in out[0][-1]["log"] + said  # no fallback


def test_a_wiped_node_whose_download_stalls_gives_up_naming_it(tmp_path):
    """Node 1's disk is wiped and the store lists its checkpoints but never sends their bytes
    (a dying store): the restarted job waited forever in the node's download (s3fs gives up
    on a request after minutes, other filesystems never). Now it is given up once no byte
    arrived for the (lowered) outage limit, and every rank fails naming what stalled."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    shutil.rmtree(tmp_path / "node1")
    out = _run(tmp_path, "second", 2, "--steps", "6", expect=4, RC_GETS_HANG=1, RC_OUTAGE_S=1)
    for rank in out:
        assert rank[-1]["error"] == "NoValidCheckpointError", rank
    said = out[0][-1]["msg"]
    assert "downloading node 1's part of file://" in said and "step_000000004" in said, said
    assert "no byte arrived" in said and "Retry when the store answers" in said, said


def _preempted_lines(tmp: Path, name: str, **env: object) -> list[str]:
    """Run the worker's second run on 2 ranks, every one of which must exit 75 (the
    scheduler's "requeue me"); each rank's one line saying why, checked: no traceback."""
    argv = [sys.executable, __file__, str(tmp), "--steps", "6"]
    env = {"RC_PER_NODE": "1", **{k: str(v) for k, v in env.items()}}
    ranks = spawn_ranks.run(
        argv, 2, tmp, name, expect=75, env=env, zygote=spawn_ranks.shared_zygote()
    )
    lines = []
    for said in ranks.outputs:
        assert "Traceback" not in said and "after the last step()" not in said, said[-3000:]
        mine = [ln for ln in said.splitlines() if "RemoteWaitPreemptedError" in ln]
        assert len(mine) == 1, said[-3000:]
        assert mine[0].endswith("exiting with code 75 so the scheduler restarts the job"), mine
        assert "SIGTERM arrived while the restore waited" in mine[0], mine
        lines.append(mine[0])
    return lines


def test_a_sigterm_while_a_nodes_download_stalls_ends_the_restore_on_every_rank(tmp_path):
    """Node 1's disk is wiped, the store sends no byte of its part, and SIGTERM comes: node
    1's download waited out the outage limit (5 min), past the grace period to the SIGKILL.
    The request now ends the wait on every rank (RemoteWaitPreemptedError, no fallback to an
    older checkpoint: the ranks end alike), and each exits 75 saying so in one line, as in
    shared mode (it was the error's traceback, then 75 at the close at exit)."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    shutil.rmtree(tmp_path / "node1")
    env = {"RC_GETS_HANG": 1, "RC_HANG_SIGNALS": 1, "RC_OUTAGE_S": 30}
    said = _preempted_lines(tmp_path, "second", **env)[1]
    assert "downloading node 1's part of file://" in said and "step_000000004" in said, said


def test_a_sigterm_while_the_nodes_listing_stalls_ends_the_restore_on_every_rank(tmp_path):
    """The store stops answering after the construction's listing, and SIGTERM comes as the
    restore lists it: the listing waited out the outage limit (5 min) past the grace period,
    then went on from the disks. The request now ends the wait on every rank alike: exit 75,
    one line."""
    _run(tmp_path, "first", 2, "--steps", "4")
    env = {"RC_SCAN_HANGS_AFTER": 1, "RC_OUTAGE_S": 30}
    for said in _preempted_lines(tmp_path, "second", **env):
        assert "listing file://" in said, said


def test_remote_unlistable_and_empty_disks_is_an_error_not_a_fresh_start(tmp_path):
    _committed_then_both_disks_wiped(tmp_path)
    out = _run(tmp_path, "second", 2, "--steps", "6", expect=4, RC_SCAN_FAILS_AFTER=1)
    for rank in out:
        assert rank[-1]["error"] == "RemoteUnavailableError", rank


@pytest.mark.slow  # suite time budget: it checks a log message
def test_remote_unlistable_at_the_restore_resumes_from_the_disks_and_says_why_it_uploads(
    tmp_path,
):
    """The disks hold the run, the remote cannot be listed at the restore: the disks' newest
    is restored, and their checkpoints are queued for upload again saying that the remote could
    not be listed (it said "which a stop cut off", of checkpoints the remote held)."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    out = _run(
        tmp_path,
        "second",
        2,
        "--steps",
        "4",
        RC_SCAN_FAILS_AFTER=1,
        RC_CAPTURE_LOG=1,
        RC_OUTAGE_S=5,
    )
    for rank in out:
        assert rank[0]["restored"] == 4, rank
    log = out[0][-1]["log"]
    assert "again: the remote could not be listed to tell if it has it" in log, log
    assert "which a stop cut off" not in log, log


@pytest.mark.slow
def test_a_listing_that_fails_at_construction_goes_on_from_the_disks(tmp_path):
    """The disks hold the run; the store answers the preflight's probe but fails the listing
    at construction. That failure read as the node's directory being unusable ("could not be
    opened"), on every restart until the store came back. As after a preflight that got no
    answer, the job now goes on from the disks, with a warning that names the listing."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    out = _run(
        tmp_path,
        "second",
        2,
        "--steps",
        "4",
        RC_SCAN_FAILS_AFTER=0,
        RC_CAPTURE_LOG=1,
        RC_OUTAGE_S=2,
    )
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    log = out[0][-1]["log"]
    assert "listing" in log and "holds checkpoints: going on with them" in log, log


@pytest.mark.slow  # suite time budget: a close through an outage of the listings
def test_a_restart_that_cannot_list_the_store_does_not_commit_its_checkpoints_twice(tmp_path):
    """The store fails every listing of the restart (an outage at the requeue): the disks'
    checkpoints are uploaded again, not knowing which the store has. Each node took the
    manifest it found under step_000000002 and step_000000004 for another writer's ("the
    checkpoint goes under another name"), and the coordinator committed both a second time, as
    step_000000002-r1 and step_000000004-r1. A node now sees that the manifest there is this
    checkpoint's (its key, and its part's files as they are) and uploads nothing; the
    coordinator takes it as committed."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    out = _run(tmp_path, "second", 2, "--steps", "6", RC_SCAN_FAILS_AFTER=0, RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    assert all(rank[-1]["event"] == "closed" for rank in out), out
    assert "another name" not in out[0][-1]["log"] + out[1][-1]["log"]
    store = RemoteStore(f"file://{tmp_path}/remote")
    committed = sorted(e.name for e in store.scan() if e.manifest is not None)
    assert committed == ["step_000000002", "step_000000004", "step_000000006"], committed


def test_remote_checkpoints_whose_manifest_cannot_be_read_are_no_fresh_start(tmp_path):
    """Every node replaced (empty disks), the run's remote manifests listed but damaged: the
    restore kept only the remote checkpoints it could read, found none, and started from step
    0 without a word beside them (as shared mode did before). Now it refuses, naming each."""
    _committed_then_both_disks_wiped(tmp_path)
    for m in (tmp_path / "remote").glob("step_*/manifest.json"):
        m.write_text("{torn")
    out = _run(tmp_path, "second", 2, "--steps", "6", expect=4)
    for rank in out:
        assert rank[-1]["error"] == "NoValidCheckpointError", rank
        said = rank[-1]["msg"]
        assert said.index("step_000000004") < said.index("step_000000002"), said  # newest first
        assert said.count("unreadable manifest") == 2, said


def test_a_resave_never_takes_the_name_of_a_remote_checkpoint_it_cannot_read(tmp_path):
    """Every node replaced, the newest remote manifest of a format this version refuses (a
    newer library wrote it): the restore falls back to the step before and the run saves the
    newest step again. The coordinator gave the re-save that name: each node uploaded its files
    over the unreadable copy's and the commit replaced its manifest. Now it takes another name
    and numbers after it; the unreadable copy stays as it was."""
    _committed_then_both_disks_wiped(tmp_path)
    newest = tmp_path / "remote" / "step_000000004"
    m = json.loads((newest / "manifest.json").read_text())
    (newest / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    before = {p: p.read_bytes() for p in newest.rglob("*") if p.is_file()}
    out = _run(tmp_path, "second", 2, "--steps", "4")
    assert [rank[0]["restored"] for rank in out] == [2, 2], out
    assert {p: p.read_bytes() for p in newest.rglob("*") if p.is_file()} == before
    again = RemoteStore(f"file://{tmp_path}/remote").scan()
    (resaved,) = [e for e in again if e.name == "step_000000004-r1"]
    assert resaved.problem is None and resaved.manifest.seq > m["seq"], resaved


@pytest.mark.slow  # suite time budget: the test above proves the fix
def test_remote_manifests_a_read_failed_on_are_named_and_a_torn_newest_is_skipped_loudly(
    tmp_path,
):
    """As above, with the store failing the manifests' reads (the listing answered): an
    error naming them, not a fresh start. Then the store answers, but the newest remote
    checkpoint lacks an object: the restore took the step before without a word about it;
    now it says what it skipped and why."""
    _committed_then_both_disks_wiped(tmp_path)
    out = _run(tmp_path, "second", 2, "--steps", "6", expect=4, RC_MANIFEST_READS_FAIL=1)
    for rank in out:
        assert rank[-1]["error"] == "NoValidCheckpointError", rank
        assert "step_000000004" in rank[-1]["msg"] and "does not answer" in rank[-1]["msg"]
    (tmp_path / "remote" / "step_000000004" / "rank_00001.safetensors").unlink()
    out = _run(tmp_path, "third", 2, "--steps", "4", RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [2, 2], out
    log = out[0][-1]["log"]
    assert "skipping step 4" in log and "rank_00001.safetensors" in log, log


@pytest.mark.slow
def test_close_gives_up_on_an_outage_in_node_local_mode_and_raises(tmp_path):
    """Every upload fails: close() gives up once the (lowered) outage limit passed (it used to
    wait forever), the parts stay local, and, as in shared mode, close() raises
    UploadIncompleteError on every node's leader: the coordinator names each checkpoint not
    committed remotely, node 1 its own parts. It only warned: the job exited 0 with its
    newest checkpoints on the nodes' disks only."""
    out = _run(tmp_path, "outage", 2, "--steps", "4", expect=5, RC_UPLOADS_FAIL=1, RC_OUTAGE_S=2)
    for rank in out:
        assert rank[-1]["event"] == "close raised", rank
        assert rank[-1]["error"] == "UploadIncompleteError", rank
        assert "step_000000004" in rank[-1]["pending"], rank
        assert "run the job again with the same directories" in rank[-1]["msg"], rank
        assert rank[-2]["status"]["pending"] >= 1 and rank[-2]["status"]["uploaded"] == 0
    assert "never committed remotely" in out[0][-1]["msg"]
    assert "node 1's part of" in out[1][-1]["msg"]
    assert any(n.startswith("step_") for n in os.listdir(tmp_path / "node0"))


def test_an_unreachable_remote_at_construction_is_remote_unavailable_on_every_rank(tmp_path):
    """As in shared mode (docs/remote.md): RemoteUnavailableError, a ConnectionError, on every
    rank (node-local mode raised CheckpointWriteError, which a retry on ConnectionError
    missed)."""
    out = _run(tmp_path, "down", 2, "--steps", "2", expect=4, RC_PREFLIGHT_FAILS=1)
    for rank in out:
        assert rank[-1] == {"error": "RemoteUnavailableError", "is_connection_error": True}


def test_a_job_restarted_during_an_outage_goes_on_from_the_nodes_disks(tmp_path):
    """Both nodes' disks hold the run, the store refuses connections when the job is requeued:
    node-local mode's preflight raised, so the job failed at every restart until the store
    came back. As in shared mode (docs/remote.md) it now goes on with a warning: the restore
    falls back to the disks, loudly, and the uploads are retried."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    down = {"RC_PREFLIGHT_FAILS": "refused", "RC_SCAN_FAILS_AFTER": 0}
    out = _run(tmp_path, "second", 2, "--steps", "6", RC_CAPTURE_LOG=1, RC_OUTAGE_S=2, **down)
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    for rank in out:
        assert "holds checkpoints: going on with them" in rank[-1]["log"], rank
    assert "the remote tier cannot be listed" in out[0][-1]["log"]


@pytest.mark.slow  # suite time budget: the cases that raise, as before
def test_an_outage_at_restart_still_raises_for_an_empty_disk_or_a_configuration_error(tmp_path):
    """What the preflight still refuses, on every rank: a store that cannot be reached while
    one node's disk is empty (a node replaced: it has nothing to go on from), and an answer
    that says the configuration is wrong (credentials refused), disks full or not."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    out = _run(tmp_path, "denied", 2, "--steps", "6", expect=4, RC_PREFLIGHT_FAILS="denied")
    for rank in out:
        assert rank[-1] == {"error": "RemoteUnavailableError", "is_connection_error": True}
    shutil.rmtree(tmp_path / "node1")
    out = _run(tmp_path, "replaced", 2, "--steps", "6", expect=4, RC_PREFLIGHT_FAILS="refused")
    for rank in out:
        assert rank[-1] == {"error": "RemoteUnavailableError", "is_connection_error": True}


def test_local_retention_catches_up_with_the_uploads(tmp_path):
    """keep_last=3 on each node while uploads lag behind the saves (each made slow): the
    checkpoints kept for their upload go once it is done, so after close() each disk holds 3,
    as in shared mode (they stayed: a disk grew with the upload backlog)."""
    out = _run(tmp_path, "slow", 2, "--steps", "14", RC_SLOW_UPLOADS=0.3, RC_HOLD_LAST_UPLOAD=1)
    for rank in out:
        assert rank[-1]["event"] == "closed", rank
        assert rank[-2]["status"]["pending"] >= 1  # at flush(), before close() waits for them
    for node in (0, 1):
        kept = sorted(n for n in os.listdir(tmp_path / f"node{node}") if n.startswith("step_"))
        assert kept == ["step_000000010", "step_000000012", "step_000000014"], (node, kept)


@pytest.mark.slow  # suite time budget
def test_close_names_the_checkpoints_whose_remote_commit_was_given_up(tmp_path):
    """Both nodes upload their parts, then every remote commit fails: the committer gives up,
    and close() says which checkpoints are on the nodes' disks only (it said nothing, as if
    they were durable); a later run with the same directories commits them. Its error says
    the commits were given up after their attempts, not that the store failed for 5 minutes."""
    out = _run(
        tmp_path, "fails", 2, "--steps", "4", expect=None, RC_COMMIT_FAILS=1, RC_CAPTURE_LOG=1
    )
    assert out[0][-1]["event"] == "close raised" and "step_000000004" in out[0][-1]["pending"]
    assert out[1][-1]["event"] == "closed"  # its part is uploaded: the coordinator raises
    msg = out[0][-1]["msg"]  # (it said the store failed for more than 300 s: a second here)
    assert "failed 2 time(s), given up" in msg and "for more than" not in msg, msg
    log = out[0][-1]["log"]
    assert "not committed remotely (the remote commit failed" in log, log
    assert "step_000000004" in log.split("the remote commit failed")[-1]
    assert not os.path.exists(tmp_path / "remote" / "step_000000004" / "manifest.json")
    _run(tmp_path, "again", 2, "--steps", "4")
    assert os.path.exists(tmp_path / "remote" / "step_000000004" / "manifest.json")


@pytest.mark.slow
def test_a_remote_commit_given_up_before_a_newer_one_committed_fails_no_job(tmp_path):
    """The remote commit of step 2 failed (a blip of the store mid-training, given up after
    its attempts); steps 4 and 6 committed remotely after it. close() raised
    UploadIncompleteError for step 2 on rank 0: a job whose newest checkpoint is durable
    exited 1 (shared mode's uploader skips such a checkpoint). It is named in the log, and
    close() raises only for checkpoints newer than the run's newest remote commit."""
    out = _run(tmp_path, "blip", 2, "--steps", "6", RC_COMMIT_FAILS="first", RC_CAPTURE_LOG=1)
    assert [rank[-1]["event"] for rank in out] == ["closed", "closed"], out
    log = out[0][-1]["log"]
    assert "remote commit of step_000000002 given up" in log, log
    committed = {e.name for e in RemoteStore(f"file://{tmp_path}/remote").scan() if e.manifest}
    assert "step_000000006" in committed, committed


def test_close_gives_up_on_a_remote_commit_that_never_answers(tmp_path):
    """The store stops answering the coordinator's remote commit (an attempt that never
    returns, as against an endpoint that accepts connections and goes silent): close() says
    what it waits for, gives up once the (lowered) outage limit passed, names what is not
    committed remotely, and keeps it on the disks; a later run commits it. close() waited
    for the committer without a bound (and without a word): the job hung at exit."""
    env = {"RC_COMMIT_HANGS": 1, "RC_OUTAGE_S": 2, "RC_CAPTURE_LOG": 1}
    out = _run(tmp_path, "hangs", 2, "--steps", "4", expect=None, **env)
    assert out[0][-1]["event"] == "close raised", out  # UploadIncompleteError, exit 5
    assert out[0][-1]["error"] == "UploadIncompleteError", out
    assert "step_000000004" in out[0][-1]["pending"], out  # (and step 2: hung too)
    assert out[1][-1]["event"] == "closed", out  # its part is uploaded
    log = out[0][-1]["log"]
    waited = next(ln for ln in log.splitlines() if "close(): waiting for the remote commit" in ln)
    assert "step_000000004" in waited, log
    assert "close(): not committed remotely (the store has not answered" in log, log
    assert not list((tmp_path / "remote").glob("step_*/manifest.json"))
    assert (tmp_path / "node0" / "step_000000004" / "remote_manifest.json").is_file()
    _run(tmp_path, "again", 2, "--steps", "4")
    assert (tmp_path / "remote" / "step_000000004" / "manifest.json").is_file()


def test_a_final_save_of_a_step_saved_already_is_committed_remotely(tmp_path):
    """remote_every_n_saves=10 and the last step saved by the schedule: the final save()
    that follows finds the step saved and writes nothing, but the remote tier takes it (it
    held only older checkpoints, here none)."""
    _run(tmp_path, "last", 2, "--steps", "6", "--remote-every", "10", RC_FINAL_SAVE=1)
    remote = sorted(n for n in os.listdir(tmp_path / "remote") if n.startswith("step_"))
    assert remote == ["step_000000006"], remote
    assert os.path.exists(tmp_path / "remote" / "step_000000006" / "manifest.json")
    for node in (0, 1):
        assert len([n for n in os.listdir(tmp_path / f"node{node}") if n.startswith("step_")]) == 3


def test_the_global_manifest_kept_beside_a_nodes_checkpoint_is_durable(tmp_path):
    """After a kill or a power loss, ``remote_manifest.json`` next to node 0's checkpoint must
    be whole (the restart's remote commit of that checkpoint reads it): it is renamed into
    place (written in place, a kill could leave it empty) and its folder fsynced after."""
    recs = _run(tmp_path, "sync", 2, "--steps", "4", RC_RECORD_SYNC=1)
    ops = next(r["synced"] for r in recs[0] if "synced" in r)
    writes = [
        i
        for i, op in enumerate(ops)
        if op.startswith("write ") and op.endswith("/remote_manifest.json")
    ]
    assert writes, ops
    for i in writes:
        folder = os.path.dirname(ops[i].split(" ", 1)[1])
        assert f"fsync {folder}" in ops[i + 1 :], (ops[i], ops[i:])


def test_a_torn_global_manifest_beside_a_nodes_checkpoint_does_not_fail_the_restart(tmp_path):
    """A kill while ``remote_manifest.json`` was written in place (before it was renamed into
    place) left it empty; the restart handed the empty text to the remote committer, whose
    background work then failed every save with a JSONDecodeError (and every restart the
    same). Now that checkpoint stays local with a warning, and the run goes on."""
    _run(tmp_path, "first", 2, "--steps", "4", "--kill-at", "4", expect=-9, RC_UPLOADS_FAIL=1)
    torn = [p for p in (tmp_path / "node0").glob("step_*/remote_manifest.json")]
    assert torn
    for p in torn:
        p.write_bytes(b"")
    out = _run(tmp_path, "second", 2, "--steps", "6", RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    assert "remote_manifest.json cannot be read" in out[0][-1]["log"], out[0][-1]["log"]
    found = RemoteStore((tmp_path / "remote").as_uri()).scan()
    remote = [e.manifest.step for e in found if e.manifest is not None]
    assert 6 in remote, remote


@pytest.mark.slow  # suite time budget
def test_a_damaged_local_copy_is_fetched_again_by_its_node_only(tmp_path):
    """A byte flipped in node 1's copy of the newest checkpoint: the restore falls back to
    the same commit from the remote tier, which node 1 downloads while node 0 keeps using its
    own copy, which verifies (every node downloaded it, and left a second folder of it)."""
    _run(tmp_path, "first", 2, "--steps", "4")
    newest = tmp_path / "node1" / "step_000000004"
    _flip_a_byte(newest)
    out = _run(tmp_path, "again", 2, "--steps", "4")
    assert [rank[0]["restored"] for rank in out] == [4, 4]
    names = {n: sorted(os.listdir(tmp_path / f"node{n}")) for n in (0, 1)}
    assert "step_000000004-1" in names[1], names  # its fetched copy (the damaged one is kept)
    assert not [x for x in names[0] if x.startswith("step_000000004-")], names


def test_resume_of_a_step_whose_local_copy_is_damaged_fetches_it_again(tmp_path):
    """``resume=4`` with node 1's copy of step 4 damaged: node 1 fetches step 4 from the remote
    tier, as ``resume="auto"`` does, loudly (it raised CheckpointCorruptError on the local
    copy without trying the remote one, which was whole)."""
    _run(tmp_path, "first", 2, "--steps", "4")
    _flip_a_byte(tmp_path / "node1" / "step_000000004")
    out = _run(tmp_path, "again", 2, "--steps", "4", RC_RESUME=4, RC_CAPTURE_LOG=1)
    assert [rank[0].get("restored") for rank in out] == [4, 4], out
    log = out[0][-1]["log"]
    assert "skipping step 4 (commit 2) on 2 nodes" in log and "checksum mismatch" in log, log


def _newest_commit(folder: Path) -> Path:
    """The checkpoint folder under ``folder`` whose manifest has the highest commit number."""
    found = [
        (json.loads(m.read_text())["seq"], m.parent) for m in folder.glob("step_*/manifest.json")
    ]
    return max(found)[1]


@pytest.mark.slow
def test_after_a_roll_back_a_damaged_new_branch_falls_back_to_its_parent(tmp_path):
    """Saved 2..8, resumed from 4 on purpose, saved 6 again (a new branch; 6 and 8 abandoned):
    keep_last=3 kept 6, 8 and the new 6 and deleted 4, and with the new 6 damaged everywhere
    the next restore took the abandoned 8. Now 4 is kept, and restored."""
    _run(tmp_path, "first", 2, "--steps", "8")
    out = _run(tmp_path, "back", 2, "--steps", "6", RC_RESUME=4)
    assert [rank[0]["restored"] for rank in out] == [4, 4]
    for where in (tmp_path / "node0", tmp_path / "node1", tmp_path / "remote"):
        assert (where / "step_000000004").is_dir(), sorted(os.listdir(where))
        _flip_a_byte(_newest_commit(where))
    out = _run(tmp_path, "again", 2, "--steps", "6")
    assert [rank[0]["restored"] for rank in out] == [4, 4]


@pytest.mark.slow
def test_after_a_roll_back_a_short_new_branch_falls_back_to_its_parent(tmp_path):
    """As above, with the new 6 cut short everywhere (a size the manifest does not list): the
    nodes and the remote left it out of the lineage they reported, so nothing said the run had
    rolled back, and the restore took the abandoned 8 silently. Now 4."""
    _run(tmp_path, "first", 2, "--steps", "8")
    _run(tmp_path, "back", 2, "--steps", "6", RC_RESUME=4)
    for where in (tmp_path / "node0", tmp_path / "node1", tmp_path / "remote"):
        head = _newest_commit(where)
        victim = max((p for p in head.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[:-1])
    out = _run(tmp_path, "again", 2, "--steps", "6")
    assert [rank[0]["restored"] for rank in out] == [4, 4]


def test_a_replaced_node_and_a_damaged_copy_on_the_other_are_recorded_as_they_happened(
    tmp_path,
):
    """Node 0's disk lost, node 1's copy of the newest checkpoint damaged: each node downloads
    it once (node 0 downloaded it twice, for the first try and for the retry from the remote,
    and kept both), and the history's restart record says remote, 1 fallback, and a restore
    time within the process's life (it said local, 0, and the machine's uptime)."""
    _run(tmp_path, "first", 2, "--steps", "4")
    newest = tmp_path / "node1" / "step_000000004"
    _flip_a_byte(newest)
    shutil.rmtree(tmp_path / "node0")
    began = time.monotonic()
    out = _run(tmp_path, "again", 2, "--steps", "4")
    lived = time.monotonic() - began
    assert [rank[0]["restored"] for rank in out] == [4, 4]
    assert [n for n in os.listdir(tmp_path / "node0") if n.startswith("step_")] == [
        "step_000000004"
    ]
    # the fetched copy says it was committed on every node (the global manifest beside it): a
    # coordinator's copy without one is taken for a save cut off before that
    assert (tmp_path / "node0" / "step_000000004" / "remote_manifest.json").is_file()
    history = [
        json.loads(x) for x in (tmp_path / "node0" / "history.jsonl").read_text().splitlines()
    ]
    restart = next(r for r in history if r["event"] == "restart")
    assert restart["tier"] == "remote" and restart["fallbacks"] == 1, restart
    assert 0 <= restart["seconds"] <= lived, (restart, lived)


@pytest.mark.slow  # suite time budget
def test_nodes_whose_manifests_disagree_on_the_step_resume_together(tmp_path):
    """Node 1's manifest of the newest checkpoint says another step (a manifest without its
    own checksum, as older versions wrote): the ranks resumed at different steps and hung.
    Now that node's copy is not used: it is fetched again from the remote, and both resume
    at the same step."""
    from resilient_callbacks.manifest import SELF_CHECKSUM

    _run(tmp_path, "first", 2, "--steps", "4")
    path = tmp_path / "node1" / "step_000000004" / "manifest.json"
    m = json.loads(path.read_text())
    del m[SELF_CHECKSUM]
    m["step"] = 5
    path.write_text(json.dumps(m))
    out = _run(tmp_path, "again", 2, "--steps", "6")
    assert [rank[0]["restored"] for rank in out] == [4, 4]
    assert all(rank[-1]["event"] == "closed" for rank in out)


@pytest.mark.slow
def test_more_ranks_per_node_resume_a_rank0_per_rank_state(tmp_path):
    """Saved by 2 ranks (one per node), resumed by 4 (two per node): ranks 2 and 3 have no
    files in the checkpoint and read rank 0's PerRank state, which each node now fetches."""
    _run(tmp_path, "first", 2, "--steps", "4")
    out = _run(tmp_path, "grown", 4, "--steps", "6", per_node=2)
    assert [rank[0]["restored"] for rank in out] == [4, 4, 4, 4]
    assert [rank[0]["counter_rank"] for rank in out] == [0, 1, 0, 0]


@pytest.mark.parametrize("first", [True, False], ids=["first-save", "later-save"])
def test_a_save_cut_off_after_one_nodes_commit_is_no_checkpoint(tmp_path, first):
    """Node 1 is killed in its local commit of a save, after node 0 committed its part: the
    coordinator never recorded that save as committed on every node, so the re-run removes
    node 0's part and resumes from the save before (or starts afresh: it was the first save;
    the restore refused to start, run after run). Node 0's part no longer takes a keep_last
    place: both nodes keep the same checkpoints."""
    die = 2 if first else 6
    kill = {"RC_DIE_IN_COMMIT_AT": die}
    _run(tmp_path, "first", 2, "--steps", str(die), expect=None, **kill)  # rank 0 fails too
    assert (tmp_path / "node0" / f"step_{die:09d}").is_dir()  # node 0's part, never recorded
    out = _run(tmp_path, "second", 2, "--steps", "10", RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [die - 2] * 2
    assert "was never committed on every node" in out[0][-1]["log"]

    def kept(node: int) -> list[tuple[int, int]]:
        entries = catalog.scan(str(tmp_path / f"node{node}"), catalog.Depth.FULL)
        return sorted((e.manifest.step, e.manifest.seq) for e in entries if e.manifest)

    assert kept(0) == kept(1) and len(kept(0)) == 3, (kept(0), kept(1))


def test_every_node_keeps_the_best_checkpoint_by_rank_0s_metrics(tmp_path):
    """keep_best with a metric each rank computes for itself (an unreduced loss): rank 0's is
    best at step 2, rank 1's at the newest. Each node's leader wrote its own rank's metrics into
    its part, so node 1's retention deleted its part of step 2, the run's best by the global
    manifest (rank 0's, as in shared mode): the nodes kept different checkpoints and a
    roll-back to the best found no copy of node 1's files. Every node's part now records rank
    0's metrics, and the nodes keep the same checkpoints."""
    _run(
        tmp_path,
        "first",
        2,
        "--steps",
        "8",
        "--remote-every",
        "100",
        RC_KEEP_BEST=1,
        RC_KEEP_LAST=1,
    )

    def kept(node: int) -> list[tuple[int, dict]]:
        entries = catalog.scan(str(tmp_path / f"node{node}"), catalog.Depth.FULL)
        return sorted((e.manifest.step, e.manifest.metrics) for e in entries if e.manifest)

    assert kept(0) == kept(1) == [(2, {"loss": 2.0}), (8, {"loss": 8.0})], (kept(0), kept(1))
    out = _run(
        tmp_path,
        "best",
        2,
        "--steps",
        "8",
        "--remote-every",
        "100",
        RC_KEEP_BEST=1,
        RC_KEEP_LAST=1,
        RC_RESUME=2,
    )
    assert [rank[0]["restored"] for rank in out] == [2, 2], out


def test_uploads_a_crash_cut_off_are_committed_by_the_next_run(tmp_path):
    """Node 1 uploads slowly; node 0 uploaded its parts and pruned them (keep_last=3) while
    their remote commits still waited for node 1; both nodes are killed. The re-run uploads
    node 1's parts again, but node 0's copies, which held the global manifests, were gone: no
    remote commit came, and the objects lay uncommitted. Node 0 now keeps its copy until the
    checkpoint is committed remotely."""
    _run(
        tmp_path,
        "first",
        2,
        "--steps",
        "10",
        "--kill-at",
        "10",
        expect=-9,
        RC_SLOW_UPLOADS=2,
        RC_SLOW_NODE=1,
    )
    _run(tmp_path, "second", 2, "--steps", "10")
    remote = tmp_path / "remote"
    uncommitted = sorted(
        p.name for p in remote.glob("step_*") if not (p / "manifest.json").exists()
    )
    assert uncommitted == [], sorted(os.listdir(remote))


@pytest.mark.slow  # suite time budget: 12 checkpoint loads
def test_older_checkpoints_are_tried_after_more_than_four_damaged_ones(tmp_path):
    """The four newest checkpoints damaged on node 1's disk and in the remote (8 candidates:
    each from the disks, then from the remote): the restore tried only the 8 newest
    candidates, then raised NoValidCheckpointError though step 4 was whole everywhere (shared
    mode tries every checkpoint). It falls back to step 4, loudly."""
    _run(tmp_path, "first", 2, "--steps", "12", RC_KEEP_LAST=6)
    for step in (6, 8, 10, 12):
        _flip_a_byte(tmp_path / "node1" / f"step_{step:09d}")
        _flip_a_byte_of(tmp_path / "remote" / f"step_{step:09d}" / "rank_00001.safetensors")
    out = _run(tmp_path, "again", 2, "--steps", "12", RC_KEEP_LAST=6)
    assert [rank[0].get("restored") for rank in out] == [4, 4], out


def test_a_damaged_remote_copy_is_downloaded_once(tmp_path):
    """Node 1's disk lost, its object of the newest remote checkpoint rotten: node 1 falls back
    to the step before; it downloaded the rotten copy twice (once per candidate of that
    commit)."""
    _run(tmp_path, "first", 2, "--steps", "4")
    shutil.rmtree(tmp_path / "node1")
    _flip_a_byte_of(tmp_path / "remote" / "step_000000004" / "rank_00001.safetensors")
    out = _run(tmp_path, "again", 2, "--steps", "4", RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [2, 2]
    log = out[1][-1]["log"]
    assert log.count("file(s) of step 4 from the remote copy") == 1, log


@pytest.mark.slow  # suite time budget: it checks a message
def test_a_resume_on_fewer_nodes_says_the_missing_files_are_another_nodes(tmp_path):
    """Saved on 2 nodes, resumed with both ranks on node 0: rank 1 found no files of its own in
    node 0's part and the warning said "the manifest does not list rank_00001.json", as of a
    damaged checkpoint. It says the part is one node's, where rank 1's files are, and that the
    remote copy that replaces it resumes exactly."""
    _run(tmp_path, "first", 2, "--steps", "4")  # closed: committed remotely
    out = _run(tmp_path, "second", 2, "--steps", "6", per_node=2, RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [4, 4]
    log = out[0][-1]["log"]
    assert "does not list" not in log, log
    assert "one node's part of a checkpoint saved by 2 ranks on 2 nodes" in log, log
    assert "rank 1's are on another node's disk" in log and "is exact" in log, log


def test_the_cli_says_a_nodes_directory_holds_parts(tmp_path, capsys):
    """ls and verify of one node's directory called its parts plain 'valid' checkpoints, and
    report said the directory was not one a Checkpointer wrote; inspect showed one node's
    files (rank 1's of a world size of 2) without saying why."""
    from resilient_callbacks.cli import main

    _run(tmp_path, "run", 2, "--steps", "4")
    node1 = str(tmp_path / "node1")
    for command in (["ls", node1], ["verify", node1], ["inspect", node1]):
        assert main(command) == 0
        out = capsys.readouterr().out
        assert (
            "node-local: each checkpoint here is one node's part (the files of rank(s) 1 of 2"
            in out
        )
    assert main(["ls", node1, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["node_part"] for r in rows] == [{"ranks": [1], "nodes": 2, "world_size": 2}] * 2
    assert main(["report", node1]) != 0
    assert "history is kept on rank 0's node" in capsys.readouterr().err


def test_a_file_that_rotted_on_a_nodes_disk_is_never_committed_remotely(tmp_path):
    """Node 1's file of step 2 rots after its local commit, before its upload: the upload
    checks the bytes against the manifest, so step 2 is never committed remotely (it was, with
    the rotten object, and then called durable); step 4 is."""
    out = _run(tmp_path, "run", 2, "--steps", "4", RC_ROT_BEFORE_UPLOAD=1, RC_CAPTURE_LOG=1)
    assert "its local copy is damaged" in out[1][-1]["log"], out[1][-1]["log"]
    store = RemoteStore(f"file://{tmp_path}/remote")
    committed = {e.manifest.step for e in store.scan() if e.manifest is not None}
    assert committed == {4}


def test_a_sigterm_no_step_acts_on_ends_every_rank_with_75_its_checkpoints_kept(tmp_path):
    """Both nodes get SIGTERM after their last step() (with several ranks a signal waits for
    the next decision step, where the ranks agree to stop: up to ~1 s of steps, so a run can
    end first; the last step stands for it here). close() finished the uploads and the remote
    commit, then passed the signal on to the default handler: every rank died of it (-15), which
    a scheduler takes for a crash. Now each rank exits 75 once closed; the checkpoints are
    kept, and the restart resumes from the last one, committed on both nodes and remotely."""
    out = _run(tmp_path, "first", 2, "--steps", "6", expect=75, RC_SIGTERM_AT=6)
    for rank in out:
        assert rank[-1]["status"] is not None, rank  # (the log: printed at close, not reached)
    for r in (0, 1):
        said = (tmp_path / f"first.attempt0.rank{r}.log").read_text()
        assert "after the last step() that could act on it" in said, said[-3000:]
        assert "exiting with code 75" in said, said[-3000:]
    assert (tmp_path / "remote" / "step_000000006" / "manifest.json").exists()
    out = _run(tmp_path, "again", 2, "--steps", "6")
    assert [rank[0]["restored"] for rank in out] == [6, 6], out


@pytest.mark.slow
def test_push_refuses_one_nodes_part_of_a_node_local_checkpoint(tmp_path, capsys):
    from resilient_callbacks.cli import main

    _run(tmp_path, "first", 2, "--steps", "4")
    for node in (0, 1):  # each node's advisory pointer names its newest checkpoint
        assert (tmp_path / f"node{node}" / "latest").read_text().strip() == "step_000000004"
    other = tmp_path / "other"
    assert main(["push", str(tmp_path / "node0"), f"file://{other}", "--json"]) == 1
    done = json.loads(capsys.readouterr().out)
    assert done["pushed"] == [] and len(done["skipped"]) >= 1
    assert "one node's part" in done["skipped"][0]["problem"]


# ---------------------------------------------------------------------------- one rank


def worker(base: str, argv: list[str]) -> None:
    import argparse
    import datetime

    import torch
    import torch.distributed as dist

    from resilient_callbacks import Checkpointer, PerRank, checkpointer, remote, remote_put

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int)
    p.add_argument("--remote-every", type=int)
    p.add_argument("--kill-at", type=int)
    a = p.parse_args(argv)
    synced: list[str] = []  # RC_RECORD_SYNC: "write <path>" / "fsync <path>", in order
    if os.environ.get("RC_RECORD_SYNC"):
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            synced.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}")
            return real_fsync(fd)

        def replace(src, dst, **kw):
            real_replace(src, dst, **kw)
            synced.append(f"write {os.path.realpath(dst)}")

        os.fsync, os.replace = fsync, replace
    status_taken = threading.Event()  # RC_HOLD_LAST_UPLOAD: the last step's upload waits for it
    pids: list[int] = []  # every rank's, for a SIGTERM to the job (the scheduler's)

    def sigterm_every_rank() -> None:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)

    if os.environ.get("RC_SCAN_FAILS_AFTER"):  # the store stops answering after the preflight
        real, calls = remote.RemoteStore.scan, [0]

        def scan(self):
            calls[0] += 1
            if calls[0] > int(os.environ["RC_SCAN_FAILS_AFTER"]):
                raise ConnectionError("the store does not answer")
            return real(self)

        remote.RemoteStore.scan = scan  # type: ignore[method-assign]
    if os.environ.get("RC_SCAN_HANGS_AFTER"):  # the store stops answering; SIGTERM comes
        real_scan, scans = remote.RemoteStore.scan, [0]

        def hanging_scan(self):
            scans[0] += 1
            if scans[0] <= int(os.environ["RC_SCAN_HANGS_AFTER"]):
                return real_scan(self)
            sigterm_every_rank()
            threading.Event().wait(60)  # (the old code waited the outage limit, then went on)
            raise ConnectionError("the store never answered")

        remote.RemoteStore.scan = hanging_scan  # type: ignore[method-assign]
    if os.environ.get("RC_MANIFEST_READS_FAIL"):  # listed, but the store fails their reads

        def reads_fail(self, names, signs, hints=None):
            return {n: ConnectionError("the store does not answer") for n in names}

        remote.RemoteStore._read_manifests = reads_fail  # type: ignore[method-assign]
    if os.environ.get("RC_OUTAGE_S"):
        checkpointer.CLOSE_OUTAGE_S = float(os.environ["RC_OUTAGE_S"])
    pg_timeout = float(os.environ.get("RC_PG_TIMEOUT_S", 60))  # (far beyond the deadline: a
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout))  # hang fails)
    rank = dist.get_rank()
    pids[:] = [None] * dist.get_world_size()  # (the scheduler's SIGTERM reaches every rank)
    dist.all_gather_object(pids, os.getpid())
    node = rank // int(os.environ["RC_PER_NODE"])

    def out(**kw) -> None:
        print("OUT " + json.dumps(kw), flush=True)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    counter = {"rank": rank, "n": 0}
    state = {"model": model, "c": PerRank(counter, new_ranks="rank0")}
    kw = {"remote_every_n_saves": a.remote_every} if a.remote_every else {}
    if os.environ.get("RC_RESUME"):  # a roll-back to an older step
        kw["resume"] = int(os.environ["RC_RESUME"])
    if os.environ.get("RC_REPLICAS"):
        kw["replicas"] = int(os.environ["RC_REPLICAS"])
    if "RC_ASYNC_SAVE" in os.environ:  # "": synchronous saves
        kw["async_save"] = bool(os.environ["RC_ASYNC_SAVE"])
    if os.environ.get("RC_COMPRESSION"):
        kw["compression"] = os.environ["RC_COMPRESSION"]
    if os.environ.get("RC_KEEP_EVERY"):  # archive points
        kw["keep_every_n_steps"] = int(os.environ["RC_KEEP_EVERY"])
    if os.environ.get("RC_KEEP_BEST"):  # each rank's own loss: rank 0's falls, rank 1's rises
        kw.update(keep_best=1, monitor="loss")
    if os.environ.get("RC_PREFLIGHT_FAILS"):  # the endpoint does not answer at construction
        why = {"refused": ConnectionRefusedError(111, "Connection refused")}
        why["denied"] = PermissionError("The AWS Access Key Id you provided does not exist")

        def preflight(self, timeout=None):
            cause = why.get(os.environ["RC_PREFLIGHT_FAILS"])  # (none: no answer in time)
            raise remote.RemoteUnavailableError(f"{self.url}: endpoint unreachable") from cause

        remote.RemoteStore.preflight = preflight  # type: ignore[method-assign]
    if os.environ.get("RC_CAPTURE_LOG"):  # (from construction on)
        logged = io.StringIO()
        handler = logging.StreamHandler(logged)
        if os.environ.get("RC_LOG_LEVELS"):  # each line: its level, then the message
            handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logging.getLogger("resilient_callbacks").addHandler(handler)
        if os.environ.get("RC_LOG_INFO"):
            logging.getLogger("resilient_callbacks").setLevel(logging.INFO)
    try:
        ck = Checkpointer(
            os.path.join(base, f"node{node}"),
            every_n_steps=2,
            keep_last=int(os.environ.get("RC_KEEP_LAST", 3)),
            remote=f"file://{base}/remote",
            remote_timeout=5,
            **kw,
        )
    except Exception as e:
        out(error=type(e).__name__, is_connection_error=isinstance(e, ConnectionError))
        dist.destroy_process_group()
        sys.exit(4)
    if os.environ.get("RC_SECOND_WRITER"):  # another Checkpointer of this process, one remote
        try:
            Checkpointer(os.path.join(base, f"ema{node}"), remote=f"file://{base}/remote").close()
            out(second="opened")
        except Exception as e:
            out(second=type(e).__name__, said=str(e))
        ck.close()
        dist.destroy_process_group()
        return
    if os.environ.get("RC_UPLOADS_FAIL") or os.environ.get("RC_UPLOADS_FAIL_ON") == str(node):

        def put(*a, **k):
            raise ConnectionError("endpoint unreachable")

        remote_put.put = put  # (the store's put of a list of files)
    if os.environ.get("RC_GETS_HANG") == str(node):  # lists, then never sends a byte

        def hang(*a, **k):
            if os.environ.get("RC_HANG_SIGNALS"):  # and the scheduler's SIGTERM comes
                sigterm_every_rank()
            threading.Event().wait(20)  # (the old code waited this long, then failed)
            raise ConnectionError("the store never answered")

        ck._dir.remote.fs.get = hang  # type: ignore[union-attr]
    gets: list[list[str]] = []  # RC_GETS_FAIL_PARTWAY: each get's files, the first one cut
    if os.environ.get("RC_GETS_FAIL_PARTWAY") == str(node):
        from resilient_callbacks import stall

        stall.backoff_s = lambda *a, **k: 0.0  # (the next try at once: one is cut, by count)
        real_get = ck._dir.remote.fs.get  # type: ignore[union-attr]

        def get_fails_partway(rpath, lpath, *args, **k):
            if not isinstance(rpath, list):
                return real_get(rpath, lpath, *args, **k)
            gets.append([posixpath.basename(r) for r in rpath])
            if len(gets) > 1:
                return real_get(rpath, lpath, *args, **k)
            half = len(rpath) // 2  # whole files arrive, then the connection is reset
            real_get(rpath[:half], lpath[:half], *args, **k)
            if os.environ.get("RC_GETS_ROT"):  # a file of the right size with a wrong byte
                _flip_a_byte_of(Path(lpath[0]))
            raise ConnectionResetError(104, "Connection reset by peer")

        ck._dir.remote.fs.get = get_fails_partway  # type: ignore[union-attr]
    if os.environ.get("RC_SLOW_UPLOADS") and os.environ.get("RC_SLOW_NODE", str(node)) == str(
        node
    ):  # uploads lag behind the saves (on every node, or on RC_SLOW_NODE's)
        real_put, held = remote_put.put, []
        last = f"step_{a.steps:09d}"

        def slow_put(*args, **k):
            if os.environ.get("RC_HOLD_LAST_UPLOAD") and any(last in str(x) for x in args):
                status_taken.wait(60)  # pending at flush() whatever the machine's speed
            if os.environ.get("RC_HOLD_FIRST_UPLOAD_UNTIL") and not held:
                held.append(1)  # the first upload lasts until the node committed that step
                until = f"step_{int(os.environ['RC_HOLD_FIRST_UPLOAD_UNTIL']):09d}"
                mine = Path(base, f"node{node}")  # (that step's copy may be gone already)
                while not any(p.name >= until for p in mine.glob("step_*")):
                    time.sleep(0.05)
            time.sleep(float(os.environ["RC_SLOW_UPLOADS"]))
            return real_put(*args, **k)

        remote_put.put = slow_put  # (the store's put of a list of files)
    if os.environ.get("RC_ROT_BEFORE_UPLOAD") == str(node):  # a byte rots after the commit
        uploader, rotted = ck._dir.uploader, []  # type: ignore[union-attr]
        real_upload = uploader._upload

        def rot_then_upload(job):
            if not rotted:
                local = Path(uploader.local_root, job.local_name)
                sizes = {f.path: f.size for f in job.files}
                rotted.append(_flip_a_byte_of(local / max(sizes, key=sizes.__getitem__)))
            return real_upload(job)

        uploader._upload = rot_then_upload
    if node == 1 and os.environ.get("RC_DIE_IN_COMMIT_AT"):  # killed as its disk was slow
        die_at, real_commit = int(os.environ["RC_DIE_IN_COMMIT_AT"]), ck._dir.commit.commit

        def commit_or_die(staging, step, manifest, **kw):
            first = Path(base, "node0", f"step_{die_at:09d}", "manifest.json")
            while step == die_at and not first.exists():  # node 0 commits its part first
                time.sleep(0.05)
            if step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_commit(staging, step, manifest, **kw)

        ck._dir.commit.commit = commit_or_die
    if os.environ.get("RC_LOSE_FILE_AT"):  # "<node>:<step>:<file>": gone once committed
        # ("<file>/": a folder of that name, holding a file, takes its place)
        lose_node, lose_step, lose_file = os.environ["RC_LOSE_FILE_AT"].split(":")
        real_local_commit = ck._dir.commit.commit

        def commit_then_lose(staging, step, manifest, **kw):
            path = real_local_commit(staging, step, manifest, **kw)
            if node == int(lose_node) and step == int(lose_step) and lose_file.endswith("/"):
                os.makedirs(os.path.join(path, lose_file, "x"))  # a folder where a file goes
            elif node == int(lose_node) and step == int(lose_step):
                os.remove(os.path.join(path, lose_file))
            return path

        ck._dir.commit.commit = commit_then_lose
    if os.environ.get("RC_RETENTION_FAILS_AT"):  # "<node>:<step>[,<step>...]": its passes
        node_text, steps_text = os.environ["RC_RETENTION_FAILS_AT"].split(":")
        fail_node, fail_steps = int(node_text), {int(s) for s in steps_text.split(",")}
        real_retention_pass = ck._dir.apply_retention

        def retention_fails(protect, policy=None):
            if node == fail_node and protect in {f"step_{s:09d}" for s in fail_steps}:
                raise OSError(5, "Input/output error")
            return real_retention_pass(protect, policy)

        ck._dir.apply_retention = retention_fails
    if os.environ.get("RC_QUEUE_FAILS_AT"):  # "<node>:<step>": its upload queue refuses it
        node_text, step_text = os.environ["RC_QUEUE_FAILS_AT"].split(":")
        uploader_refusing = ck._dir.uploader  # type: ignore[union-attr]
        real_enqueue, refused = uploader_refusing.enqueue, f"step_{int(step_text):09d}"

        def enqueue_refusing(local_name, *args, **kw):
            if node == int(node_text) and local_name == refused:
                raise RuntimeError(f"the upload queue refused {local_name}")
            return real_enqueue(local_name, *args, **kw)

        uploader_refusing.enqueue = enqueue_refusing
    if os.environ.get("RC_RETENTION_DENIED") == str(node):  # every pass after an upload, close's
        real_pass = ck._dir.apply_retention

        def retention_denied(protect, policy=None):
            if protect is None:  # (the directory cannot be listed: 'chmod a-r' on it)
                raise PermissionError(13, "Permission denied", ck.dirpath)
            return real_pass(protect, policy)

        ck._dir.apply_retention = retention_denied
    if os.environ.get("RC_RECOVERY_DENIED") == str(node):  # its disk unreadable just then
        from resilient_callbacks import catalog as scanned

        real_scan, real_recover = scanned.scan, ck._dir.recover_uploads

        def denied_scan(root, *args, **kw):  # ('chmod a-r' on the folder; as root, too)
            raise PermissionError(13, "Permission denied", root)

        def recover_denied(remote_keys):
            scanned.scan = denied_scan  # type: ignore[assignment]
            try:
                return real_recover(remote_keys)
            finally:
                scanned.scan = real_scan  # type: ignore[assignment]

        ck._dir.recover_uploads = recover_denied
    if os.environ.get("RC_TRASH_DENIED", ":").split(":")[0] == str(node):  # "<node>:<name>"
        denied, real_rename = os.environ["RC_TRASH_DENIED"].split(":")[1], os.rename

        def rename(src, dst, *args, **kw):  # (a folder of that name its owner made read-only)
            if os.path.basename(str(src)) == denied and ".trash-" in str(dst):
                raise PermissionError(13, "Permission denied", str(src))
            return real_rename(src, dst, *args, **kw)

        os.rename = rename
        real_rmtree = shutil.rmtree  # RC_TRASH_STAYS: the trash of that one is not deleted

        def rmtree(path, *args, **kw):
            if f".trash-{os.environ.get('RC_TRASH_STAYS')}-" in str(path):
                return None  # (ignore_errors: a file in it that could not be removed)
            return real_rmtree(path, *args, **kw)

        shutil.rmtree = rmtree
    committer = getattr(ck._dir, "committer", None)
    if os.environ.get("RC_COMMIT_FAILS") and committer is not None:
        real_commit_one = committer.commit_one

        def fail(p):
            if os.environ["RC_COMMIT_FAILS"] == "first" and p.name != "step_000000002":
                return real_commit_one(p)  # (only the first checkpoint's commit fails)
            raise ConnectionError("the store refuses the manifest")

        committer.commit_one = fail
        committer.max_attempts, committer.retry_base_s = 2, 0.05
    if os.environ.get("RC_COMMIT_HANGS") and committer is not None:  # accepts, never answers
        committer.commit_one = lambda p: threading.Event().wait()
    retained = None
    if os.environ.get("RC_COMMIT_AFTER_FIRST_SAVE"):  # what the restore queued: committed after
        first, retained = threading.Event(), threading.Event()  # the first save's local commit
        real_committed = ck._dir.committed

        def committed(seq):
            real_committed(seq)
            first.set()

        ck._dir.committed = committed
        if committer is not None:
            real_one, real_retention = committer.commit_one, committer._retention

            def commit_one(p):
                assert first.wait(60)
                real_one(p)

            def retention(protect, run):
                real_retention(protect, run)
                retained.set()  # (killed at --kill-at once a remote commit's retention ran)

            committer.commit_one, committer._retention = commit_one, retention
    if os.environ.get("RC_REPLICA_FILE_GONE") and node == 0:  # as node 0 sends a replica
        from resilient_callbacks import peers

        real_exchange = peers.exchange

        def exchange_after_loss(send_dir, *args):
            if send_dir is not None and ".replicas" in send_dir:
                os.remove(os.path.join(send_dir, os.environ["RC_REPLICA_FILE_GONE"]))
            return real_exchange(send_dir, *args)

        peers.exchange = exchange_after_loss  # type: ignore[assignment]
    pieces: list[int] = []  # RC_REPLICA_CHUNK: the length of each piece of a file this node sent
    if os.environ.get("RC_REPLICA_CHUNK"):  # (RC_REPLICA_ROT: one byte flips in flight)
        from resilient_callbacks import peers

        peers.CHUNK_BYTES = int(os.environ["RC_REPLICA_CHUNK"])
        real_read_piece, rot = peers._read_piece, os.environ.get("RC_REPLICA_ROT")
        flipped: list[str] = []

        def read_piece(fh, into):
            piece = real_read_piece(fh, into)
            pieces.append(len(piece))
            if rot and rot in fh.name and fh.tell() > 2 * len(piece) and not flipped:
                piece[0] ^= 0xFF  # its third piece or later (the file on the disk is intact)
                flipped.append(fh.name)
            return piece

        peers._read_piece = read_piece  # type: ignore[assignment]
    try:
        start = ck.restore(state)
        if retained is not None:  # its parts uploaded: reported in the first save's gather
            assert ck._dir.uploader.wait(60)  # type: ignore[attr-defined]
    except Exception as e:
        out(error=type(e).__name__, msg=str(e))
        dist.destroy_process_group()
        sys.exit(4)
    out(restored=start, counter_rank=counter["rank"], gets=gets)
    if os.environ.get("RC_BLOCK_REPLICAS_OF") and node == 0:  # node 0 cannot store that node's
        of = int(os.environ["RC_BLOCK_REPLICAS_OF"])  # copies: a file where their folder goes
        blocked = Path(base, "node0", ".replicas", f"ranks_{of:05d}-{of:05d}")
        blocked.parent.mkdir(parents=True, exist_ok=True)
        blocked.write_text("not a folder")
    if os.environ.get("RC_KILL_ONCE_RESTORE_UPLOADED"):  # killed before the first save
        uploader = ck._dir.uploader  # type: ignore[attr-defined]
        assert uploader.wait(60)  # the uploads the restore queued, and the retention after each
        out(kept=sorted(n for n in os.listdir(ck.dirpath) if n.startswith("step_")))
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(start + 1, a.steps + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        counter["n"] += 1
        loss = {"loss": float(step if rank == 0 else -step)} if "monitor" in kw else None
        ck.step(step, state, metrics=loss)
        if os.environ.get("RC_SIGTERM_AT") == str(step):
            os.kill(os.getpid(), signal.SIGTERM)
        if step == a.kill_at:
            ck.flush()
            if retained is not None and committer is not None:
                assert retained.wait(60)
            uploader = getattr(ck._dir, "uploader", None)
            if os.environ.get("RC_KILL_ONCE_UPLOADED") and os.environ.get("RC_SLOW_NODE") != str(
                node
            ):  # the fast node's uploads (and the retention after each) are done
                while uploader is not None and uploader.pending():
                    time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
    if pieces:
        out(pieces=pieces)
    if synced:
        out(synced=synced)
    if os.environ.get("RC_FINAL_SAVE"):  # as the DeepSpeed launcher ends: step saved already
        assert not ck.save(a.steps, state, final=True)
    ck.flush()
    st = ck.remote_status()  # this node's uploads (each rank leads its node here)
    out(status=None if st is None else {"pending": len(st.pending), "uploaded": st.uploaded})
    status_taken.set()
    if os.environ.get("RC_GONE_IN_CLOSE") == str(node):  # gone before close's last exchange
        ck._dir._release_settled = dist.destroy_process_group
    try:
        ck.close()
    except Exception as e:  # exit 5: the close gave up on uploads (UploadIncompleteError)
        pending = list(getattr(e, "pending", ()))
        logs = {"log": logged.getvalue()} if os.environ.get("RC_CAPTURE_LOG") else {}
        out(event="close raised", error=type(e).__name__, pending=pending, msg=str(e), **logs)
        dist.destroy_process_group()
        sys.exit(5)
    if os.environ.get("RC_RETENTION_FAILS_AT") or os.environ.get("RC_RETENTION_DENIED"):
        out(committed_saves=ck.committed_saves)
    if os.environ.get("RC_QUEUE_FAILS_AT"):
        out(committed_saves=ck.committed_saves, after_error=ck.after_commit_error)
    if os.environ.get("RC_CAPTURE_LOG"):
        out(event="closed", log=logged.getvalue())
    else:
        out(event="closed")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])
