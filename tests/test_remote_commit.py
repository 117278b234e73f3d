"""The node-local remote commit protocol in one process (remote_commit.py): the coordinator's
committer writes a remote manifest only once every node reported its part uploaded, and never
when an object it names is missing or has another size; the options of node-local mode; and
``remote_every_n_saves`` on one node."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from resilient_callbacks import Checkpointer, ConfigError, node_transfer, remote_put
from resilient_callbacks.filewrite import encode_json, write_bytes
from resilient_callbacks.manifest import FileEntry, Manifest
from resilient_callbacks.remote import RemoteStore
from resilient_callbacks.remote_commit import NodeUploader, RemoteCommitter, UploadJob
from resilient_callbacks.retention import RetentionPolicy


def _node_dir(root, name: str, rank: int, data: bytes) -> FileEntry:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    d = write_bytes(str(path / f"rank_{rank:05d}.bin"), data)
    return FileEntry(f"rank_{rank:05d}.bin", d.size, d.xxh3_64, rank, "tensors")


def _setup(tmp_path):
    store = RemoteStore(f"file://{tmp_path}/remote")
    store.preflight()
    files = [
        _node_dir(tmp_path / f"node{r}", "step_000000002", r, bytes([r]) * (100 + r))
        for r in (0, 1)
    ]
    key = ("run1", 1)
    m = Manifest(step=2, run_id="run1", seq=1, world_size=2, files=files)
    committer = RemoteCommitter(
        store, 2, RetentionPolicy(keep_last=None), max_attempts=1, retry_base_s=0.01
    )
    uploaders = [NodeUploader(store, str(tmp_path / f"node{r}"), r) for r in (0, 1)]
    return store, files, key, m, committer, uploaders


def _committed(store):
    return {e.name: e.problem for e in store.scan() if e.manifest is not None}


def test_remote_manifest_only_after_every_node_reported(tmp_path):
    store, files, key, m, committer, up = _setup(tmp_path)
    try:
        committer.expect(key, "step_000000002", encode_json(m.to_json()))
        up[0].enqueue("step_000000002", "step_000000002", key, [files[0]])
        assert up[0].wait(120)
        for rep in up[0].take_reports():
            committer.report(0, rep)
        assert committer.wait(5) is False  # node 1's part is still missing
        assert _committed(store) == {}
        up[1].enqueue("step_000000002", "step_000000002", key, [files[1]])
        assert up[1].wait(120)
        reports = up[1].take_reports()
        assert reports == [{"key": ["run1", 1], "name": "step_000000002"}]
        committer.report(1, {"key": ["other-run", 1], "name": "step_000000002"})  # not ours
        assert committer.wait(5) is False
        committer.report(1, reports[0])
        assert committer.wait(120) is True
        assert _committed(store) == {"step_000000002": None}
        assert up[0].counters.files == 1 and up[1].counters.bytes == 101
    finally:
        committer.stop()
        for u in up:
            u.stop()


def test_no_remote_manifest_when_an_object_is_missing_or_changed(tmp_path):
    store, files, key, m, committer, up = _setup(tmp_path)
    try:
        committer.expect(key, "step_000000002", encode_json(m.to_json()))
        for r in (0, 1):
            up[r].enqueue("step_000000002", "step_000000002", key, [files[r]])
            assert up[r].wait(120)
        os.truncate(tmp_path / "remote" / "step_000000002" / "rank_00001.bin", 7)  # changed
        for r in (0, 1):
            for rep in up[r].take_reports():
                committer.report(r, rep)
        assert committer.wait(120) is True  # given up: nothing is waiting any more
        assert _committed(store) == {}
        assert not (tmp_path / "remote" / "step_000000002" / "manifest.json").exists()
    finally:
        committer.stop()
        for u in up:
            u.stop()


def test_close_waits_are_bounded_by_a_preemptions_grace_period(tmp_path, monkeypatch):
    """A node's upload and the remote commit that never return (a store that stopped
    answering): with a preemption's grace period nearly spent (grace_left() under the exit
    margin), both waits of close() return at once instead of waiting for the store (node-local
    close ignored a SIGTERM that arrived during it, as shared mode does not)."""
    import threading

    from resilient_callbacks import upload_wait

    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (the waits look 20 times a second)
    _store, files, key, m, committer, up = _setup(tmp_path)
    never = threading.Event()
    try:
        monkeypatch.setattr(committer, "commit_one", lambda p: never.wait())
        committer.expect(key, "step_000000002", encode_json(m.to_json()))
        for r in (0, 1):
            up[r].enqueue("step_000000002", "step_000000002", key, [files[r]])
            assert up[r].wait(120)
            for rep in up[r].take_reports():
                committer.report(r, rep)
        # (the store's put of a list of files: hangs)
        monkeypatch.setattr(remote_put, "put", lambda *a, **k: never.wait())
        up[0].enqueue("step_000000004", "step_000000004", ("run1", 2), [files[0]])
        assert up[0].wait(None, None, grace_left=lambda: 1.0) is False
        assert committer.ready() == ["step_000000002"]
        assert committer.wait(None, None, grace_left=lambda: 1.0) is False
        assert committer.wait(None, outage_s=0.0) is False  # its attempt has not returned
        assert committer.stuck_s() > 0
    finally:
        never.set()
        committer.stop()
        for u in up:
            u.stop()


def test_close_gives_up_on_a_node_upload_that_moves_no_byte(tmp_path, monkeypatch):
    """A node's upload attempt that never returns (a store that accepted the connection and
    stopped answering): its wait gives up once no byte moved for the outage limit, as shared
    mode's does, and remote_status() shows the stall. It waited for the attempt to fail, which
    against such an endpoint took s3fs minutes per attempt, or forever."""
    import threading

    from resilient_callbacks import upload_wait

    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (the wait looks 20 times a second)
    _store, files, key, _m, committer, up = _setup(tmp_path)
    never = threading.Event()
    try:
        # (the store's put of a list of files: hangs)
        monkeypatch.setattr(remote_put, "put", lambda *a, **k: never.wait())
        up[0].enqueue("step_000000002", "step_000000002", key, [files[0]])
        returned: list[bool] = []
        waiter = threading.Thread(target=lambda: returned.append(up[0].wait(None, 0.5)))
        waiter.start()
        waiter.join(120)
        assert returned == [False], "the wait did not give up on a stalled upload"
        assert up[0].stalled_s() > 0.5
    finally:
        never.set()
        committer.stop()
        for u in up:
            u.stop()


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_a_node_upload_retry_that_moves_bytes_is_let_finish(tmp_path, monkeypatch):
    """One attempt of a node's upload failed (a blip), and the retry moves bytes for longer
    than the outage limit: the wait counted the outage from that failure until an attempt
    succeeded, so close() gave up on a store that answered (UploadIncompleteError; the first
    failure may even date from long before close). An attempt that moves bytes is let finish.
    (The upload moves a byte each time the wait looks: no race with the clock.)"""
    import time

    _store, files, key, _m, committer, up = _setup(tmp_path)
    u, real_put = up[0], remote_put.put
    real_stalled, looks, calls = u.stalled_s, [0], []

    def stalled_s():
        p = u._progress
        if p is not None and len(calls) > 1:  # the retry, under way: a byte per look
            looks[0] += 1
            p.update(1)
        return real_stalled()

    def put(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("a blip")
        while looks[0] < 6:  # (the wait looks once a second: past the 2.5 s limit)
            time.sleep(0.01)
        return real_put(*a, **k)

    try:
        monkeypatch.setattr(remote_put, "put", put)  # (the store's put of a list of files)
        u.stalled_s = stalled_s
        u.enqueue("step_000000002", "step_000000002", key, [files[0]])
        assert u.wait(None, 2.5) is True
        assert len(calls) == 2
    finally:
        committer.stop()
        for x in up:
            x.stop()


def test_a_node_upload_ending_after_close_gave_up_runs_no_retention(tmp_path, monkeypatch):
    """close() gave up on a node's upload that stopped answering and released the node's
    directory. When the abandoned attempt ended, the thread still ran the local retention
    (on_uploaded) in a directory another writer of the process may own by then; it deletes
    nothing now (the part it uploaded stays uploaded)."""
    import threading

    from resilient_callbacks import upload_thread, upload_wait

    monkeypatch.setattr(upload_thread, "STOP_JOIN_S", 0.1)  # (stop()'s join of the held attempt)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close()'s wait looks 20 times a second)
    store, files, key, _m, committer, up = _setup(tmp_path)
    committer.stop()
    for u in up:
        u.stop()
    released, started, retained = threading.Event(), threading.Event(), []
    real_put = remote_put.put

    def stalls(*a, **k):
        started.set()
        released.wait(60)
        return real_put(*a, **k)

    u = NodeUploader(store, str(tmp_path / "node0"), 0, on_uploaded=lambda: retained.append(1))
    try:
        monkeypatch.setattr(remote_put, "put", stalls)  # (the store's put of a list of files)
        u.enqueue("step_000000002", "step_000000002", key, [files[0]])
        assert started.wait(120)
        assert u.wait(None, 0.5) is False  # close() gives up on it (no byte moved)
        u.stop()
        released.set()
        u._thread.join(60)
        assert not u._thread.is_alive()
        assert retained == [], "the abandoned upload ran the retention after close"
    finally:
        released.set()
        u.stop()


def test_upload_check_asks_s3_not_a_listing_taken_mid_upload(tmp_path, s3_remote):
    """On the coordinator's node the committer thread lists the store with the same s3fs object
    as the node's uploader, at any moment, also while the uploader checks its objects. The check
    must never answer from a cached listing: one taken mid-upload made it report the node's own
    objects missing (spurious failures and retries, seen in the kill torture's logs). Here the
    stale listing is cached before the check; the race itself is not reproduced."""
    url, opts = s3_remote
    store = RemoteStore(url, opts)
    store.preflight()
    name = "step_000000002"
    f = _node_dir(tmp_path / "node0", name, 0, b"x" * 100)
    base = f"{store.root}/{name}"
    store.fs.pipe_file(f"{base}/shared.json", b"{}")  # uploaded first
    store.fs.find(base)  # the committer's listing: shared.json only, now in the cache
    other = RemoteStore(url, dict(opts, skip_instance_cache=True))
    assert other.fs is not store.fs
    other.fs.put_file(str(tmp_path / "node0" / name / f.path), f"{base}/{f.path}")
    up = NodeUploader(store, str(tmp_path / "node0"), 0)
    try:
        job = UploadJob(name, name, ("run1", 1), [f])
        local = str(tmp_path / "node0" / name)
        node_transfer.check_part(up, local, job, [f"{base}/{f.path}"])  # no raise
    finally:
        up.stop()


def test_free_name_never_reuses_a_committed_or_pending_name(tmp_path):
    _store, _files, key, m, committer, up = _setup(tmp_path)
    try:
        committer.index[("old", 3)] = "step_000000002"
        assert committer.free_name("step_000000002") == "step_000000002-r1"
        committer.expect(key, "step_000000002-r1", encode_json(m.to_json()))
        assert committer.free_name("step_000000002") == "step_000000002-r2"
    finally:
        committer.stop()
        for u in up:
            u.stop()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"replicas": 2}, "replicas=2"),
        ({"shared_dirpath": "yes"}, "shared_dirpath='yes'"),
        ({"replicas": 1, "shared_dirpath": True}, "node-local disks only"),
        ({"remote_every_n_saves": 2}, "only applies with remote"),
        ({"remote": "memory://x/y", "remote_every_n_saves": 0}, "an int >= 1"),
    ],
)
def test_node_options_are_checked_early(tmp_path, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        Checkpointer(tmp_path / "ck", **kwargs)


def test_replicas_need_node_local_disks(tmp_path):
    """One node (multinode.md's snippet tried on one machine first): the error says what to
    do, not only what is wrong (found 2026-12-06: it named the mode and the path alone)."""
    with pytest.raises(ConfigError, match="node-local mode") as e:
        Checkpointer(tmp_path / "ck", replicas=1)
    assert "drop replicas=" in str(e.value)


@pytest.mark.parametrize(
    "end, async_save",
    [("step-final", False), ("save-final", False), ("save-final", True)],
)
def test_remote_every_n_saves_uploads_every_nth_commit_and_the_final_one(tmp_path, end, async_save):
    """Every 3rd commit and the final save. ``save-final``: the DeepSpeed launcher's end: the
    schedule saved the last step (not an Nth), then ``save(final=True)`` of the same step
    writes nothing but queues that checkpoint's upload (before: only the 3rd and 6th)."""
    url = f"file://{tmp_path}/remote"
    state = {"w": torch.zeros(4)}
    with Checkpointer(
        tmp_path / "ck",
        remote=url,
        remote_every_n_saves=3,
        keep_last=2,
        remote_keep_last="all",
        every_n_steps=1,
        async_save=async_save,
    ) as ck:
        for step in range(1, 8):
            state["w"] += 1
            ck.step(step, state, final=end == "step-final" and step == 7)
        if end == "save-final":
            assert not ck.save(7, state, final=True)
    remote = sorted(e.manifest.step for e in RemoteStore(url).scan() if e.manifest)
    assert remote == [3, 6, 7]
    local = sorted(e.step for e in ck.checkpoints())
    assert local == [6, 7]  # the local tier keeps its own keep_last


def test_incremental_is_refused_in_node_local_mode(tmp_path, monkeypatch):
    """Node-local mode does not carry the run's blob store in a node's uploads yet: asking for
    both is a ConfigError at construction, not checkpoints that miss their blobs remotely.
    (Detection answers as it would for two single-rank nodes; the check comes before any
    collective of node-local mode.)"""
    from resilient_callbacks import topology

    monkeypatch.setattr(topology, "detect", lambda d, s: topology.Topology(0, 2, ((0,), (1,))))
    with pytest.raises(ConfigError, match="incremental=True is not supported yet in node-local"):
        Checkpointer(tmp_path / "ck", remote=f"file://{tmp_path}/remote", incremental=True)


def test_a_backlog_drops_the_superseded_never_the_oldest_being_uploaded(tmp_path):
    """Uploads behind the saves (keep_last=2 remotely, 5 checkpoints waiting): the coordinator
    drops those the remote retention would delete, never the oldest still being uploaded nor
    the newest; a node takes the dropped ones out of its queue and deletes what it uploaded of
    them, whose report is never sent; a dropped name is not given to a later checkpoint."""
    store = RemoteStore(f"file://{tmp_path}/remote")
    store.preflight()
    committer = RemoteCommitter(store, 2, RetentionPolicy(keep_last=2), max_attempts=1)
    up = NodeUploader(store, str(tmp_path / "node0"), 0)
    try:
        jobs = {}
        for seq in range(1, 6):
            name = f"step_{2 * seq:09d}"
            f = _node_dir(tmp_path / "node0", name, 0, bytes([seq]) * 10)
            m = Manifest(step=2 * seq, run_id="run1", seq=seq, world_size=2, files=[f])
            committer.expect(("run1", seq), name, encode_json(m.to_json()))
            jobs[seq] = UploadJob(name, name, ("run1", seq), [f])
        up.enqueue(jobs[2].local_name, jobs[2].remote_name, jobs[2].key, jobs[2].files)
        assert up.wait(120)  # node 0 uploaded step 4 (its report not taken yet)
        assert (tmp_path / "remote" / "step_000000004" / "rank_00000.bin").exists()
        for seq in (3, 4, 5):
            up.enqueue(jobs[seq].local_name, jobs[seq].remote_name, jobs[seq].key, jobs[seq].files)
        upload, dropped = committer.drop_superseded()
        assert upload == [("run1", 1), ("run1", 4), ("run1", 5)]
        assert dropped == [("run1", 2), ("run1", 3)]
        assert committer.waiting() == ["step_000000002", "step_000000008", "step_000000010"]
        up.settle(upload, dropped)  # (step 6: out of the queue, or deleted once uploaded)
        assert up.wait(120)
        assert up.take_reports() == [
            {"key": ["run1", s], "name": f"step_{2 * s:09d}"} for s in (4, 5)
        ]
        assert not (tmp_path / "remote" / "step_000000004").exists()
        assert not (tmp_path / "remote" / "step_000000006").exists()
        committer.report(0, {"key": ["run1", 2], "name": "step_000000004"})  # too late: ignored
        assert committer.free_name("step_000000004") == "step_000000004-r1"
        assert "step_000000004" not in committer.waiting()
    finally:
        committer.stop()
        up.stop()


def test_a_node_holds_its_uploaded_part_until_the_remote_commit_is_settled(tmp_path):
    """A node's part, once uploaded, stays held on its disk until the coordinator says the
    checkpoint is committed remotely or dropped (a save's outcome, or close's last word):
    deleted earlier, a crash before the other node's part arrived left a checkpoint that no
    run could commit. A commit given up stays held: a later run commits it."""
    _, files, key, m, committer, up = _setup(tmp_path)
    try:
        committer.expect(key, "step_000000002", encode_json(m.to_json()))
        up[1].enqueue("step_000000002", "step_000000002", key, [files[1]])
        assert up[1].wait(120)
        assert up[1].pending() == [] and up[1].held() == ["step_000000002"]
        up[1].settle(committer.unsettled(), [])  # a save's outcome: node 0's part still due
        assert up[1].held() == ["step_000000002"]

        def fail(p):
            raise ConnectionError("the store refuses the manifest")

        committer.commit_one = fail  # type: ignore[method-assign]
        up[0].enqueue("step_000000002", "step_000000002", key, [files[0]])
        assert up[0].wait(120)
        for node in (0, 1):
            for rep in up[node].take_reports():
                committer.report(node, rep)
        committer.wait(120)
        assert committer.abandoned == ["step_000000002"]
        assert committer.unsettled() == [key] == committer.abandoned_keys()
        up[1].settle([], [], committer.abandoned_keys())
        up[1].release(committer.unsettled())
        assert up[1].held() == ["step_000000002"]
        up[1].release([])  # committed (or dropped) since
        assert up[1].held() == []
    finally:
        committer.stop()
        for u in up:
            u.stop()


def test_a_failing_remote_retention_warns_once_not_after_every_commit(tmp_path, caplog):
    """The node-local committer's remote retention, on a store that denies deletes: a warning
    after every remote commit. Now one, then at most hourly (info between)."""
    import logging

    store = RemoteStore(f"file://{tmp_path}/remote")
    store.preflight()

    def deny(name):
        raise PermissionError("AccessDenied: s3:DeleteObject")

    store.delete = deny
    committer = RemoteCommitter(store, 1, RetentionPolicy(keep_last=1), retry_base_s=0.01)
    up = NodeUploader(store, str(tmp_path / "node0"), 0)
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    try:
        for seq in (1, 2, 3):
            name = f"step_00000000{seq}"
            files = [_node_dir(tmp_path / "node0", name, 0, bytes([seq]) * 100)]
            m = Manifest(step=seq, run_id="run1", seq=seq, world_size=1, files=files)
            committer.expect(("run1", seq), name, encode_json(m.to_json()))
            up.enqueue(name, name, ("run1", seq), files)
            assert up.wait(120)
            for rep in up.take_reports():
                committer.report(0, rep)
            assert committer.wait(120) is True
    finally:
        committer.stop()
        up.stop()
    assert sorted(_committed(store)) == ["step_000000001", "step_000000002", "step_000000003"]
    said = [r.message for r in caplog.records if "remote retention" in r.message]
    assert len(said) == 1 and "AccessDenied" in said[0], said


def test_a_part_dropped_under_way_stays_dropped_through_the_next_saves_outcome(
    tmp_path, monkeypatch
):
    """Node 1's upload of a checkpoint is under way when the coordinator drops it (uploads
    behind the saves); the next save's outcome no longer names it at all. That second settle
    set the job's ``dropped`` back to False, so once the slow upload ended its objects were
    reported, never deleted: a folder of one node's files without a manifest, left for the
    day-old sweep (tests/test_nodelocal_backlog.py failed so now and then)."""
    import threading

    _store, files, key, _, committer, up = _setup(tmp_path)
    committer.stop()
    up[0].stop()
    putting, go = threading.Event(), threading.Event()
    real_put = remote_put.put

    def put(*a, **kw):
        putting.set()
        assert go.wait(60)
        return real_put(*a, **kw)

    monkeypatch.setattr(remote_put, "put", put)  # (the store's put of a list of files)
    try:
        up[1].enqueue("step_000000002", "step_000000002", key, [files[1]])
        assert putting.wait(60)
        up[1].settle([], [key])  # dropped while under way
        up[1].settle([("run1", 2)], [])  # the next save's outcome: another checkpoint
        go.set()
        assert up[1].wait(60)
        assert up[1].take_reports() == []
        left = [p for p in (tmp_path / "remote").rglob("*") if p.is_file()]
        assert left == [], left
    finally:
        go.set()
        up[1].stop()


def test_the_node_local_remote_retention_plans_for_the_run_that_committed(tmp_path):
    """Another run's checkpoints share the URL, its newest numbered after this run's commit.
    The coordinator's remote retention planned for the run of the newest manifest on the URL,
    of any run: it counted the other run's checkpoints as its own and deleted the older one by
    this run's keep_last. Now it plans for the run that committed: the other run's stay."""
    store, files, key, m, committer, up = _setup(tmp_path)
    committer.stop()
    committer = RemoteCommitter(store, 2, RetentionPolicy(keep_last=1), max_attempts=1)
    with Checkpointer(tmp_path / "other", remote=store.url, remote_keep_last="all") as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((4,), float(s))})
    theirs = sorted(e.name for e in store.scan())
    try:
        committer.expect(key, "step_000000002-r1", encode_json(m.to_json()))
        for node, u in enumerate(up):
            u.enqueue("step_000000002", "step_000000002-r1", key, [files[node]])
            assert u.wait(120)
            for rep in u.take_reports():
                committer.report(node, rep)
        assert committer.wait(120) is True
        committer.stop()
        committer._thread.join(60)  # (its retention after the commit is done)
        assert sorted(e.name for e in store.scan()) == sorted([*theirs, "step_000000002-r1"])
    finally:
        committer.stop()
        for u in up:
            u.stop()


