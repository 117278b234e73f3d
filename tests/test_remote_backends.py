"""The remote tier on fsspec stores other than S3: a store in this process (fsspec's memory
filesystem, under protocols of its own) that refuses deletes the way gcsfs and adlfs say it
(their exception types and texts, as their sources raise them), so that a refusal is told
apart from an outage whatever the backend, and a store's identity (``RemoteStore.key``) holds
what makes two URLs two stores. No request leaves the process; no code of ours is patched."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from resilient_callbacks import Checkpointer
from resilient_callbacks.errors import RemoteDeleteRefusedError
from resilient_callbacks.remote import RemoteStore

TIMEOUT_S = 120.0


class HttpError(Exception):
    """As gcsfs.retry.HttpError: the message and ``.code`` of a cloud error answer."""

    def __init__(self, error: dict[str, Any]) -> None:
        self.code, self.message = error.get("code"), f"{error.get('message', '')}, {error['code']}"
        super().__init__(self.message)


class HttpResponseError(Exception):
    """As azure.core.exceptions.HttpResponseError: ``.status_code``, ``.reason``."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code, self.reason = status_code, "Forbidden"
        self.error_code = "AuthorizationPermissionMismatch"


def _refusal(style: str, path: str, batch: bool) -> Exception:
    """The error a backend raises when the credentials may not delete ``path``."""
    if style == "gcs":  # gcsfs: validate_response's 403; _rm raises a batch's first error
        if batch:
            return OSError(f'{{"code": 403, "message": "rc@p.iam does not have storage.objects'
                           f'.delete access to {path}."}}')  # fmt: skip
        return OSError(f"Forbidden: {path}\nrc@p.iam does not have storage.objects.delete access")
    if style == "gcs-401":  # gcsfs: not retried, raised as HttpError
        return HttpError({"code": 401, "message": "Anonymous caller does not have access"})
    if style == "azure":  # adlfs: the SDK's error; its batched _rm wraps it in a RuntimeError
        e = HttpResponseError("This request is not authorized to perform this operation", 403)
        if not batch:
            return e
        try:
            raise e
        except HttpResponseError as inner:
            try:
                raise RuntimeError("Failed to remove %s for %s", [path], inner)
            except RuntimeError as outer:
                return outer
    raise AssertionError(style)


class DenyingFS(MemoryFileSystem):
    """An object store in this process whose deletes ``refuse(path)`` refuses, as ``style``'s
    backend does; every delete request is recorded in ``asked``."""

    protocol: ClassVar = ("rcdeny",)
    store: ClassVar[dict] = {}
    pseudo_dirs: ClassVar[list] = [""]
    style = "gcs"
    refuse: ClassVar = staticmethod(lambda path: False)
    stall: ClassVar = staticmethod(lambda path: False)  # a delete of one object gets no answer
    asked: ClassVar[list[str]] = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("rcdeny://"))

    def rm_file(self, path):
        path = self._strip_protocol(path)
        self.asked.append(path)
        if self.stall(path):  # (as gcsfs's and adlfs's clients say a request timed out)
            raise TimeoutError(f"no answer deleting {path} within 60 s")
        if self.refuse(path):
            raise _refusal(self.style, path, batch=False)
        super().rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):
        paths = [path] if isinstance(path, str) else list(path)
        self.asked.extend(self._strip_protocol(p) for p in paths)
        found = [x for p in paths for x in self.expand_path(p, recursive=recursive)]
        bad = [p for p in found if self.refuse(self._strip_protocol(p))]
        for p in found:  # (the others go, as in a batch the store answered in part)
            if p not in bad and self.isfile(p):
                MemoryFileSystem.rm_file(self, p)
        if bad:
            raise _refusal(self.style, bad[0], batch=True)


fsspec.register_implementation("rcdeny", DenyingFS, clobber=True)


@pytest.fixture
def deny():
    DenyingFS.store.clear()
    DenyingFS.pseudo_dirs[:] = [""]
    DenyingFS.asked.clear()
    DenyingFS.refuse = staticmethod(lambda path: False)
    DenyingFS.stall = staticmethod(lambda path: False)
    fsspec.filesystem("rcdeny").invalidate_cache()
    yield DenyingFS
    DenyingFS.refuse = staticmethod(lambda path: False)
    DenyingFS.stall = staticmethod(lambda path: False)


