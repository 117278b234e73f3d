"""An upload reuses a blob already on the remote store only if it holds the local blob's bytes:
a blob's name is its tensor's hash, not its stored bytes' (another zstd, another run, damage
in place can put other bytes of the same size under the name). Checked once per process: by
the store's MD5 (S3's ETag) where it has one, else by reading the blob back."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from resilient_callbacks import Checkpointer
from resilient_callbacks.remote import RemoteStore


def _state() -> dict:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 32))
    m[0].requires_grad_(False)  # its weight: a blob every checkpoint shares
    return {"model": m}


def _frozen_blob(store: RemoteStore) -> str:
    shared = set.intersection(*({b.path for b in e.manifest.blobs} for e in store.scan()))
    return sorted(shared)[0]


def _ck(tmp_path, url: str, **kw) -> Checkpointer:
    return Checkpointer(tmp_path / "local", incremental=True, remote=url, async_save=False, **kw)


def _save(ck: Checkpointer, state: dict, step: int) -> None:
    with torch.no_grad():
        state["model"][1].weight.add_(float(step))
    ck.save(step, state)
    ck._dir.sync.wait(60)  # the upload, in the background


def test_a_remote_blob_of_the_right_size_but_other_bytes_is_uploaded_again(tmp_path, caplog):
    """file:// (no MD5): the frozen blob on the remote damaged in place, same size. The next
    run's upload read it back, found other bytes and uploaded the local blob again, loudly:
    the remote checkpoints are whole. It was reused as it was (same size): every remote
    checkpoint named a corrupt blob, unknown until a restore from the remote."""
    from resilient_callbacks.cli import main

    url, remote = f"file://{tmp_path}/durable", tmp_path / "durable"
    state = _state()
    with _ck(tmp_path, url) as ck:
        ck.save(1, state)
    name = _frozen_blob(RemoteStore(url))
    path = remote / "blobs" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"), _ck(tmp_path, url) as ck:
        assert ck.restore(state) == 1
        _save(ck, state, 2)
        assert path.read_bytes() == (tmp_path / "local" / "blobs" / name).read_bytes()
        _save(ck, state, 3)  # verified once in this process: not read back again
        read_back = ck.remote.blobs_verified.read_back
    assert name in caplog.text and "other bytes" in caplog.text, caplog.text
    assert "step_000000001" in caplog.text  # the earlier remote checkpoint, repaired too
    assert main(["verify", url, "--all"]) == 0
    assert read_back == 1


def test_a_remote_blob_another_run_recorded_with_other_bytes_is_not_replaced(tmp_path):
    """Another run's committed remote checkpoint records the blob's name with other bytes of
    the same size (another zstd version, say): replacing them would corrupt that checkpoint,
    reusing them would corrupt ours. The upload is refused, saying what to do. The upload
    committed a checkpoint naming bytes that were not its own."""
    import json
    import shutil

    from resilient_callbacks.filewrite import digest_file
    from resilient_callbacks.manifest import SELF_CHECKSUM, read_manifest, self_checksum

    url, remote = f"file://{tmp_path}/durable", tmp_path / "durable"
    state = _state()
    with _ck(tmp_path, url, remote_keep_last=5) as ck:
        ck.save(1, state)
    name = _frozen_blob(RemoteStore(url))
    path = remote / "blobs" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    other = remote / "step_000000009"  # another run's checkpoint, recording those bytes
    shutil.copytree(remote / "step_000000001", other)
    m = json.loads((other / "manifest.json").read_text())
    m["run_id"], m["seq"] = "another-run", 99
    for b in m["blobs"]:
        if b["path"] == name:
            b["xxh3_64"] = digest_file(str(path), like=b["xxh3_64"]).xxh3_64
    m.pop(SELF_CHECKSUM)
    m[SELF_CHECKSUM] = self_checksum(m)
    (other / "manifest.json").write_text(json.dumps(m))
    with Checkpointer(tmp_path / "next", incremental=True, async_save=False) as ck:
        ck.save(2, state)  # another run of the same weights, uploaded by hand (push)
    ours = tmp_path / "next" / "step_000000002"
    with pytest.raises(OSError, match="not replacing") as e:
        RemoteStore(url).upload(str(ours), read_manifest(str(ours)), "step_000000002")
    assert name in str(e.value) and "step_000000009" in str(e.value)
    assert not (remote / "step_000000002" / "manifest.json").exists()
    assert path.read_bytes() == bytes(data)  # the other run's bytes, left alone


def test_s3_reuse_is_checked_by_etag_and_a_replaced_blob_is_uploaded_again(s3_remote, tmp_path):
    """S3 (moto, s3fs): a reused blob is checked by its ETag (the MD5 of the local blob), not
    read back; one replaced by other bytes of its size (another writer) has another ETag, is
    read back and uploaded again."""
    url, opts = s3_remote
    state = _state()
    with _ck(tmp_path, url, remote_options=opts) as ck:
        ck.save(1, state)
    name = _frozen_blob(RemoteStore(url, opts))
    with _ck(tmp_path, url, remote_options=opts) as ck:
        ck.restore(state)
        _save(ck, state, 2)
        fs, where = ck.remote.fs, ck.remote._path("blobs", name)
        data = bytearray(fs.cat_file(where))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(where, bytes(data))
        _save(ck, state, 3)
        local = (tmp_path / "local" / "blobs" / name).read_bytes()
        assert fs.cat_file(where) == local
        # checked by the ETag (the MD5 of the local blob) at step 2, read back at step 3 only
        assert ck.remote.blobs_verified.read_back == 1


def test_a_blob_another_runs_collection_deletes_while_an_upload_relies_on_it(
    tmp_path, monkeypatch, caplog
):
    """Two processes and one remote URL. A blob is on the remote, named by no remote
    checkpoint; a collection (another run's) reads the in-flight markers, then an upload
    writes its marker, finds the blob there and relies on it; then the collection deletes it.
    The committed remote checkpoint named a missing blob: for as long as the collection ran,
    and for good when the uploading process was killed before it uploaded the blob again.
    Now the upload, before its commit, waits for the collection announced before it to end,
    finds the blob gone and uploads it again, loudly: its manifest never names a missing
    blob."""
    import os
    import threading

    from resilient_callbacks import remote as remote_mod
    from resilient_callbacks import remote_blobs, remote_put
    from resilient_callbacks.blobs import NAME_RE
    from resilient_callbacks.cli import main
    from resilient_callbacks.manifest import read_manifest

    url = f"file://{tmp_path}/durable"
    state = _state()
    with _ck(tmp_path, url) as ck:
        ck.save(1, state)
    RemoteStore(url).delete("step_000000001")  # its blobs stay, named by nothing
    ckpt = str(tmp_path / "local" / "step_000000001")
    blobs = [tmp_path / "durable" / "blobs" / b.path for b in read_manifest(ckpt).blobs]
    missing_at_commit: list[list[str]] = []
    real_commit = remote_mod.ManifestLastCommit.commit

    def commit(self, *a, **kw):
        out = real_commit(self, *a, **kw)  # the manifest is there: what does it name?
        missing_at_commit.append([b.name for b in blobs if not b.exists()])
        return out

    monkeypatch.setattr(remote_mod.ManifestLastCommit, "commit", commit)
    collector = RemoteStore(url)
    fs_class = type(collector.fs)  # (fsspec gives each thread its own instance)
    real_rm, real_put = fs_class.rm_file, remote_put.put
    relied, deleted = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def put(store, lpaths, rpaths, *a, **kw):  # the checkpoint's files: its blobs relied on
        if any("step_000000001/" in str(r) for r in rpaths) and not relied.is_set():
            relied.set()
            assert deleted.wait(60)
        return real_put(store, lpaths, rpaths, *a, **kw)

    def upload() -> None:
        try:
            RemoteStore(url).upload(ckpt, read_manifest(ckpt), "step_000000001")
        except BaseException as e:
            errors.append(e)
            relied.set()

    uploader = threading.Thread(target=upload)

    def rm_file(fs, path, *a, **kw):  # the collection's first delete of a blob: after reuse
        blob = NAME_RE.match(os.path.basename(str(path)))
        if blob and not uploader.is_alive() and not relied.is_set():
            uploader.start()
            assert relied.wait(60)
            out = real_rm(fs, path, *a, **kw)
            deleted.set()
            return out
        return real_rm(fs, path, *a, **kw)

    monkeypatch.setattr(fs_class, "rm_file", rm_file)
    monkeypatch.setattr(remote_put, "put", put)  # (the store's put of a list of files)
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
        assert remote_blobs.collect(collector)  # it deleted the blobs it found unused
    uploader.join(60)
    assert not uploader.is_alive() and not errors, errors
    monkeypatch.undo()
    assert missing_at_commit == [[]], "the committed manifest named a deleted blob"
    assert main(["verify", url, "--all"]) == 0  # every blob there, every checksum right
    assert "deleted meanwhile by another process" in caplog.text, caplog.text


def test_a_collection_marker_a_kill_left_delays_one_upload_once(tmp_path, monkeypatch):
    """A ``.collect-`` marker whose collection was killed: the next upload waits for it at
    most the collection's time bound (shortened here), then removes it and commits."""
    from resilient_callbacks import remote_blobs
    from resilient_callbacks.manifest import read_manifest

    url, remote = f"file://{tmp_path}/durable", tmp_path / "durable"
    state = _state()
    with Checkpointer(tmp_path / "local", incremental=True, async_save=False) as ck:
        ck.save(1, state)
    (remote / "blobs").mkdir(parents=True)
    left = remote / "blobs" / ".collect-deadbeef0000.json"
    left.write_text('{"created": 0}')
    monkeypatch.setattr(remote_blobs, "COLLECT_MAX_S", 0.0)
    monkeypatch.setattr(remote_blobs, "COLLECT_MARGIN_S", 0.0)
    ckpt = str(tmp_path / "local" / "step_000000001")
    RemoteStore(url).upload(ckpt, read_manifest(ckpt), "step_000000001")
    assert not left.exists()
    assert [e.name for e in RemoteStore(url).scan() if e.problem is None] == ["step_000000001"]


def test_a_collection_marker_older_than_its_time_bound_is_not_waited_for(tmp_path, monkeypatch):
    """A run killed while its remote retention collected blobs leaves ``.collect-``; the
    resumed run's first upload waited 90 s for it. Written more than the collection's time
    bound before this upload's in-flight marker (both times as the store lists them: no host
    clock involved), it can delete nothing this upload relies on: removed at once."""
    import os

    from resilient_callbacks import remote_blobs
    from resilient_callbacks.manifest import read_manifest

    url, remote = f"file://{tmp_path}/durable", tmp_path / "durable"
    with Checkpointer(tmp_path / "local", incremental=True, async_save=False) as ck:
        ck.save(1, _state())
    (remote / "blobs").mkdir(parents=True)
    left = remote / "blobs" / ".collect-deadbeef0000.json"
    left.write_text('{"created": 0}')
    an_hour_ago = left.stat().st_mtime - 3600
    os.utime(left, (an_hour_ago, an_hour_ago))

    def sleep(s: float) -> None:
        raise AssertionError(f"the upload waited for a collection a kill left ({s} s)")

    monkeypatch.setattr(remote_blobs.time, "sleep", sleep)
    ckpt = str(tmp_path / "local" / "step_000000001")
    RemoteStore(url).upload(ckpt, read_manifest(ckpt), "step_000000001")
    assert not left.exists()
    assert [e.name for e in RemoteStore(url).scan() if e.problem is None] == ["step_000000001"]


def test_a_collection_marker_of_a_process_that_exited_is_not_waited_for(tmp_path, monkeypatch):
    """A run killed mid-collection and restarted at once on the same host (torchrun's
    restarts, a requeue onto the same node): its marker is recent, but the process that wrote
    it (host and pid in the marker) is gone, so the next upload does not wait for it."""
    import json
    import socket
    import subprocess
    import sys

    from resilient_callbacks import remote_blobs
    from resilient_callbacks.manifest import read_manifest

    url, remote = f"file://{tmp_path}/durable", tmp_path / "durable"
    with Checkpointer(tmp_path / "local", incremental=True, async_save=False) as ck:
        ck.save(1, _state())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (remote / "blobs").mkdir(parents=True)
    left = remote / "blobs" / ".collect-deadbeef0000.json"
    body = {"created": 0, "host": socket.gethostname(), "pid": gone.pid}
    left.write_text(json.dumps(body))

    def sleep(s: float) -> None:
        raise AssertionError(f"the upload waited for a collection a kill left ({s} s)")

    monkeypatch.setattr(remote_blobs.time, "sleep", sleep)
    ckpt = str(tmp_path / "local" / "step_000000001")
    RemoteStore(url).upload(ckpt, read_manifest(ckpt), "step_000000001")
    assert not left.exists()