def test_a_committer_that_could_not_list_at_open_retires_the_runs_history(tmp_path):
    """The store did not answer at open (no listing: the run's history unknown). The first
    commit was taken for the open, so the retention counted only this process's commits as
    the run's, and the history on the URL was never deleted (named as another live process's
    in a warning). Now the first listing that succeeds says the history."""
    store, files, _, _, committer, up = _setup(tmp_path)
    committer.stop()
    with Checkpointer(tmp_path / "before", remote=store.url, async_save=False) as ck:
        ck.save(1, {"w": torch.ones(4)})
    (history,) = [e for e in store.scan() if e.manifest is not None]
    assert history.key is not None
    key = (history.key[0], 2)  # the run resumed on two nodes, its next commit
    m = Manifest(step=2, run_id=key[0], seq=2, world_size=2, files=files)
    committer = RemoteCommitter(store, 2, RetentionPolicy(keep_last=1), max_attempts=1)
    try:  # (no refresh_max_seq: the store was down at open)
        committer.expect(key, "step_000000002", encode_json(m.to_json()))
        for node, u in enumerate(up):
            u.enqueue("step_000000002", "step_000000002", key, [files[node]])
            assert u.wait(120)
            for rep in u.take_reports():
                committer.report(node, rep)
        assert committer.wait(120) is True
        committer.stop()
        committer._thread.join(60)  # (its retention after the commit is done)
        assert _committed(store) == {"step_000000002": None}
    finally:
        committer.stop()
        for u in up:
            u.stop()


