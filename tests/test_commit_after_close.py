"""Node-local mode: a remote commit that outlives its coordinator's ``close()`` (close gave up
on it: a store that stopped answering) and the next writer of the same store in the same
process (a notebook's next cell). The store is moto's real S3 server; the old commit is held
just before its manifest (the commit point) by an event (no sleeps, no timing asserts)."""

from __future__ import annotations

import logging
import threading

from resilient_callbacks import remote_commit
from resilient_callbacks.filewrite import encode_json, write_bytes
from resilient_callbacks.manifest import FileEntry, Manifest
from resilient_callbacks.remote import RemoteStore
from resilient_callbacks.remote_commit import NodeUploader, RemoteCommitter
from resilient_callbacks.retention import RetentionPolicy

RUN = "run1"


def _part(root, name: str, seq: int) -> tuple[Manifest, FileEntry]:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    d = write_bytes(str(path / "rank_00000.bin"), bytes([seq]) * (100 + seq))
    f = FileEntry("rank_00000.bin", d.size, d.xxh3_64, 0, "tensors")
    return Manifest(step=seq, run_id=RUN, seq=seq, world_size=1, files=[f]), f


def _commit(committer, uploader, root, seq: int) -> None:
    name = f"step_{seq:09d}"
    m, f = _part(root, name, seq)
    committer.expect((RUN, seq), name, encode_json(m.to_json()))
    uploader.enqueue(name, name, (RUN, seq), [f])
    assert uploader.wait(120)
    for rep in uploader.take_reports():
        committer.report(0, rep)


def _old_committer(s3_remote, node) -> tuple[RemoteStore, RemoteCommitter, NodeUploader]:
    """The store, its first committer (keep_last=1) and the uploader of ``node``'s part."""
    store = RemoteStore(*s3_remote)
    store.preflight()
    old = RemoteCommitter(store, 1, RetentionPolicy(keep_last=1), max_attempts=1)
    return store, old, NodeUploader(store, str(node), 0)


def test_a_commit_close_gave_up_on_never_overlaps_the_next_writers_commits(
    tmp_path, s3_remote, monkeypatch, caplog
):
    """The old committer, held before the manifest of step 1 while its close gave up, and the
    next writer of the store committed step 1 itself, then step 2, and its retention
    (keep_last=1) deleted step 1: released, the old committer wrote step 1's manifest again,
    its files deleted (a damaged committed checkpoint in the store), and ran a retention of
    its own after the close. Now the next writer's committer waits for the old one to end
    (as RemoteSync's uploads do), counts what it committed, and the stopped one deletes
    nothing."""
    node = tmp_path / "node0"
    store, old, old_up = _old_committer(s3_remote, node)
    inside, go = threading.Event(), threading.Event()
    orig = remote_commit.put_manifest

    def held(*a, **k):
        if threading.current_thread() is old._thread:
            inside.set()
            go.wait(120)
        return orig(*a, **k)

    monkeypatch.setattr(remote_commit, "put_manifest", held)
    waiting, deleted = threading.Event(), threading.Event()

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for the upload" in record.getMessage():
                waiting.set()
                go.set()  # (the next writer waits for the held one: let it end)
            if "remote retention: deleted" in record.getMessage():
                deleted.set()

    said = Said()
    caplog.set_level(logging.INFO, logger="resilient_callbacks")  # (the wait is said at INFO)
    logging.getLogger("resilient_callbacks").addHandler(said)
    new = new_up = None
    try:
        _commit(old, old_up, node, 1)
        assert inside.wait(60)
        assert old.wait(0.0) is False  # close() gives up on the commit under way
        old.stop()
        old_up.stop()
        new = RemoteCommitter(store, 1, RetentionPolicy(keep_last=1), max_attempts=1)
        new.refresh_max_seq()  # (the open's listing: step 1 is not committed yet)
        new_up = NodeUploader(store, str(node), 0)
        _commit(new, new_up, node, 1)
        _commit(new, new_up, node, 2)
        # the new writer commits steps 1 and 2 and deletes step 1, unless it waits for the
        # old commit to end (it says so): either way, the old one goes on
        for _ in range(600):
            if waiting.is_set() or deleted.wait(0.2):
                break
        go.set()
        old._thread.join(120)
        assert not old._thread.is_alive()
        assert new.wait(120) is True
        new.stop()
        new._thread.join(120)  # (its retention after the last commit is done)
    finally:
        go.set()
        logging.getLogger("resilient_callbacks").removeHandler(said)
        for t in (old, old_up, new, new_up):
            if t is not None:
                t.stop()
    committed = {e.manifest.step: e for e in store.scan() if e.manifest is not None}
    for e in committed.values():  # every committed checkpoint in the store is whole
        assert e.manifest is not None
        missing = [f.path for f in e.manifest.files if e.sizes.get(f.path) != f.size]
        assert not missing, f"{e.name} is committed with {missing} missing"
    assert sorted(committed) == [2]  # (keep_last=1: the old commit counted, not left over)
    assert "another live process" not in caplog.text


