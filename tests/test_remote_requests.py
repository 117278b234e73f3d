"""The requests the remote tier sends, counted at a proxy in front of a real S3 API server
(moto on 127.0.0.1, tests/flaky_proxy.py): deletions under a prefix that holds glob-like
characters go in batches, a batched delete that the store partly refuses deletes the rest and
leaves the refused keys for the next collection, and the blob collection lists the blob tree
no more often than it needs. Counts, never times: they do not depend on the machine's load."""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Iterator
from urllib.parse import unquote

import pytest
import torch

from flaky_proxy import FlakyProxy
from resilient_callbacks import Checkpointer, remote_blobs
from resilient_callbacks.manifest import read_manifest
from resilient_callbacks.remote import RemoteStore
from resilient_callbacks.remote_blobs import COLLECT_PREFIX, listing

pytest.importorskip("moto")
pytest.importorskip("s3fs")


class Counted:
    """A proxy in front of the session's S3 server that counts every request by kind."""

    def __init__(self, server) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.forbid: tuple[str, ...] = ()  # key endings a DELETE of one object is refused
        self.batch: str | None = None  # how a batched delete is answered (flaky_proxy's rules)
        self.single: str | None = None  # how a DELETE of one blob is answered
        self.deleted: list[str] = []  # the keys of every DELETE of one object
        self.listed: list[str] = []  # the prefix of every listing request
        self.proxy = FlakyProxy(server.endpoint, self._rule)
        self.options = {**server.options, "endpoint_url": self.proxy.endpoint}

    def _rule(self, method: str, path: str, query: str) -> str | None:
        path = unquote(path)
        if method == "GET" and "list-type" in query:
            prefix = unquote(dict(q.partition("=")[::2] for q in query.split("&"))["prefix"])
            self.counts["LIST " + ("blobs/" if "/blobs/" in prefix + "/" else "other")] += 1
            self.listed.append(prefix)
        elif method == "POST" and "delete" in query:
            self.counts["DELETE batch"] += 1
            return self.batch
        elif method == "DELETE":
            self.counts["DELETE " + ("blob" if "/blobs/" in path else "other")] += 1
            self.deleted.append(path.rsplit("/", 1)[-1])
            if self.forbid and path.endswith(self.forbid):
                return "forbidden"
            if path.endswith(".safetensors"):
                return self.single
        else:
            self.counts[method] += 1
        return None

    def take(self) -> dict[str, int]:
        out, self.counts = dict(self.counts), collections.Counter()
        return out


@pytest.fixture
def counted(s3_server) -> Iterator[Counted]:
    s3_server.start()
    c = Counted(s3_server)
    c.bucket = s3_server.create_bucket()
    try:
        yield c
    finally:
        c.proxy.close()