def _commit_step_2(committer: Any, up: Any, files: Any, key: Any, m: Any) -> None:
    """Both nodes upload their part of step 2 and report it; the coordinator commits it."""
    committer.expect(key, "step_000000002", encode_json(m.to_json()), "step_000000002")
    for node in (0, 1):
        up[node].enqueue("step_000000002", "step_000000002", key, [files[node]])
        assert up[node].wait(120)
        for rep in up[node].take_reports():
            committer.report(node, rep)
    assert committer.wait(120) is True


def test_the_coordinator_records_each_remote_commit_and_a_restart_uploads_the_unrecorded(
    tmp_path, caplog
):
    """The coordinator's committer records each remote commit in its node's history (an
    ``upload`` record with the commit number); a restart then uploads an archive point older
    than the store's newest commit that the store lacks only where no record names it (never
    uploaded: saved by a library that uploaded archive points only when due by
    ``remote_every_n_saves``) and every node holds its part:
    one recorded was deleted from the store since on purpose (said at INFO), one a node lacks
    cannot be committed (an ERROR names the node). Before, every such checkpoint stayed local
    without a word (the end-to-end case: tests/test_nodelocal_recovery.py)."""
    import logging

    from resilient_callbacks import node_recovery
    from resilient_callbacks.nodelocal import NodeDirectory
    from resilient_callbacks.topology import Topology

    store, files, key, m, first, up = _setup(tmp_path)
    first.stop()
    d = NodeDirectory.__new__(NodeDirectory)  # the coordinator's, as open() leaves it
    d.dirpath, d.run_id, d.read_only, d.world_size = str(tmp_path / "node0"), "run1", False, 2
    d.remote, d.topology = store, Topology(0, 2, ((0,), (1,)))
    committer = RemoteCommitter(
        store, 2, RetentionPolicy(keep_last=None), max_attempts=1, on_committed=d._record_commit
    )
    try:
        _commit_step_2(committer, up, files, key, m)
    finally:
        committer.stop()
        for u in up:
            u.stop()
    assert node_recovery.committed_seqs(d) == [1]
    older = [
        (f"step_{s:09d}", Manifest(step=s, run_id="run1", seq=q, world_size=2, files=[]), None, "")
        for q, s in ((1, 2), (2, 4), (3, 8))
    ]
    # each rank's part of recover_uploads' gather: node 0 holds commits 1-3, node 1 only 1-2
    # ([seq, step, what it is])
    a = "an archive point"
    got = [[None, [[1, 2, a], [2, 4, a], [3, 8, a]], [1]], [None, [[1, 2, a], [2, 4, a]], None]]
    caplog.set_level(logging.INFO, "resilient_callbacks")
    queued = node_recovery._older_everywhere(d, older, got)
    assert [x[0] for x in queued] == ["step_000000004"], queued
    assert "not uploading step 2 (commit 1) again: committed remotely" in caplog.text
    # what deletes an archive point from the store: gc's options or something outside this
    # library, never the remote retention (it keeps archive points); it named it
    info = [r.getMessage() for r in caplog.records if "not uploading step 2" in r.getMessage()]
    assert "--drop-archives" in info[0] and "by hand" in info[0], info
    assert "remote retention" not in info[0], info
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("step 8 (commit 3) is an archive point")
    assert "node(s) 1 hold no part of it" in errors[0], errors
    # what is known: the store lacks it and the history records no commit of it; it said
    # "never committed remotely", which a history that records none at all (lost with node
    # 0's disk) cannot tell
    assert "never committed" not in errors[0] and "does not record" in errors[0], errors
    assert "nor any remote commit of this run" not in errors[0], errors
    caplog.clear()
    lost = [[None, [[1, 2, a], [2, 4, a], [3, 8, a]], []], [None, [[1, 2, a], [2, 4, a]], None]]
    node_recovery._older_everywhere(d, older, lost)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "never committed" not in errors[0], errors
    assert "nor any remote commit of this run" in errors[0], errors
    assert "may have been committed and deleted from the store since" in errors[0], errors