def _url() -> str:
    return f"rcdeny://rc-{uuid.uuid4().hex[:10]}/run"


def _saves(url: str, tmp_path, steps: int, keep: int = 1) -> None:
    with Checkpointer(
        tmp_path / "local", remote=url, remote_keep_last=keep, keep_last=1, async_save=False
    ) as ck:
        for s in range(1, steps + 1):  # each uploaded before the next save: one behind was
            _save_and_upload(ck, s)  # skipped (uploads behind the saves), racy under load


def _committed(url: str) -> list[str]:
    return sorted(e.name for e in RemoteStore(url).scan() if e.problem is None)


@pytest.mark.parametrize("style", ["gcs", "gcs-401", "azure"])
def test_a_refused_manifest_delete_is_a_refusal_on_any_backend(deny, tmp_path, style):
    """gcsfs says a 403 as a plain OSError ("Forbidden: ...") and a 401 as its HttpError
    (``.code``), adlfs as the SDK's error (``.status_code``): only botocore's answer and a
    PermissionError were known refusals, so the deletion raised the library's error, which
    stopped the retention pass and ``gc --remote``. Each is now the clear refusal (what was
    refused, that the checkpoint is whole, what to grant)."""
    url = _url()
    _saves(url, tmp_path, 1)
    deny.style, deny.refuse = style, staticmethod(lambda path: True)
    store = RemoteStore(url)
    with pytest.raises(RemoteDeleteRefusedError, match="still committed and whole") as e:
        store.delete("step_000000001")
    assert e.value.committed and "step_000000001" in str(e.value)
    assert "Allow deletes under this prefix (grant delete rights" in str(e.value)
    assert _committed(url) == ["step_000000001"]


@pytest.mark.parametrize("style", ["gcs", "azure"])
def test_a_refused_batched_delete_names_each_refused_file(deny, tmp_path, style):
    """The manifest goes, the files' batched ``fs.rm`` is refused: gcsfs raised the first
    error's JSON as an OSError, adlfs a RuntimeError holding the SDK's error, and that came out
    of the deletion as is. Each file is now tried by itself and each refusal named in the
    clear error (the folder uncommitted: no reader sees it)."""
    url = _url()
    _saves(url, tmp_path, 1)
    deny.style = style
    deny.refuse = staticmethod(lambda p: p.endswith(".safetensors"))
    store = RemoteStore(url)
    with pytest.raises(RemoteDeleteRefusedError, match="no longer committed") as e:
        store.delete("step_000000001")
    assert not e.value.committed
    assert e.value.refused and all(p.endswith(".safetensors") for p in e.value.refused)
    assert _committed(url) == []
    deny.refuse = staticmethod(lambda path: False)
    store.delete("step_000000001")  # a later deletion takes the rest
    assert store.fs.find(store._path("step_000000001")) == []


@pytest.mark.parametrize("style", ["gcs", "azure"])
def test_a_file_delete_without_an_answer_after_a_refused_batch_is_an_outage(deny, tmp_path, style):
    """The batched ``fs.rm`` refused (an answer), each file is sent again by itself: one that
    then got no answer (a timeout) was counted as refused, a RemoteDeleteRefusedError that
    told the user to grant delete rights and held the checkpoint back for 10 min to 6 h; the
    store may still carry that delete out. It now raises as the outage it is (the retention
    says it and tries again after the next upload)."""
    url = _url()
    _saves(url, tmp_path, 1)
    deny.style = style
    deny.refuse = staticmethod(lambda p: p.endswith(".safetensors"))
    deny.stall = staticmethod(lambda p: p.endswith(".safetensors"))
    with pytest.raises(TimeoutError, match="no answer deleting"):
        RemoteStore(url).delete("step_000000001")