def _put_straight(bucket: str, objects: dict[str, bytes]) -> None:
    """Objects written into the moto server's store itself (test_incremental_remote.py)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for key, data in objects.items():
        backend.put_object(bucket, key, data)


def _incremental_run(url: str, opts: dict, tmp_path, steps: int = 2) -> set[str]:
    """A run's remote checkpoints with blobs (every tensor changed at each save); the blobs
    they name."""
    with Checkpointer(
        tmp_path / "local",
        incremental=True,
        remote=url,
        remote_options=opts,
        keep_last=1,
        remote_keep_last="all",
        async_save=False,
    ) as ck:
        for s in range(1, steps + 1):
            ck.save(s, {f"t{i}": torch.full((4096,), float(10 * s + i)) for i in range(3)})
    entries = RemoteStore(url, opts).scan()
    used = {b.path for e in entries if e.manifest is not None for b in e.manifest.blobs}
    assert len(used) == 3 * steps
    return used


@pytest.mark.parametrize("prefix", ["run", "exp?1"])
def test_a_delete_the_store_refuses_for_some_blobs_leaves_them_and_deletes_the_rest(
    counted, tmp_path, caplog, prefix
):
    """A policy that denies deleting some keys: the blob collection deletes every other unused
    blob, says which it could not delete, never touches a used one, and the next collection
    deletes the rest once the store lets it. Under a prefix holding ``?`` each blob went by
    its own request, and the first refused one aborted the whole collection (PermissionError
    out of ``collect``): every later unused blob stayed."""
    url, opts = f"s3://{counted.bucket}/{prefix}", counted.options
    used = _incremental_run(url, opts, tmp_path)
    unused = [f"{i:032x}.safetensors" for i in range(6)]
    _put_straight(counted.bucket, {f"{prefix}/blobs/{n}": b"x" * 8 for n in unused})
    refused = tuple(unused[1:3])
    counted.forbid = refused  # one object's DELETE
    counted.proxy.refuse_key = lambda key: key.endswith(refused)  # in a batched delete
    store = RemoteStore(url, opts)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    counted.take()
    assert remote_blobs.collect(store) == [n for n in unused if n not in refused]
    got = counted.take()  # one batched delete; no blob deleted one by one; no listing after
    assert got["DELETE batch"] == 1 and got.get("DELETE blob") == 1, got  # (its own marker)
    assert sorted(counted.proxy.refused) == sorted(f"{prefix}/blobs/{n}" for n in refused)
    assert {n for n in listing(store) if not n.startswith(".")} == used | set(refused)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("did not delete 2 of 6 unused blob(s)" in m and refused[0] in m for m in said)
    counted.forbid, counted.proxy.refuse_key = (), None
    assert remote_blobs.collect(store) == list(refused)  # the next one tries them again
    assert {n for n in listing(store) if not n.startswith(".")} == used


@pytest.mark.parametrize("prefix", ["run[1]", "exp*1", "exp?1"])
def test_deletes_under_a_glob_like_prefix_go_in_batches(counted, prefix):
    """Under a prefix holding ``[``, ``*`` or ``?`` (taken literally: remote_paths), the blob
    collection and the deletion of a checkpoint's folder sent one DELETE per object (40
    unused blobs: 40 requests); they now send the keys in batched deletes, one per 500 blobs
    (1000 keys for a folder)."""
    url, opts = f"s3://{counted.bucket}/{prefix}", counted.options
    blobs = [f"{i:032x}.safetensors" for i in range(40)]
    files = [f"part{i}.bin" for i in range(25)]
    _put_straight(counted.bucket, {f"{prefix}/blobs/{n}": b"x" for n in blobs})
    _put_straight(counted.bucket, {f"{prefix}/step_000000001/{n}": b"y" for n in files})
    _put_straight(counted.bucket, {f"{prefix}run/step_000000001/{n}": b"z" for n in files})
    store = RemoteStore(url, opts)
    counted.take()
    assert remote_blobs.collect(store) == blobs
    got = counted.take()
    assert got.get("DELETE blob", 0) == 1, got  # (the collection's own marker)
    assert got["DELETE batch"] == 1, got
    store.delete("step_000000001")
    got = counted.take()
    # (the manifest first, the files in one batch, the deletion mark last)
    assert got.get("DELETE other", 0) == 2 and got["DELETE batch"] == 1, got
    assert not store.fs.find(store._path("step_000000001"))
    other = RemoteStore(f"s3://{counted.bucket}/{prefix}run", opts)  # what a pattern would name
    assert len(other.fs.find(other._path("step_000000001"))) == len(files)


def test_a_blob_collection_lists_the_store_once(counted, tmp_path):
    """A collection among 1,100 blobs (two listing pages) listed the blob tree three times
    besides its scan of the whole store (the in-flight markers, the blobs after the scan, the
    blobs again after deleting, each every page) and fetched nothing more for it: it now lists
    the markers alone (one request, by their prefix), takes the blobs from its scan's listing,
    and knows what the store refused from the batches' answers."""
    url, opts = f"s3://{counted.bucket}/run", counted.options
    used = _incremental_run(url, opts, tmp_path)
    unused = [f"{i:032x}.safetensors" for i in range(1100)]
    _put_straight(counted.bucket, {f"run/blobs/{n}": b"x" for n in unused})
    store = RemoteStore(url, opts)
    counted.take()
    assert remote_blobs.collect(store) == unused
    got = counted.take()
    assert got.get("LIST blobs/") == 1, got  # (the markers)
    assert got.get("LIST other") == 2, got  # the scan: 1,100 blobs and the checkpoints' files
    assert got["DELETE batch"] == 3, got  # 500 per request
    assert {n for n in listing(store) if not n.startswith(".")} == used