def test_a_wait_for_the_commits_returns_only_once_the_commit_is_recorded(tmp_path):
    """``on_committed`` (the coordinator's ``upload`` record in its history, which a restart
    reads to tell an archive point deleted from the store on purpose from one never uploaded)
    runs before :meth:`RemoteCommitter.wait` counts the commit done. Before, the committer
    marked it done first: close() went on while the record was still to be written, and a
    process that exited then (or a test that read the history at once) had no record of it."""
    store, files, key, m, first, up = _setup(tmp_path)
    first.stop()
    done_when_recorded: list[bool] = []
    committer = RemoteCommitter(
        store,
        2,
        RetentionPolicy(keep_last=None),
        max_attempts=1,
        on_committed=lambda p: done_when_recorded.append(committer.wait(timeout=0)),
    )
    try:
        _commit_step_2(committer, up, files, key, m)
        assert done_when_recorded == [False]  # (recorded while a wait still waited for it)
    finally:
        committer.stop()
        for u in up:
            u.stop()


def test_an_older_archive_point_whose_commit_the_coordinator_cannot_write_is_not_uploaded(
    tmp_path, caplog
):
    """Rank 0 names, in the restore's gather, the older archive points whose global manifest
    (beside its part) it cannot read: no node uploads them (each restart sent every part again
    for a commit that could never be written), and its ERROR names the file."""
    import logging

    from resilient_callbacks import node_recovery
    from resilient_callbacks.node_files import REMOTE_MANIFEST
    from resilient_callbacks.nodelocal import NodeDirectory
    from resilient_callbacks.topology import Topology

    d = NodeDirectory.__new__(NodeDirectory)  # the coordinator's, as open() leaves it
    d.dirpath, d.run_id, d.remote = str(tmp_path), "run1", None
    d.topology = Topology(0, 2, ((0,), (1,)))
    older = []
    for q, s in ((2, 4), (3, 8)):
        m = Manifest(
            step=s, run_id="run1", seq=q, world_size=2, files=[], extra={"nodes": [[0], [1]]}
        )
        (tmp_path / f"step_{s:09d}").mkdir()
        older.append((f"step_{s:09d}", m, ("run1", q), f"step_{s:09d}"))
    write_bytes(str(tmp_path / "step_000000008" / REMOTE_MANIFEST), encode_json(m.to_json()))
    blocked = node_recovery._uncommittable(d, older)
    assert [b[0] for b in blocked] == [2] and "remote_manifest.json cannot be read" in blocked[0][1]
    a = "an archive point"  # (each gathered [seq, step, what it is])
    got = [[None, [[2, 4, a], [3, 8, a]], [], blocked], [None, [[2, 4, a], [3, 8, a]], None, None]]
    caplog.set_level(logging.INFO, "resilient_callbacks")
    queued = node_recovery._older_everywhere(d, older, got)
    assert [x[0] for x in queued] == ["step_000000008"], queued
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("step 4 (commit 2) is an archive point"), (
        errors
    )
    assert "no node uploads it" in errors[0] and "restart the job" in errors[0], errors
    assert "never committed" not in errors[0] and "does not record" in errors[0], errors