def test_a_retention_refused_for_one_checkpoint_goes_on_with_the_others(deny, tmp_path, caplog):
    """On gcsfs the refusal of step 1's manifest stopped the retention pass: step 2 stayed
    too. Now the refusal is said and the retention goes on as on S3."""
    url = _url()
    deny.refuse = staticmethod(lambda p: "step_000000001/" in p and "/.writer-" not in p)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    _saves(url, tmp_path, 3)
    assert _committed(url) == ["step_000000001", "step_000000003"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("refused to delete" in m and "step_000000001" in m for m in said), said


class HostFS(MemoryFileSystem):
    """A store whose URL names its host, which fsspec moves into the storage options (as for
    ``sftp://``, ``ftp://``, ``hdfs://``, ``smb://``): the root no longer says which host."""

    protocol: ClassVar = ("rchost",)
    store: ClassVar[dict] = {}
    pseudo_dirs: ClassVar[list] = [""]

    @classmethod
    def _strip_protocol(cls, path):
        if path.startswith("rchost://"):  # (the host is an option)
            path = "/" + path.removeprefix("rchost://").partition("/")[2]
        return super()._strip_protocol(path)

    @staticmethod
    def _get_kwargs_from_urls(path):
        return {"host": path.removeprefix("rchost://").partition("/")[0]}


fsspec.register_implementation("rchost", HostFS, clobber=True)


def test_one_bucket_name_on_two_endpoints_is_two_stores():
    """The store key (one writer per store in a process; the upload threads' hand-over) was
    the protocol and root alone: the same bucket on two S3 endpoints (a cloud's and an on-site
    MinIO's), or one path on two hosts, shared it, so the second writer was refused as the
    first's double. The options that say which service holds the store are in it now; the
    same store, its endpoint spelled otherwise or written with other credentials, keeps one."""
    pytest.importorskip("s3fs")
    a = {"endpoint_url": "http://127.0.0.1:9000", "key": "k1", "secret": "s1"}
    keys = {
        RemoteStore("s3://bucket/run", a).key,
        RemoteStore("s3://bucket/run", {**a, "endpoint_url": "http://127.0.0.1:9001"}).key,
        RemoteStore("s3://bucket/run", {"client_kwargs": {"endpoint_url": "http://10.0.0.7"}}).key,
        RemoteStore("s3://bucket/run").key,
        RemoteStore("rchost://host-a/data/run").key,
        RemoteStore("rchost://host-b/data/run").key,
    }
    assert len(keys) == 6, keys
    same = RemoteStore("s3://bucket/run/", {"endpoint_url": "HTTP://127.0.0.1:9000/", "anon": True})
    assert same.key == RemoteStore("s3://bucket/run", a).key
    assert (
        RemoteStore("rchost://HOST-A/data/run").key == RemoteStore("rchost://host-a/data/run").key
    )
    assert all("k1" not in k and "s1" not in k for k in keys)  # (no credentials in it)


def test_a_store_that_refuses_every_delete_is_asked_once_per_checkpoint_and_told_once(
    deny, tmp_path, caplog
):
    """Every retention pass asked again for every checkpoint the store had refused to delete
    (the refused ones stay committed, so each pass planned them all again: a request more at
    each upload) and warned again each hour. Each refusal is now remembered and tried again
    only after a growing wait; the warning, naming what to grant, comes once."""
    url = _url()
    deny.refuse = staticmethod(lambda p: "/step_" in p and "/.writer-" not in p)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    _saves(url, tmp_path, 5)
    assert _committed(url) == [f"step_00000000{s}" for s in range(1, 6)]
    asked = [p for p in deny.asked if p.endswith("/manifest.json")]
    assert sorted(asked) == sorted(set(asked)), asked  # (before: step 1 four times, ...)
    assert len(asked) == 4, asked
    said = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "refused to delete" in r.getMessage()
    ]
    assert len(said) == 1, said
    assert "still committed and whole" in said[0] and "Allow deletes" in said[0]