def test_an_upload_beside_no_collection_lists_the_blobs_twice(counted, tmp_path):
    """An upload listed every blob three times (what is there; its own blobs' sizes after
    the put; and before the commit, for a collection that may have deleted one it relied on).
    Where its first listing, made after its in-flight marker, shows no collection running,
    none can have missed its marker, and the third is not made; beside one it still is
    (test_remote_blob_reuse.py)."""
    url, opts = f"s3://{counted.bucket}/run", counted.options
    with Checkpointer(
        tmp_path / "local",
        incremental=True,
        remote=url,
        remote_options=opts,
        remote_keep_last="all",  # (nothing deleted: the save is its upload alone)
        async_save=False,
    ) as ck:
        ck.save(1, {f"t{i}": torch.full((4096,), float(i)) for i in range(3)})
        assert ck._dir.sync.wait(60)
        counted.take()
        ck.save(2, {f"t{i}": torch.full((4096,), float(10 + i)) for i in range(3)})
        assert ck._dir.sync.wait(60)
        got = counted.take()
    assert got.get("LIST blobs/") == 2, got
    entries = RemoteStore(url, opts).scan()
    assert [e.manifest.step for e in entries if e.problem is None] == [1, 2]


def _collection_markers(store: RemoteStore) -> list[str]:
    return [n for n in listing(store) if n.startswith(COLLECT_PREFIX)]


def _backdate(bucket: str, keys: list[str]) -> None:
    """Objects of moto's store listed as written 10 minutes earlier (longer than a blob
    collection's time bound before anything written now)."""
    import datetime

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for key in keys:
        backend.get_object(bucket, key).last_modified -= datetime.timedelta(minutes=10)


def _upload_beside(counted: Counted, url: str, tmp_path) -> dict[str, int]:
    """Another checkpoint (new blobs, so the upload puts them) uploaded to ``url`` and
    committed; the requests its upload sent."""
    with Checkpointer(tmp_path / "other", incremental=True, async_save=False) as ck:
        ck.save(7, {f"t{i}": torch.full((4096,), float(100 + i)) for i in range(3)})
    ckpt = str(tmp_path / "other" / "step_000000007")
    counted.take()
    RemoteStore(url, counted.options).upload(ckpt, read_manifest(ckpt), "step_000000007")
    got = counted.take()
    entries = RemoteStore(url, counted.options).scan()
    assert "step_000000007" in [e.name for e in entries if e.problem is None]
    return got


@pytest.mark.parametrize("answer", ["lost", pytest.param("drop", marks=pytest.mark.slow)])
def test_a_collection_whose_deletes_got_no_answer_leaves_its_marker_and_uploads_settle(
    counted, tmp_path, caplog, answer
):
    """A batched delete answered by a 500 or a reset connection (after the store got it), and
    then each blob's own DELETE by a 500: any of them may still land at the store later. The
    collection removed its marker all the same, so an upload listing the blobs next found
    none, skipped its check before the commit, relied on a blob such a delete removes, and
    committed a manifest naming it. The marker now stays (said at INFO); the next upload
    beside it lists the blobs a third time (settles) and removes it, since the store lists it
    as written longer than a collection's time bound before the upload's own."""
    url, opts = f"s3://{counted.bucket}/run", counted.options
    _incremental_run(url, opts, tmp_path)
    unused = [f"{i:032x}.safetensors" for i in range(3)]
    _put_straight(counted.bucket, {f"run/blobs/{n}": b"x" for n in unused})
    counted.batch, counted.single = answer, "error"
    once = {**opts, "config_kwargs": {"retries": {"max_attempts": 1}}}
    caplog.set_level(logging.INFO, "resilient_callbacks")
    counted.take()
    counted.deleted.clear()
    remote_blobs.collect(RemoteStore(url, once))
    assert counted.take()["DELETE batch"] >= 1
    assert set(counted.deleted) == set(unused)  # one by one after the batch; not its marker
    store = RemoteStore(url, opts)
    left = _collection_markers(store)
    assert len(left) == 1, listing(store)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("leaving the collection marker" in m and left[0] in m for m in said), said
    body = json.loads(store.fs.cat_file(f"{counted.bucket}/run/blobs/{left[0]}"))
    assert "pid" not in body  # (a restart on this host after this process exits still waits)
    counted.batch = counted.single = None
    assert remote_blobs.collect(store) == []  # the next collection: its own marker goes
    assert _collection_markers(store) == left
    _backdate(counted.bucket, [f"run/blobs/{left[0]}"])
    got = _upload_beside(counted, url, tmp_path)
    assert got.get("LIST blobs/") == 3, got  # settled: what it relied on checked again
    assert _collection_markers(store) == []