def test_a_history_without_any_commit_record_says_why_an_archive_point_may_come_back(
    tmp_path, caplog
):
    """A node-local directory written before the coordinator recorded its remote commits
    (before this upgrade) holds no ``upload`` record: an archive point uploaded then and
    deleted from the store on purpose since (`gc --remote --drop-archives`) is uploaded again
    as never uploaded. Rank 0 now says so, with the gc that deletes it again; where the history
    records commits of the run, it does not."""
    import logging

    from resilient_callbacks import node_recovery
    from resilient_callbacks.nodelocal import NodeDirectory
    from resilient_callbacks.topology import Topology

    d = NodeDirectory.__new__(NodeDirectory)
    d.dirpath, d.run_id, d.remote = str(tmp_path), "run1", None
    d.topology = Topology(0, 2, ((0,), (1,)))
    m = Manifest(step=4, run_id="run1", seq=2, world_size=2, files=[])
    older = [("step_000000004", m, ("run1", 2), "step_000000004")]
    caplog.set_level(logging.INFO, "resilient_callbacks")
    a = "an archive point"  # (each gathered [seq, step, what it is])
    for recorded, said in (([3], False), ([], True)):
        caplog.clear()
        got = [[None, [[2, 4, a]], recorded, []], [None, [[2, 4, a]], None, None]]
        assert len(node_recovery._older_everywhere(d, older, got)) == 1
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert bool(warned) is said, warned
    assert "records no remote commit of this run" in warned[0], warned
    assert "step 4 (commit 2) uploaded now" in warned[0] and "--drop-archives" in warned[0]