def test_a_refused_checkpoint_is_tried_again_after_a_growing_bounded_wait():
    from resilient_callbacks.upload_thread import REFUSED_RETRY_MAX_S, REFUSED_RETRY_S, Refusals

    r = Refusals()
    assert r.due("a", now=0.0)
    waits, now = [], 0.0
    for _ in range(8):
        waits.append(r.refused("a", now=now))
        assert not r.due("a", now=now + waits[-1] - 1) and r.due("a", now=now + waits[-1])
        now += waits[-1]
    assert waits[0] == REFUSED_RETRY_S and waits[1] == 2 * REFUSED_RETRY_S
    assert waits == sorted(waits) and waits[-1] == REFUSED_RETRY_MAX_S
    assert r.due("b", now=now)  # (each checkpoint its own)
    r.deleted("a")
    assert r.due("a", now=now)


def _save_and_upload(ck, step: int) -> None:
    ck.save(step, {"w": torch.full((8,), float(step))})
    assert ck._dir.sync.wait(TIMEOUT_S), "the upload never ended"


def test_refused_checkpoints_are_asked_again_at_the_next_pass_once_a_delete_succeeds(
    deny, tmp_path
):
    """The permissions fixed, the checkpoints refused before waited out their doubling wait
    (up to 6 h) although every delete was now carried out. A delete that succeeds after
    refusals now makes the others due at the next pass, once each."""
    url = _url()
    deny.refuse = staticmethod(lambda p: "/step_" in p and "/.writer-" not in p)
    with Checkpointer(
        tmp_path / "local", remote=url, remote_keep_last=1, keep_last=1, async_save=False
    ) as ck:
        for s in range(1, 5):
            _save_and_upload(ck, s)
        assert _committed(url) == [f"step_00000000{s}" for s in range(1, 5)]
        deny.refuse = staticmethod(lambda path: False)  # (the rights granted)
        _save_and_upload(ck, 5)  # step 4 (never refused) deleted: the others due
        _save_and_upload(ck, 6)
        assert _committed(url) == ["step_000000006"]  # (before: steps 1 to 3 kept for 10+ min)
        assert not ck._dir.sync._refusals._names


def test_a_refused_checkpoint_that_someone_else_deleted_is_forgotten(deny, tmp_path):
    """The backoff of a refused checkpoint was kept for the rest of the process, also once
    the checkpoint was gone from the store (deleted by an admin, by ``gc`` elsewhere): now a
    retention pass's listing forgets every name it no longer holds."""
    url = _url()
    deny.refuse = staticmethod(lambda p: "/step_000000001/" in p and "/.writer-" not in p)
    with Checkpointer(
        tmp_path / "local", remote=url, remote_keep_last=1, keep_last=1, async_save=False
    ) as ck:
        _save_and_upload(ck, 1)
        _save_and_upload(ck, 2)  # step 1 refused
        assert set(ck._dir.sync._refusals._names) == {"step_000000001"}
        deny.refuse = staticmethod(lambda path: False)
        fsspec.filesystem("rcdeny").rm(url.removeprefix("rcdeny://") + "/step_000000001", True)
        _save_and_upload(ck, 3)
        assert not ck._dir.sync._refusals._names
        assert _committed(url) == ["step_000000003"]


def test_a_delete_that_succeeds_shortens_each_other_refusals_wait_once():
    from resilient_callbacks.upload_thread import REFUSED_RETRY_S, Refusals

    r = Refusals()
    r.refused("a", now=0.0)
    r.refused("b", now=0.0)
    r.deleted("c", now=10.0)  # (another checkpoint deleted: the rights may be fixed)
    assert r.due("a", now=10.0) and r.due("b", now=10.0)
    assert r.refused("a", now=10.0) == 2 * REFUSED_RETRY_S  # (refused again: its backoff goes on)
    r.deleted("d", now=20.0)
    assert not r.due("a", now=20.0), "shortened once only: a lock that holds is not asked again"
    r.prune(["a"])
    assert r.due("b", now=0.0) and not r.due("a", now=20.0)