@pytest.mark.parametrize("count", [3, 1])
def test_a_collection_the_store_refused_to_delete_for_removes_its_marker(counted, tmp_path, count):
    """Refusals the store answered (each key of a batched delete named AccessDenied in its
    answer; a single blob's DELETE answered 403): nothing was deleted and nothing will be, so
    the collection removes its marker, and the next upload beside does not settle (a store
    whose policy denies deletes does not slow every upload)."""
    url, opts = f"s3://{counted.bucket}/run", counted.options
    _incremental_run(url, opts, tmp_path)
    unused = tuple(f"{i:032x}.safetensors" for i in range(count))
    _put_straight(counted.bucket, {f"run/blobs/{n}": b"x" for n in unused})
    counted.forbid = unused
    counted.proxy.refuse_key = lambda key: key.endswith(unused)
    store = RemoteStore(url, opts)
    counted.take()
    assert remote_blobs.collect(store) == []
    got = counted.take()
    assert got.get("DELETE blob") == 1 + (count == 1), got  # (a lone blob's, and the marker)
    assert _collection_markers(store) == []
    counted.forbid, counted.proxy.refuse_key = (), None
    got = _upload_beside(counted, url, tmp_path)
    assert got.get("LIST blobs/") == 2, got


def test_a_failed_batched_delete_on_memory_removes_the_collection_marker(monkeypatch):
    """A store in this process (``memory://``, like a local filesystem) answers every delete:
    one that raised did nothing and does nothing later, so no marker is left."""
    import uuid

    store = RemoteStore(f"memory://rc-{uuid.uuid4().hex[:12]}/run")
    unused = [f"{i:032x}.safetensors" for i in range(3)]
    store.fs.pipe({store._path("blobs", n): b"x" for n in unused})

    def rm(paths, *a, **kw):
        raise OSError("the batch failed")

    monkeypatch.setattr(store.fs, "rm", rm)
    assert remote_blobs.collect(store) == unused  # one by one after the batch
    assert listing(store) == {}


def test_unused_blobs_a_store_other_than_s3_silently_keeps_are_not_reported_deleted(
    monkeypatch, caplog
):
    """A store other than S3 whose batched delete (fsspec's ``rm`` of a list) keeps a key
    without an error: nothing names it, so the collection lists the blobs again and reports
    only those gone (on S3 the batch's answer names each refused key, above)."""
    import uuid

    url = f"memory://rc-{uuid.uuid4().hex[:12]}/run"
    store = RemoteStore(url)
    unused = [f"{i:032x}.safetensors" for i in range(3)]
    store.fs.pipe({store._path("blobs", n): b"x" for n in unused})
    real_rm = store.fs.rm
    monkeypatch.setattr(store.fs, "rm", lambda paths, *a, **kw: real_rm(paths[1:], *a, **kw))
    caplog.set_level(logging.INFO, "resilient_callbacks")
    assert remote_blobs.collect(store) == unused[1:]
    monkeypatch.undo()
    assert sorted(listing(store)) == unused[:1]
    said = [r.getMessage() for r in caplog.records]
    assert any("did not delete 1 of 3 unused blob(s)" in m for m in said), said
    assert any("deleted 2 unused blob(s)" in m for m in said), said
    assert remote_blobs.collect(store) == unused[:1]  # the next collection tries again


def _three_saves(url: str, opts: dict, tmp_path) -> None:
    """A run that saves steps 1 to 3, keeping one remote checkpoint: the retention after the
    second upload deletes step 1, the one after the third step 2 (and step 1 where it stayed
    committed)."""
    with Checkpointer(
        tmp_path / "local", remote=url, remote_options=opts, remote_keep_last=1, async_save=False
    ) as ck:
        for s in range(1, 4):
            ck.save(s, {"w": torch.full((64,), float(s))})
            assert ck._dir.sync.wait(60)


def test_a_retention_delete_the_store_refuses_for_some_files_is_said_and_goes_on(
    counted, tmp_path, caplog
):
    """The retention deleted a checkpoint's folder through s3fs's recursive ``rm``, whose
    batched delete drops the keys the store refused: the files stayed in the store while the
    retention said "deleted". It now deletes the manifest first (uncommitted: no reader sees
    it committed with files missing), then the files in batches that name each refusal, and
    the deletion mark last: the mark and the refused files stay, a warning names them, and
    the retention goes on (step 2 deleted after the third upload)."""
    url, opts = f"s3://{counted.bucket}/run", counted.options
    ckpt = "run/step_000000001/"
    counted.proxy.refuse_key = lambda key: key.startswith(ckpt) and ".writer-" not in key
    caplog.set_level(logging.INFO, "resilient_callbacks")
    _three_saves(url, opts, tmp_path)
    store = RemoteStore(url, opts)
    left = sorted(p.rsplit("/", 1)[-1] for p in store.fs.find(store._path("step_000000001")))
    assert "manifest.json" not in left and ".writer-deleting" in left, left
    assert sorted(counted.proxy.refused) == sorted(
        ckpt + n for n in left if n != ".writer-deleting"
    )
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("refused to delete" in m and "step_000000001" in m for m in said), said
    entries = store.scan()
    assert [e.name for e in entries if e.problem is None] == ["step_000000003"]
    assert [e.name for e in entries if e.problem is not None] == ["step_000000001"]
    counted.proxy.refuse_key = None
    store.delete("step_000000001")  # a later deletion takes the rest, the mark last
    assert store.fs.find(store._path("step_000000001")) == []