def test_a_commit_ending_after_close_gave_up_on_it_deletes_nothing(
    tmp_path, s3_remote, monkeypatch
):
    """close() gave up on the commit of step 2 and released the store (another writer may own
    it by then); when the commit ended, the stopped committer still ran its remote retention
    and deleted step 1. It deletes nothing now, as an upload of RemoteSync's given up on."""
    node = tmp_path / "node0"
    store, old, up = _old_committer(s3_remote, node)
    inside, go = threading.Event(), threading.Event()
    orig = remote_commit.put_manifest

    def held(*a, **k):
        if threading.current_thread() is old._thread and "step_000000002" in str(a[1]):
            inside.set()
            go.wait(120)
        return orig(*a, **k)

    monkeypatch.setattr(remote_commit, "put_manifest", held)
    try:
        _commit(old, up, node, 1)
        assert old.wait(120) is True
        _commit(old, up, node, 2)
        assert inside.wait(60)
        assert old.wait(0.0) is False  # close() gives up on the commit under way
        old.stop()
        go.set()
        old._thread.join(120)
        assert not old._thread.is_alive()
    finally:
        go.set()
        old.stop()
        up.stop()
    committed = sorted(e.manifest.step for e in store.scan() if e.manifest is not None)
    assert committed == [1, 2]


def test_a_committer_of_another_open_writer_of_the_store_is_not_waited_for(tmp_path, s3_remote):
    """Only a stopped committer (its close gave up on it) is waited for: the idle one of a
    writer still open on the store (node-local mode does not refuse a second) never ends, and
    waiting for it held every commit of the next writer."""
    url, options = s3_remote
    store = RemoteStore(url, options)
    store.preflight()
    first = RemoteCommitter(store, 1, RetentionPolicy(keep_last=None), max_attempts=1)
    second = RemoteCommitter(store, 1, RetentionPolicy(keep_last=None), max_attempts=1)
    up = NodeUploader(store, str(tmp_path / "node0"), 0)
    try:
        _commit(second, up, tmp_path / "node0", 1)
        assert second.wait(120) is True
    finally:
        for t in (first, second, up):
            t.stop()


def test_a_wait_on_a_stopped_node_uploader_ends_with_what_it_left(tmp_path):
    """Node-local mode's side of a close nested in another (a user's signal handler's, the
    close lock being reentrant): the nested close gives up on the uploads and stops this
    node's upload thread, leaving work queued. The outer close's wait for the uploads saw no
    failure and no stall on the stopped thread and waited for ever (shared mode's wait ends
    on a stopped upload thread). It now ends at once, False: something was left."""
    from resilient_callbacks.node_upload import UploadJob

    store = RemoteStore(f"file://{tmp_path}/remote")
    up = NodeUploader(store, str(tmp_path / "node0"), 0)
    up.stop()  # (the nested close's release)
    up.discard(UploadJob("step_000000001", "step_000000001", ("run", 1), []))
    ended, got = threading.Event(), []

    def outer() -> None:
        got.append(up.wait(None, 60.0))
        ended.set()

    threading.Thread(target=outer, daemon=True).start()
    assert ended.wait(120), "the wait on a stopped uploader did not end"
    assert got == [False]


def test_a_wait_on_a_stopped_remote_committer_ends_with_what_it_left(tmp_path):
    """The coordinator's side of it: the nested close stopped the committer with a checkpoint
    whose parts all arrived still to commit; the outer close's wait for the commits saw no
    failure and no attempt under way and waited for ever. It now ends at once, False."""
    store = RemoteStore(f"file://{tmp_path}/remote")
    committer = RemoteCommitter(store, 1, RetentionPolicy(keep_last=1), max_attempts=1)
    up = NodeUploader(store, str(tmp_path / "node0"), 0)
    try:
        committer.stop()  # (the nested close's release)
        _commit(committer, up, tmp_path / "node0", 1)  # (its part uploaded and reported)
        ended, got = threading.Event(), []

        def outer() -> None:
            got.append(committer.wait(None, 60.0))
            ended.set()

        threading.Thread(target=outer, daemon=True).start()
        assert ended.wait(120), "the wait on a stopped committer did not end"
        assert got == [False]
    finally:
        up.stop()