class GatedFS(MemoryFileSystem):
    """A store in this process whose requests on a path holding ``held`` wait (``inside``
    set) until ``go`` is set: a store that stopped answering, for as long as a test says.
    Every put is recorded in ``puts``, with the thread that sent it."""

    protocol: ClassVar = ("rcgate",)
    store: ClassVar[dict] = {}
    pseudo_dirs: ClassVar[list] = [""]
    held: ClassVar[str | None] = None
    inside: ClassVar = threading.Event()
    go: ClassVar = threading.Event()
    puts: ClassVar[list[tuple[str, str]]] = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("rcgate://"))

    def _gate(self, path: str) -> None:
        if self.held is not None and self.held in path:
            self.inside.set()
            assert self.go.wait(120), "the test never let the request go"

    def rm_file(self, path):
        self._gate(path)
        super().rm_file(path)

    def put_file(self, lpath, rpath, *args, **kwargs):
        self.puts.append((threading.current_thread().name, self._strip_protocol(rpath)))
        self._gate(rpath)
        return super().put_file(lpath, rpath, *args, **kwargs)


fsspec.register_implementation("rcgate", GatedFS, clobber=True)


@pytest.fixture
def gated():
    GatedFS.store.clear()
    GatedFS.pseudo_dirs[:] = [""]
    GatedFS.puts.clear()
    GatedFS.held = None
    GatedFS.inside, GatedFS.go = threading.Event(), threading.Event()
    yield GatedFS
    GatedFS.go.set()
    GatedFS.held = None


def _part(root, seq: int):
    from resilient_callbacks.filewrite import write_bytes
    from resilient_callbacks.manifest import FileEntry

    name = f"step_{seq:09d}"
    (root / name).mkdir(parents=True, exist_ok=True)
    d = write_bytes(str(root / name / "rank_00000.bin"), bytes([seq]) * (100 + seq))
    return name, ("run1", seq), [FileEntry("rank_00000.bin", d.size, d.xxh3_64, 0, "tensors")]


def test_a_stopped_node_uploader_begins_no_upload_after_its_deletes(gated, tmp_path):
    """A node's uploader, deleting its part of a checkpoint the coordinator dropped while the
    store hung, was stopped (close() gave up and released the store, which the next writer
    may own by then); when the delete returned it went on to upload the next queued part,
    putting it under a name the next writer's retention may just have deleted. It stops
    there now: nothing more goes up."""
    from resilient_callbacks.node_upload import NodeUploader

    store = RemoteStore(f"rcgate://rc-{uuid.uuid4().hex[:10]}/run")
    up = NodeUploader(store, str(tmp_path), 0)
    try:
        name1, key1, files1 = _part(tmp_path, 1)
        up.enqueue(name1, name1, key1, files1)
        assert up.wait(60)
        name2, key2, files2 = _part(tmp_path, 2)
        gated.held = f"/{name2}/"  # (step 2's upload hangs: step 3 queues behind it)
        up.enqueue(name2, name2, key2, files2)
        assert gated.inside.wait(60)
        name3, key3, files3 = _part(tmp_path, 3)
        up.enqueue(name3, name3, key3, files3)
        up.settle(upload=[key2, key3], dropped=[key1])  # (step 1 is never committed)
        step2 = gated.go
        gated.inside, gated.go = threading.Event(), threading.Event()
        gated.held = f"/{name1}/"  # its delete hangs in turn
        step2.set()
        assert gated.inside.wait(60)  # deleting step 1's part, step 3 taken for the next attempt
        up.stop(join_s=0)  # close() gives up
        gated.go.set()
        up._thread.join(60)
        assert not up._thread.is_alive()
    finally:
        gated.go.set()
        up.stop()
    assert not [p for _, p in gated.puts if f"/{name3}/" in p], gated.puts
    assert store.fs.find(store._path(name3)) == []