def test_a_retention_delete_whose_manifest_the_store_refuses_keeps_it_whole(
    counted, tmp_path, caplog
):
    """The store refusing to delete a checkpoint's manifest (403): the retention stopped
    there (PermissionError), deleting no other checkpoint. That checkpoint now stays committed
    and whole (nothing of it deleted), a warning says so, and the retention goes on."""
    url, opts = f"s3://{counted.bucket}/run", counted.options
    counted.forbid = ("step_000000001/manifest.json",)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    _three_saves(url, opts, tmp_path)
    entries = RemoteStore(url, opts).scan()
    assert [e.name for e in entries if e.problem is None] == ["step_000000001", "step_000000003"]
    assert [e.name for e in entries if e.problem is not None] == []
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("still committed and whole" in m and "step_000000001" in m for m in said), said


def test_an_upload_checks_the_blobs_it_put_by_a_request_each_where_that_is_fewer(counted, tmp_path):
    """After putting its blobs an upload listed every blob to check their sizes: among
    2,100 blobs, three listing pages to check two blobs. It now asks for those alone, by
    a HEAD each, where that sends fewer requests than a listing (an upload of many blobs
    into a small store still lists once: the test above); what a HEAD answers fingerprints
    the blob as a listing does, so the next upload reusing it reads nothing back."""
    url, opts = f"s3://{counted.bucket}/run", counted.options
    unused = [f"{i:032x}.safetensors" for i in range(2100)]
    _put_straight(counted.bucket, {f"run/blobs/{n}": b"x" for n in unused})
    with Checkpointer(tmp_path / "local", incremental=True, async_save=False) as ck:
        ck.save(7, {f"t{i}": torch.full((4096,), float(100 + i)) for i in range(2)})
    ckpt = str(tmp_path / "local" / "step_000000007")
    store = RemoteStore(url, opts)
    counted.take()
    store.upload(ckpt, read_manifest(ckpt), "step_000000007")
    got = counted.take()
    # what is there (3 pages), then a HEAD per blob put (the other HEAD: the manifest's
    # check); before, 3 more pages
    assert got.get("LIST blobs/") == 3 and got.get("HEAD") == 1 + 2, got
    store.upload(ckpt, read_manifest(ckpt), "step_000000008")  # reuses the two blobs
    assert store.blobs_verified.read_back == 0
    entries = RemoteStore(url, opts).scan()
    assert [e.name for e in entries if e.problem is None] == ["step_000000007", "step_000000008"]


@pytest.mark.parametrize("incremental", [True, False])
def test_gc_remote_scans_the_store_no_more_than_it_needs(counted, tmp_path, incremental):
    """``gc DIR --remote URL`` scanned the store three times: an early check, before DIR's
    lock, that it can be listed; its plan; its blob collection's own scan after announcing
    itself. Where DIR has nothing to delete, the check is made under DIR's lock and is the
    plan's (nothing runs between them: no staler view); the collection still scans after its
    announcement, and is not made where the store holds no blob at all."""
    from test_cli import cli

    url, opts = f"s3://{counted.bucket}/run", counted.options
    with Checkpointer(
        tmp_path / "run", incremental=incremental, remote=url, remote_options=opts,
        keep_last=1, remote_keep_last="all", async_save=False,
    ) as ck:  # fmt: skip
        for s in (1, 2, 3):
            ck.save(s, {f"t{i}": torch.full((4096,), float(10 * s + i)) for i in range(2)})
            assert ck._dir.sync.wait(60)
    o = [f"-o{k}={v}" for k, v in opts.items() if k != "client_kwargs"]
    o += ["-o", 'client_kwargs={"region_name": "us-east-1"}', "-o", "skip_instance_cache=true"]
    empty = tmp_path / "empty"
    empty.mkdir()
    counted.take()
    counted.listed.clear()
    r = cli("gc", str(empty), "--remote", url, "--keep-last", "1", *o)
    assert r.returncode == 0, r.stderr
    scans = [p for p in counted.listed if p.rstrip("/") == "run"]  # (the whole store)
    assert len(scans) == (2 if incremental else 1), counted.listed  # (3 before)
    entries = RemoteStore(url, opts).scan()
    assert [e.name for e in entries] == ["step_000000003"]
    if incremental:
        assert {n for n in listing(RemoteStore(url, opts)) if not n.startswith(".")} == {
            b.path for b in entries[0].manifest.blobs
        }