def test_the_next_writer_waits_for_a_stopped_node_uploaders_attempt(gated, tmp_path, caplog):
    """The next writer of the store in this process (a notebook's next cell) waited for the
    previous writer's stopped remote commit, never for its node uploads: its own upload, and
    its retention's deletions, ran while the old attempt still put a part. Its node uploader
    and its committer now wait for it, as for a stopped commit, and say so."""
    from resilient_callbacks.node_upload import NodeUploader
    from resilient_callbacks.remote_commit import RemoteCommitter
    from resilient_callbacks.retention import RetentionPolicy

    url = f"rcgate://rc-{uuid.uuid4().hex[:10]}/run"
    store = RemoteStore(url)
    old = NodeUploader(store, str(tmp_path / "old"), 0)
    new = committer = None
    said, waiting = threading.Event(), set()

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for the upload of the previous writer" in record.getMessage():
                waiting.add(record.threadName)
                if len(waiting) == 2:  # (the new node uploader and the new committer)
                    said.set()

    handler = Said()
    caplog.set_level(logging.INFO, "resilient_callbacks")
    logging.getLogger("resilient_callbacks").addHandler(handler)
    try:
        name1, key1, files1 = _part(tmp_path / "old", 1)
        gated.held = f"/{name1}/"
        old.enqueue(name1, name1, key1, files1)
        assert gated.inside.wait(60)
        assert not old.wait(0.0)
        old.stop(join_s=0)  # close() gives up on the attempt under way
        store2 = RemoteStore(url)
        new = NodeUploader(store2, str(tmp_path / "new"), 0)
        committer = RemoteCommitter(store2, 1, RetentionPolicy(keep_last=1))
        name2, key2, files2 = _part(tmp_path / "new", 2)
        new.enqueue(name2, name2, key2, files2)
        assert said.wait(60)  # (before: it uploaded at once, beside the old attempt)
        assert not [p for t, p in gated.puts if f"/{name2}/" in p]
        gated.go.set()
        old._thread.join(60)
        assert new.wait(60)
    finally:
        gated.go.set()
        logging.getLogger("resilient_callbacks").removeHandler(handler)
        for t in (old, new, committer):
            if t is not None:
                t.stop()
    waits = [r for r in caplog.records if "waits for the upload of the previous" in r.getMessage()]
    names = {r.threadName.rsplit("-", 1)[0] for r in waits}  # (rc-node-upload-7: numbered)
    assert names == {"rc-node-upload", "rc-remote-commit"}, waits
    puts = [p for _, p in gated.puts]
    assert max(i for i, p in enumerate(puts) if f"/{name1}/" in p) < min(
        i for i, p in enumerate(puts) if f"/{name2}/" in p
    )


def test_gc_remote_on_gcs_goes_on_past_a_refused_checkpoint(deny, tmp_path, capsys):
    """``gc --remote`` on a store other than S3 whose 403 is gcsfs's OSError: the command
    ended with that traceback at the first refused checkpoint. It says the refusal, deletes
    the others and exits 1, as on S3."""
    import json

    from resilient_callbacks.cli import main

    url = _url()
    _saves(url, tmp_path, 3, keep="all")
    deny.refuse = staticmethod(lambda p: "step_000000001/" in p and "/.writer-" not in p)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["gc", str(empty), "--remote", url, "--keep-last", "1", "--json"]) == 1
    out, err = capsys.readouterr()
    assert "refused to delete" in err and "step_000000001" in err, err
    got = json.loads(out)["remote"]
    assert [d["name"] for d in got["delete"]] == ["step_000000002"], got
    assert [d["name"] for d in got["failed"]] == ["step_000000001"], got
    assert _committed(url) == ["step_000000001", "step_000000003"]