def test_a_retention_delete_whose_deletion_mark_the_store_refuses_goes_on_to_the_blobs(
    counted, tmp_path, caplog
):
    """The store refusing the DELETE of a checkpoint's deletion mark alone, the last request
    of its deletion (its manifest and files gone): a bare PermissionError ended the retention
    pass, so the blob collection that follows it never ran (the blobs of step 1 stayed, and a
    folder left with its mark, swept again at every pass once stale, ended each one there).
    It is a refusal as any other (RemoteDeleteRefusedError: the folder uncommitted, the mark
    left), said, and the pass goes on to collect the blobs no checkpoint names."""
    from resilient_callbacks import RemoteDeleteRefusedError

    url, opts = f"s3://{counted.bucket}/run", counted.options
    counted.forbid = ("step_000000001/.writer-deleting",)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    with Checkpointer(
        tmp_path / "local", incremental=True, remote=url, remote_options=opts,
        remote_keep_last=1, async_save=False,
    ) as ck:  # fmt: skip
        for s in (1, 2):
            ck.save(s, {f"t{i}": torch.full((4096,), float(10 * s + i)) for i in range(2)})
            assert ck._dir.sync.wait(60)
    store = RemoteStore(url, opts)
    left = [p.rsplit("/", 1)[-1] for p in store.fs.find(store._path("step_000000001"))]
    assert left == [".writer-deleting"], left
    entries = store.scan()
    assert [e.name for e in entries if e.problem is None] == ["step_000000002"]
    named = {b.path for e in entries if e.manifest is not None for b in e.manifest.blobs}
    assert {n for n in listing(store) if not n.startswith(".")} == named  # (4 before: 2 more)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("refused to delete" in m and ".writer-deleting" in m for m in said), said
    with pytest.raises(RemoteDeleteRefusedError) as got:  # (a later deletion: the same)
        store.delete("step_000000001")
    assert not got.value.committed and list(got.value.refused) == [
        store.fs._strip_protocol(store._path("step_000000001", ".writer-deleting"))
    ]


def test_gc_remote_goes_on_past_a_checkpoint_the_store_refuses_to_delete(counted, tmp_path):
    """``gc --remote`` deleting a checkpoint whose manifest the store refuses (403): the
    RemoteDeleteRefusedError ended the command there, so no later checkpoint was deleted, no
    blob collected, and nothing said what had been deleted before. It now says the refusal
    (stderr, ``failed`` in --json), goes on with the others, and exits 1."""
    from test_cli import cli

    url, opts = f"s3://{counted.bucket}/run", counted.options
    with Checkpointer(
        tmp_path / "run", remote=url, remote_options=opts, keep_last=1,
        remote_keep_last="all", async_save=False,
    ) as ck:  # fmt: skip
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.full((64,), float(s))})
            assert ck._dir.sync.wait(60)
    counted.forbid = ("step_000000001/manifest.json",)
    o = [f"-o{k}={v}" for k, v in opts.items() if k != "client_kwargs"]
    o += ["-o", 'client_kwargs={"region_name": "us-east-1"}', "-o", "skip_instance_cache=true"]
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli("gc", str(empty), "--remote", url, "--keep-last", "1", "--json", *o)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "refused to delete" in r.stderr and "step_000000001" in r.stderr, r.stderr
    got = json.loads(r.stdout)["remote"]
    assert [d["name"] for d in got["delete"]] == ["step_000000002"], got
    assert [d["name"] for d in got["failed"]] == ["step_000000001"], got
    assert "still committed and whole" in got["failed"][0]["error"]
    entries = RemoteStore(url, opts).scan()
    assert [e.name for e in entries if e.problem is None] == ["step_000000001", "step_000000003"]