def test_one_store_spelled_two_ways_is_one_store(monkeypatch):
    """Two keys for one store let two writers of this process write it at once (the one-writer
    claim and the upload threads' hand-over go by the key). The key held the option's path
    (``client_kwargs.endpoint_url`` against ``endpoint_url``), the service's own endpoint
    spelled against none, the port a URL's scheme implies, and missed the endpoint that
    botocore takes from ``AWS_ENDPOINT_URL``: each spelling below was a store of its own."""
    pytest.importorskip("s3fs")
    minio = "http://127.0.0.1:9000"
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", raising=False)
    on_minio = {
        RemoteStore("s3://bucket/run", {"endpoint_url": minio}).key,
        RemoteStore("s3://bucket/run", {"client_kwargs": {"endpoint_url": minio + "/"}}).key,
        RemoteStore("s3://bucket/run", {"endpoint_url": "HTTP://127.0.0.1:9000"}).key,
    }
    on_aws = {
        RemoteStore("s3://bucket/run").key,
        RemoteStore("s3://bucket/run", {"endpoint_url": "https://s3.amazonaws.com"}).key,
        RemoteStore("s3://bucket/run", {"endpoint_url": "https://s3.eu-west-1.amazonaws.com"}).key,
    }
    secure = {
        RemoteStore("s3://bucket/run", {"endpoint_url": "https://minio.lab"}).key,
        RemoteStore("s3://bucket/run", {"endpoint_url": "https://minio.lab:443/"}).key,
    }
    assert len(on_minio) == 1 and len(on_aws) == 1 and len(secure) == 1, (on_minio, on_aws, secure)
    assert len(on_minio | on_aws | secure) == 3  # (still three stores)
    monkeypatch.setenv("AWS_ENDPOINT_URL", minio)  # (botocore's endpoint for every client)
    assert RemoteStore("s3://bucket/run").key in on_minio
    assert RemoteStore("s3://bucket/run", {"endpoint_url": "https://minio.lab"}).key in secure
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://minio.lab")  # (S3's own before it)
    assert RemoteStore("s3://bucket/run").key in secure


def test_an_azure_account_or_a_default_port_spelled_two_ways_is_one_identity():
    """(adlfs and an sftp server are not needed to read the options.) An Azure account given
    by name, account URL or connection string, and a port its protocol's default, were each
    an identity of its own."""
    from resilient_callbacks.store_key import store_identity

    conn = "DefaultEndpointsProtocol=https;AccountName=Acct1;AccountKey=c2VjcmV0;EndpointSuffix=core.windows.net"
    azure = [
        store_identity({"account_name": "acct1"}, "abfs"),
        store_identity({"account_url": "https://acct1.blob.core.windows.net/"}, "abfs"),
        store_identity({"connection_string": conn}, "abfs"),
    ]
    assert azure == [{"account_name": "acct1"}] * 3, azure
    assert store_identity({"account_name": "acct2"}, "abfs") != azure[0]
    assert store_identity({"host": "h", "port": 22}, "sftp") == store_identity(
        {"host": "H"}, "sftp"
    )
    assert store_identity({"host": "h", "port": 2222}, "sftp") != store_identity(
        {"host": "h"}, "sftp"
    )


def _raised_in_handling(outer: Exception, inner: Exception) -> Exception:
    try:
        raise inner
    except Exception:
        try:
            raise outer
        except Exception as e:
            return e


def test_an_error_without_the_stores_answer_is_no_refusal(deny):
    """A refusal was recognised anywhere in an error's chain, before the error's own status:
    a 503 (or a timeout) raised while handling an earlier 403 (a client's retry after
    refreshing its credentials), and aiohttp's ClientConnectorError, which carries the
    socket's errno (EPERM where a local firewall drops the connection) and the socket's
    PermissionError, were refusals: the delete said done by the store, the checkpoint held
    back 10 min to 6 h, the user told to grant rights while the store had answered nothing."""
    import errno

    from resilient_callbacks import remote_paths

    fs = RemoteStore(_url()).fs
    forbidden = HttpError({"code": 403, "message": "no storage.objects.delete"})
    no_answer = [
        _raised_in_handling(HttpError({"code": 503, "message": "backendError"}), forbidden),
        _raised_in_handling(TimeoutError("no answer within 60 s"), forbidden),
    ]
    aiohttp = pytest.importorskip("aiohttp")
    blocked = PermissionError(errno.EPERM, "Operation not permitted")
    no_answer.append(aiohttp.ClientConnectorError(None, blocked))
    no_answer.append(aiohttp.ClientConnectorError(None, PermissionError(errno.EACCES, "denied")))
    for e in no_answer:
        assert not remote_paths.denied(e), repr(e)
        assert not remote_paths.answered(fs, e), repr(e)
    # (the store's own refusals still are, also raised while handling an outage)
    for e in (
        forbidden,
        _raised_in_handling(HttpError({"code": 403, "message": "denied"}), TimeoutError()),
        _refusal("azure", "/x", batch=True),
        _refusal("gcs", "/x", batch=False),
    ):
        assert remote_paths.denied(e) and remote_paths.answered(fs, e), repr(e)
