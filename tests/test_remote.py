"""The remote tier, as a user sees it, against three stores with one conformance suite:
``memory://``, ``file://`` and a real S3 API server on 127.0.0.1 (moto) through s3fs.

Checked: what is uploaded and when it counts as committed, resume from remote when the local
directory is gone or damaged, tier-aware retention, the preflight errors; and for S3, a server
outage mid-training and a SIGKILL mid-upload."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

import spawn_ranks
from resilient_callbacks import (
    Checkpointer,
    ConfigError,
    ForeignCheckpointsWarning,
    ResumeFallbackWarning,
    catalog,
    remote_reads,
)
from resilient_callbacks.errors import (
    NoValidCheckpointError,
    RemoteUnavailableError,
    UploadIncompleteError,
)
from resilient_callbacks.remote import RemoteStore


def _state(v: float, n: int = 256) -> dict:
    # (float, as _fresh: an int step gave an int64 "b", cast on restore with a UserWarning)
    return {
        "w": torch.full((n,), float(v)),
        "b": torch.arange(n, dtype=torch.float32) * v,
        "meta": {"v": v},
    }


def _fresh(n: int = 256) -> dict:
    return {"w": torch.zeros(n), "b": torch.zeros(n), "meta": {"v": None}}


def _location(kind, request, tmp_path):
    if kind == "memory":
        yield f"memory://rc-{uuid.uuid4().hex[:10]}/run", None
    elif request.param == "file":
        yield f"file://{tmp_path}/durable/run", None
    else:
        yield request.getfixturevalue("s3_remote")


@pytest.fixture(params=["memory", "file", "s3"])
def remote(request, tmp_path):
    """(url, remote_options) of an empty location on each kind of store."""
    yield from _location(request.param, request, tmp_path)


@pytest.fixture(params=["file", "s3"])
def shared_remote(request, tmp_path):
    """As ``remote``, for stores another process can see (not memory://)."""
    yield from _location(request.param, request, tmp_path)


def _committed(url, options) -> dict[str, int]:
    """name -> step of the committed remote checkpoints; asserts none is torn."""
    out = {}
    for e in RemoteStore(url, options).scan():
        if e.manifest is not None:
            assert e.problem is None, f"committed remote checkpoint is incomplete: {e}"
            out[e.name] = e.manifest.step
    return out


def test_uploads_and_resumes_from_remote_when_local_is_gone(remote, tmp_path):
    url, opts = remote
    local = tmp_path / "local"
    with Checkpointer(local, remote=url, remote_options=opts, keep_last=2) as ck:
        assert ck.restore(_fresh()) == 0
        for s in (10, 20, 30):
            ck.save(s, _state(s))
    assert sorted(_committed(url, opts).values()) == [20, 30]
    # every remote file is byte-identical to the local one
    store = RemoteStore(url, opts)
    for name in os.listdir(local):
        if name.startswith("step_"):
            for f in os.listdir(local / name):
                remote_bytes = store.fs.cat_file(f"{store.root}/{name}/{f}")
                assert remote_bytes == (local / name / f).read_bytes()

    shutil.rmtree(local)  # the machine died with its disk
    state = _fresh()
    with Checkpointer(local, remote=url, remote_options=opts, keep_last=2) as ck:
        assert ck.restore(state) == 30
        assert ck.restored_from == str(local / "step_000000030")
        ck.save(40, _state(40))
    assert torch.equal(state["w"], _state(30)["w"]) and torch.equal(state["b"], _state(30)["b"])
    assert state["meta"] == {"v": 30}
    # the run continues its numbering after the remote checkpoints and keeps uploading
    assert sorted(_committed(url, opts).values()) == [30, 40]


def test_a_scan_fetches_only_the_manifests_it_has_not_read(remote, tmp_path, monkeypatch):
    """The uploader scans the remote after each upload: fetching every manifest again made an
    upload cost more the more checkpoints the remote held (the long-run probe: 1.5 s a scan at
    93). A manifest replaced under the same name is fetched again."""
    url, options = remote
    with Checkpointer(tmp_path / "ck", remote=url, remote_options=options) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(float(step)))
    store = RemoteStore(url, options)
    fetched: list[str] = []
    real = store.fs.cat

    def cat(paths, **kw):
        fetched.extend([paths] if isinstance(paths, str) else paths)
        return real(paths, **kw)

    monkeypatch.setattr(store.fs, "cat", cat)  # (a shared object: undone after the test)
    assert [e.manifest.step for e in store.scan()] == [1, 2, 3]
    assert len(fetched) == 3
    fetched.clear()
    assert [e.manifest.step for e in store.scan()] == [1, 2, 3]
    assert fetched == []  # nothing new: nothing fetched
    with Checkpointer(tmp_path / "ck", remote=url, remote_options=options) as ck:
        ck.restore(_fresh())
        ck.save(4, _state(4.0))
    fetched.clear()  # (fsspec shares the filesystem object: the Checkpointer's reads count too)
    assert [e.manifest.step for e in store.scan()] == [1, 2, 3, 4]
    assert len(fetched) == 1 and "step_000000004" in fetched[0]
    # the same name holding another manifest (rewritten by hand): read again
    time.sleep(0.01)  # a modification time of its own
    raw = store.fs.cat_file(f"{store.root}/step_000000004/manifest.json")
    changed = json.loads(raw)
    changed["step"] = 40
    store.fs.pipe_file(f"{store.root}/step_000000004/manifest.json", json.dumps(changed).encode())
    fetched.clear()
    entries = {e.name: e for e in store.scan()}
    assert len(fetched) == 1
    assert entries["step_000000004"].manifest is None  # its self-checksum no longer matches


def test_damaged_local_copy_falls_back_to_its_remote_copy(remote, tmp_path):
    url, opts = remote
    local = tmp_path / "local"
    with Checkpointer(local, remote=url, remote_options=opts, keep_last=3) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    f = local / "step_000000020" / "shared.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, wrong checksum: found only when loading
    f.write_bytes(bytes(data))
    state = _fresh()
    with (
        pytest.warns(
            ResumeFallbackWarning, match="checksum.*trying its copy in the remote tier next"
        ),
        Checkpointer(local, remote=url, remote_options=opts, keep_last=3) as ck,
    ):
        assert ck.restore(state) == 20  # not 10: the remote copy of step 20 is good
    assert torch.equal(state["w"], _state(20)["w"])
    # and the local copy was replaced by the verified download
    assert (local / "step_000000020" / "shared.safetensors").read_bytes() != bytes(data)


def test_a_local_copy_replaced_by_its_remote_copy_is_counted_by_keep_last(tmp_path):
    """The damaged local copy of step 20 is replaced by its verified remote copy at the
    restore: a good checkpoint, which keep_last then deletes like any other. It stayed for
    the rest of the run, kept "as corrupt" under its name (also after a run saved by two
    nodes resumed on one, where each node's part lacks the other's files)."""
    url, local = f"file://{tmp_path}/remote", tmp_path / "local"
    with Checkpointer(local, remote=url, keep_last=2) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    f = local / "step_000000020" / "shared.safetensors"
    f.write_bytes(f.read_bytes()[:-1] + b"\0")  # same size, wrong checksum
    with (
        pytest.warns(ResumeFallbackWarning, match="trying its copy in the remote tier next"),
        Checkpointer(local, remote=url, keep_last=2) as ck,
    ):
        assert ck.restore(_fresh()) == 20
        for s in (30, 40):
            ck.save(s, _state(s))
    assert sorted(n for n in os.listdir(local) if n.startswith("step_")) == [
        "step_000000030",
        "step_000000040",
    ]


def test_tier_retention_keeps_best_and_more_remotely(remote, tmp_path):
    url, opts = remote
    local = tmp_path / "local"
    losses = {10: 0.5, 20: 0.1, 30: 0.7, 40: 0.9, 50: 0.8}
    with Checkpointer(
        local,
        remote=url,
        remote_options=opts,
        keep_last=1,
        remote_keep_last=2,
        keep_best=1,
        monitor="loss",
    ) as ck:
        for s, loss in losses.items():
            ck.save(s, _state(s), metrics={"loss": loss})
    assert sorted(n for n in os.listdir(local) if n.startswith("step_")) == ["step_000000050"]
    assert sorted(_committed(url, opts).values()) == [20, 40, 50]  # best + last 2


def test_resume_by_step_downloads_an_older_remote_checkpoint(remote, tmp_path):
    url, opts = remote
    local = tmp_path / "local"
    with Checkpointer(
        local, remote=url, remote_options=opts, keep_last=1, remote_keep_last="all"
    ) as ck:
        for s in (10, 20, 30):
            ck.save(s, _state(s))
    assert [n for n in os.listdir(local) if n.startswith("step_")] == ["step_000000030"]
    state = _fresh()
    with Checkpointer(local, remote=url, remote_options=opts, resume=10) as ck:
        assert ck.restore(state) == 10
    assert torch.equal(state["w"], _state(10)["w"])


def test_remote_only_checkpoint_without_manifest_is_invisible_and_reuploaded(remote, tmp_path):
    url, opts = remote
    local = tmp_path / "local"
    with Checkpointer(local, remote=url, remote_options=opts, keep_last=3) as ck:
        ck.save(10, _state(10))
        ck.save(20, _state(20))
    store = RemoteStore(url, opts)
    # as if the upload of step 20 was cut off before its manifest
    store.fs.rm_file(f"{store.root}/step_000000020/manifest.json")
    assert sorted(_committed(url, opts).values()) == [10]
    state = _fresh()
    with Checkpointer(local, remote=url, remote_options=opts, keep_last=3) as ck:
        assert ck.restore(state) == 20  # from the local copy
    assert sorted(_committed(url, opts).values()) == [10, 20]  # re-uploaded on restart


def test_a_restart_with_other_options_uploads_the_archive_points_a_stop_cut_off(tmp_path):
    """keep_every_n_steps=20, then a run without it: steps 20, 30 and 40 were not committed
    remotely when the first run stopped. Step 20 was an archive point when it was written
    (kept remotely forever; the local tier keeps no archives with a remote), but the restart
    planned what to upload again under its own options: step 20 was not uploaded, and then
    deleted locally, lost in both tiers. Now it is uploaded and kept remotely."""
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    with Checkpointer(tmp_path / "l", remote=url, keep_last=5, keep_every_n_steps=20) as ck:
        for s in (10, 20, 30, 40):
            ck.save(s, _state(s))
    store = RemoteStore(url)
    for s in (20, 30, 40):  # as if their uploads were cut off before their manifests
        store.fs.rm_file(f"{store.root}/step_{s:09d}/manifest.json")
    assert sorted(_committed(url, None).values()) == [10]
    with Checkpointer(tmp_path / "l", remote=url, keep_last=2) as ck:
        assert ck.restore(_fresh()) == 40
    assert sorted(_committed(url, None).values()) == [20, 30, 40]


def test_slow_uploads_skip_checkpoints_retention_would_delete(tmp_path, caplog):
    """Uploads slower than saves: the uploader works toward the newest state instead of
    uploading every queued checkpoint only to delete it right after.

    The saves after step 10 start once its upload is under way: an upload thread that woke
    only after the third commit (a loaded machine) rightly skipped step 10 as well, and the
    test's uploaded[0] == 10 failed."""
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    gate, started = threading.Event(), threading.Event()
    uploaded = []
    ck = Checkpointer(tmp_path / "l", remote=url, keep_last=2)
    orig = ck.remote.upload

    def slow(local_dir, manifest, name, progress=None):
        started.set()
        gate.wait(120)
        uploaded.append(manifest.step)
        return orig(local_dir, manifest, name, progress)

    ck.remote.upload = slow
    caplog.set_level(logging.INFO, "resilient_callbacks")
    ck.save(10, _state(10))
    assert started.wait(120)  # step 10's upload under way: the one not skipped
    for s in range(20, 70, 10):
        ck.save(s, _state(s))
    ck.flush()
    gate.set()
    ck.close()
    assert uploaded[0] == 10 and uploaded[-2:] == [50, 60] and len(uploaded) < 6, uploaded
    assert sorted(_committed(url, None).values()) == [50, 60]
    assert any("uploads are behind; skipping" in r.message for r in caplog.records)
    assert sorted(n for n in os.listdir(tmp_path / "l") if n.startswith("step_")) == [
        "step_000000050",
        "step_000000060",
    ]


def test_a_file_that_rotted_after_its_commit_is_never_uploaded(tmp_path, caplog):
    """A byte of a committed checkpoint rots on the local disk before its upload: the uploader
    checks the bytes against the manifest and does not commit it remotely (the remote copy
    would have been called durable, the rotten bytes checked only for their size)."""
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    gate, started = threading.Event(), threading.Event()
    ck = Checkpointer(tmp_path / "l", remote=url)
    orig = ck.remote.upload

    def gated(local_dir, manifest, name, progress=None):
        started.set()
        gate.wait(120)
        return orig(local_dir, manifest, name, progress)

    ck.remote.upload = gated
    ck.save(10, _state(10))
    ck.flush()
    # step 10's upload under way, past its size check: under load that check could read the
    # file while it was being rewritten below (size 0: "truncated", not "checksum mismatch")
    assert started.wait(120)
    victim = max((tmp_path / "l" / "step_000000010").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    ck.save(20, _state(20))
    ck.flush()
    gate.set()
    ck.close()
    assert sorted(_committed(url, None).values()) == [20]
    assert any(
        "not uploading step_000000010, its local copy is damaged" in r.message
        and "checksum mismatch" in r.message
        for r in caplog.records
    )


def test_checkpoints_the_uploader_skips_are_deleted_locally_at_once(tmp_path, caplog):
    """An outage of the store while saves go on: the uploader skips the queued checkpoints the
    remote retention would delete, and they were deleted locally only when the next save
    committed; with the disk full of them, no save could commit, so none was ever deleted (a
    probe on a small tmpfs). They go as soon as the uploader skips them."""
    import errno

    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    gate, started = threading.Event(), threading.Event()
    ck = Checkpointer(tmp_path / "l", remote=url, keep_last=2, async_save=False)
    ck._sync.retry_base_s = ck._sync.retry_max_s = 0.05
    orig = ck.remote.upload

    def full(local_dir, manifest, name, progress=None):
        started.set()
        gate.wait(120)
        raise OSError(errno.ENOSPC, "No space left on device")

    ck.remote.upload = full
    caplog.set_level(logging.INFO, "resilient_callbacks")
    try:
        ck.save(10, _state(10))
        # step 10's upload under way before the next saves (an upload thread that woke only
        # after them, on a loaded machine, rightly skipped step 10 too)
        assert started.wait(120)
        for s in range(20, 70, 10):
            ck.save(s, _state(s))
        local = tmp_path / "l"
        steps = sorted(n for n in os.listdir(local) if n.startswith("step_"))
        # the one under way, held for its upload; each commit skipped the others (20-40)
        assert steps == ["step_000000010", "step_000000050", "step_000000060"], steps
        gate.set()  # the first upload fails; then the uploader skips 10 (no save after)
        deadline = time.monotonic() + 60
        while sorted(n for n in os.listdir(local) if n.startswith("step_")) != [
            "step_000000050",
            "step_000000060",
        ]:
            assert time.monotonic() < deadline, os.listdir(local)
            time.sleep(0.02)
        assert any("uploads are behind; skipping" in r.message for r in caplog.records)
    finally:
        gate.set()
        ck.remote.upload = orig  # the store is back: the two kept ones upload at close
        ck.close()
    assert sorted(_committed(url, None).values()) == [50, 60]


def test_a_disk_full_of_checkpoints_held_for_upload_says_so(small_tmpfs):
    """A save fails with ENOSPC while the uploader's backlog holds checkpoints past keep_last:
    the message said to make room for keep_last + 1 checkpoints (lowering keep_last would
    not help); it names the held checkpoints and the store's last error."""
    import errno

    from resilient_callbacks import CheckpointWriteError

    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    gate, uploading = threading.Event(), threading.Event()
    ck = Checkpointer(small_tmpfs / "l", remote=url, keep_last=1, async_save=False)

    def down(local_dir, manifest, name, progress=None):
        uploading.set()
        gate.wait(120)
        raise ConnectionError("the store is down")

    orig, ck.remote.upload = ck.remote.upload, down
    try:
        ck.save(1, {"w": torch.ones(1000)})
        # step 1's upload under way before step 2 commits: else (a loaded machine) step 2's
        # commit finds step 1 not started, superseded, and retention deletes it
        assert uploading.wait(60)
        ck.save(2, {"w": torch.ones(1000)})
        with pytest.raises(CheckpointWriteError) as info:
            ck.save(3, {"w": torch.ones(2_000_000)})  # 8 MB on a 4 MiB disk
        assert info.value.errno == errno.ENOSPC
        msg = str(info.value)
        assert "held locally until their upload to" in msg, msg
        assert "step_000000001" in msg and "step_000000002" in msg, msg
    finally:
        gate.set()
        ck.remote.upload = orig
        ck.close()


def test_during_an_outage_each_commit_frees_what_the_uploader_would_skip(tmp_path, monkeypatch):
    """The uploader waits out a long backoff while saves go on: it skipped the checkpoints the
    remote retention would delete only at its next try, so until then each commit added one
    to the disk (a probe's 700 KB disk failed every other save); each commit skips them now,
    and local retention deletes them at once."""
    from resilient_callbacks import checkpointer as ckmod
    from resilient_callbacks import upload_wait

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 0.5)  # (close()'s, the store down all along)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close() looks 20 times a second)
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    ck = Checkpointer(tmp_path / "l", remote=url, keep_last=2, async_save=False)
    ck._sync.retry_base_s = ck._sync.retry_max_s = 3600.0
    tried = threading.Event()

    def down(*a, **k):
        tried.set()  # (an error quoting the signed URL it used)
        raise ConnectionError("the store is down: https://u:SECRET1@h/c/x?sv=1&sig=SECRET2")

    ck.remote.upload = down
    try:
        ck.save(10, _state(10))
        assert tried.wait(120)
        deadline = time.monotonic() + 120
        # its failure counted and its attempt over: now in its backoff
        while (st := ck.remote_status()).failures == 0 or st.uploading is not None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for s in range(20, 70, 10):
            ck.save(s, _state(s))
            steps = sorted(n for n in os.listdir(tmp_path / "l") if n.startswith("step_"))
            assert len(steps) == 2, (s, steps)  # the newest two, every time
        assert ck.remote_status().pending == ["step_000000050", "step_000000060"]
        error = ck.remote_status().last_error
        assert "the store is down" in error and "SECRET" not in error, error
    finally:
        with pytest.raises(UploadIncompleteError):  # gives up on the outage (0.5 s here)
            ck.close()


def test_while_an_upload_hangs_each_commit_frees_what_the_uploader_would_skip(tmp_path):
    """A store that accepts the upload and stops answering (s3fs retries its timeouts: one
    request took 7 minutes to fail) holds the first attempt with no failure counted yet, and
    commits skipped nothing until it ended: every save stayed on the disk. Now each commit
    skips what the uploader would skip at its next try, as during a backoff."""
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    ck = Checkpointer(tmp_path / "l", remote=url, keep_last=1, async_save=False)
    release, started = threading.Event(), threading.Event()
    real = ck.remote.upload

    def hang(local_dir, manifest, name, progress=None):
        started.set()
        release.wait(60)
        return real(local_dir, manifest, name, progress)

    ck.remote.upload = hang
    try:
        ck.save(10, _state(10))
        assert started.wait(120)
        for s in (20, 30, 40):
            ck.save(s, _state(s))
        steps = sorted(n for n in os.listdir(tmp_path / "l") if n.startswith("step_"))
        assert steps == ["step_000000010", "step_000000040"], steps  # under way; the newest
        assert ck.remote_status().failures == 0
    finally:
        release.set()
        ck.close()
    assert sorted(_committed(url, None).values()) == [40]  # (10 then retired remotely)


def test_a_store_that_denies_deletes_gets_every_upload_and_one_warning(tmp_path, caplog):
    """Credentials that may put and get but not delete (a common least-privilege policy, an
    append-only bucket): S3 refuses even the delete of a key that is not there, and each
    upload began by deleting the manifest its name might have, so every upload failed,
    forever, after a preflight that passed. Now an upload deletes only what is there; the
    preflight says once that deletes fail, and the remote retention's failure is a warning
    once, not one per upload."""
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    fs = RemoteStore(url).fs  # the object every store of this URL shares (fsspec's cache)

    def deny(*a, **k):
        raise PermissionError("AccessDenied: s3:DeleteObject")

    caplog.set_level(logging.WARNING, "resilient_callbacks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fs, "rm_file", deny)
        mp.setattr(fs, "rm", deny)
        kw = {"remote": url, "keep_last": 1, "remote_keep_last": 1, "async_save": False}
        with Checkpointer(tmp_path / "l", **kw) as ck:
            for s in (1, 2, 3, 4):
                ck.save(s, _state(s))
                assert ck._sync.wait(120)
            assert ck.remote_status().failures == 0
        assert sorted(_committed(url, None).values()) == [1, 2, 3, 4]  # none could go
    said = [r.message for r in caplog.records]
    assert sum("deleting an object there failed" in m for m in said) == 1, said
    assert sum("remote_keep_last='all'" in m for m in said) == 1, said
    assert sum("remote retention on" in m for m in said) == 1, said


def test_close_gives_up_on_a_long_outage_and_names_what_is_only_local(
    tmp_path, caplog, monkeypatch
):
    from resilient_callbacks import checkpointer as ckmod
    from resilient_callbacks import upload_wait

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 0.5)  # (the store is down all along)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close() looks 20 times a second)
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    ck = Checkpointer(tmp_path / "l", remote=url, keep_last=1)
    ck._sync.retry_base_s = ck._sync.retry_max_s = 0.2

    def down(*a, **k):
        raise ConnectionError("the store is down")

    ck.remote.upload = down
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    ck.save(10, _state(10))
    t0 = time.monotonic()
    with pytest.raises(UploadIncompleteError) as info:
        ck.close()
    # gives up after its 0.5 s outage limit, not the default minutes (loose: a loaded machine)
    assert time.monotonic() - t0 < 120
    assert info.value.pending == ("step_000000010",)
    msg = str(info.value)
    assert f"resilient-ckpt push {tmp_path / 'l'} {url}" in msg and "the store is down" in msg, msg
    assert ck.closed and not ck._dir.lock.held  # released before raising
    assert any(
        "still only local" in r.message and "step_000000010" in r.message for r in caplog.records
    )
    assert (tmp_path / "l" / "step_000000010" / "manifest.json").exists()
    assert _committed(url, None) == {}


@pytest.mark.parametrize("signalled", [False, True], ids=["stalled", "stalled+sigterm"])
def test_close_gives_up_on_a_store_that_stopped_answering(tmp_path, caplog, monkeypatch, signalled):
    """A store that accepts the upload and then never answers: no attempt failed, so the
    outage clock never started and close() waited 12 minutes (ignoring a SIGTERM meanwhile).
    An attempt that moves no byte counts as an outage; a SIGTERM during close() bounds the wait
    to its grace period less 5 s, and then reaches the handler it would have reached."""
    from resilient_callbacks import checkpointer as ckmod
    from resilient_callbacks import upload_thread, upload_wait

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 0.5 if not signalled else 600)  # (hung: an event)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close() looks 20 times a second)
    monkeypatch.setattr(upload_thread, "STOP_JOIN_S", 0.1)  # (for the hung attempt, given up)
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    got: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        ck = Checkpointer(tmp_path / "l", remote=url, keep_last=1, grace_period=6)
        release = threading.Event()

        def hang(local_dir, manifest, name, progress=None):
            if progress is not None:
                progress.update(1)  # a first byte, then nothing
            release.wait(60)
            raise ConnectionError("the store never answered")

        ck.remote.upload = hang
        caplog.set_level(logging.WARNING, "resilient_callbacks")
        ck.save(10, _state(10))
        if signalled:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        if signalled:  # the preemption's grace period bounded it: the restart uploads
            ck.close()
        else:
            with pytest.raises(UploadIncompleteError, match=r"no byte moved|never answered"):
                ck.close()
        took = time.monotonic() - t0
        release.set()
    finally:
        signal.signal(signal.SIGTERM, old)
    assert took < 120, took  # not the 12 minutes of the bug (loose: a loaded machine)
    assert any("still only local" in r.message for r in caplog.records)
    assert got == ([signal.SIGTERM] if signalled else [])


# ---------------------------------------------------------------------- preflight


def test_missing_bucket_is_a_clear_error_at_construction(s3_server, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match="bucket") as info:
        Checkpointer(
            tmp_path / "l", remote="s3://no-such-bucket-rc/run", remote_options=s3_server.options
        )
    # about 1 s alone; the bound tells an answer from s3fs's minutes of retries (loaded machine)
    assert time.monotonic() - t0 < 120
    assert "testing" not in str(info.value)  # credentials are not echoed
    # the directory is usable again right away (the lock was released)
    Checkpointer(tmp_path / "l").close()


def test_an_option_the_filesystem_does_not_take_is_named_as_the_problem(s3_server, tmp_path):
    """remote_options with a key s3fs does not take (a typo: `endpoint=`, `bogus_opt=`)
    reaches s3fs only at the preflight's first request, as a TypeError; the error said "Check
    the bucket name, the endpoint and the credentials" (found 2026-12-06), none of which was
    wrong. It now says that a key of remote_options is not an option of the filesystem."""
    bucket = s3_server.create_bucket()
    with pytest.raises(RemoteUnavailableError, match="bogus_opt") as info:
        Checkpointer(
            tmp_path / "l",
            remote=f"s3://{bucket}/run",
            remote_options={**s3_server.options, "bogus_opt": 1},
        )
    assert "is not an option of this URL's filesystem" in str(info.value), str(info.value)
    assert "Check the bucket name" not in str(info.value)


def test_credentials_nested_in_remote_options_are_not_echoed(s3_server, tmp_path):
    """s3fs takes credentials at the top (``key``/``secret``) and inside ``client_kwargs``; a
    message once masked the first and printed the second."""
    options = {
        "client_kwargs": {
            "endpoint_url": s3_server.endpoint,
            "aws_access_key_id": "AKIDNESTED1",
            "aws_secret_access_key": "NESTEDSECRET1",
        },
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    with pytest.raises(RemoteUnavailableError, match="bucket") as info:
        Checkpointer(tmp_path / "l", remote="s3://no-such-bucket-rc/run", remote_options=options)
    message = str(info.value)
    assert "NESTEDSECRET1" not in message and "AKIDNESTED1" not in message, message
    assert '"aws_secret_access_key": "***"' in message and s3_server.endpoint in message


def test_the_remote_options_in_messages_hide_every_secret():
    from resilient_callbacks.redact import options_text

    shown = json.loads(
        options_text(
            {
                "endpoint_url": "https://user:hunter2@store.example:9000/x",
                "headers": {"Authorization": "Bearer abc123"},
                "storage_options": [{"account_key": "k1"}, {"anon": False}],
                "token": {"refresh": "r"},
                "use_ssl": True,
            }
        )
    )
    assert shown == {
        "endpoint_url": "https://***@store.example:9000/x",
        "headers": {"Authorization": "***"},
        "storage_options": [{"account_key": "***"}, {"anon": False}],
        "token": "***",
        "use_ssl": True,
    }


def test_more_secrets_are_hidden_and_the_store_url_too(tmp_path):
    """Secrets that passed unmasked: an Azure connection string, a SAS signature or an
    X-Amz-Signature in a URL's query, a cookie, ``passwd``/``pwd``, a password holding "@"; and
    the remote URL itself, which every message and listing names (it may carry a password)."""
    from resilient_callbacks.redact import options_text, url_text
    from resilient_callbacks.remote import RemoteStore

    shown = json.loads(
        options_text(
            {
                "connection_string": "AccountName=a;AccountKey=SECRET1==;EndpointSuffix=x",
                "client_kwargs": {"endpoint_url": "https://a.example/c?sv=2022&sig=SECRET2"},
                "endpoint": "http://user:p@ssSECRET3@minio:9000",
                "headers": {"Cookie": "session=SECRET4"},
                "passwd": "SECRET5",
                "pwd": "SECRET6",
                "region_name": "eu-west-1",
            }
        )
    )
    assert "SECRET" not in json.dumps(shown), shown
    assert shown["region_name"] == "eu-west-1"
    assert shown["client_kwargs"]["endpoint_url"] == "https://a.example/c?sv=2022&sig=***"
    assert shown["endpoint"] == "http://***@minio:9000"
    signed = "https://b.example/k?X-Amz-Credential=SECRET7&X-Amz-Signature=SECRET8&part=3"
    assert url_text(signed) == "https://b.example/k?X-Amz-Credential=***&X-Amz-Signature=***&part=3"
    assert url_text("AccountKey=SECRET10;AccountName=a") == "AccountKey=***;AccountName=a"
    assert url_text("401: Authorization: Bearer SECRET11") == "401: Authorization: Bearer ***"
    store = RemoteStore(f"file://alice:SECRET9@{tmp_path}/remote")
    assert "SECRET9" not in store.url and "SECRET9" not in repr(store)
    assert store.url == f"file://***@{tmp_path}/remote"


def test_the_cli_says_a_missing_bucket_is_missing(s3_server, tmp_path):
    """``ls --remote`` and ``pull`` of a bucket that does not exist: a clear error, exit 1
    (listing it read as an empty store: 'local-only' rows, exit 0); a missing folder in a
    bucket that exists is still an empty store."""
    from resilient_callbacks.remote import RemoteStore
    from test_cli import cli

    root = str(tmp_path / "ck")
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(2)})
    opts = [f"-o{k}={v}" for k, v in s3_server.options.items() if isinstance(v, str)]
    opts += [
        f"-o{k}={json.dumps(v)}" for k, v in s3_server.options.items() if not isinstance(v, str)
    ]
    listed = cli("ls", root, "--remote", "s3://no-such-bucket-rc/run", *opts)
    assert listed.returncode == 1 and "bucket 'no-such-bucket-rc' does not exist" in listed.stderr
    pulled = cli("pull", "s3://no-such-bucket-rc/run", str(tmp_path / "p"), *opts)
    assert pulled.returncode == 1 and "does not exist" in pulled.stderr
    bucket = s3_server.create_bucket()
    assert RemoteStore(f"s3://{bucket}/nothing/yet", s3_server.options).scan() == []


def test_unreachable_endpoint_is_a_clear_error_within_seconds(tmp_path):
    """A port nothing listens on: the store's client retries for ~11 s before its own error,
    so remote_timeout=2 ends the check first (or a client that gives up sooner says why): a
    clear error naming the endpoint, in seconds. No wall-clock bound here (one measured ~10 s
    alone against 20 s on a loaded machine); the message proves which path ended the wait, and
    the endpoint that never answers (below) proves the timeout itself."""
    pytest.importorskip("s3fs")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        RemoteUnavailableError, match=r"no answer within 2 s|not usable: EndpointConnectionError"
    ) as refused:
        Checkpointer(
            tmp_path / "l",
            remote="s3://bucket/run",
            remote_options={"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"},
            remote_timeout=2,
        )
    assert f"http://127.0.0.1:{port}" in str(refused.value)


def test_a_job_restarted_during_an_outage_resumes_from_its_local_checkpoints(tmp_path, caplog):
    """The store is down when a job with local checkpoints is requeued: the preflight raised,
    so the job failed at construction (and crash-looped through the outage) although it had
    all it needed to go on, and restore's documented fallback to the local tier could not be
    reached. Now it goes on with a warning: restore takes the newest local checkpoint, saves
    commit locally and are uploaded once the store answers. With nothing local it still
    raises (the test above): a new node must not start from scratch."""
    pytest.importorskip("s3fs")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    local = tmp_path / "l"
    with Checkpointer(local) as ck:
        ck.save(10, _state(10))
    opts = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "k",
        "secret": "s",
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    ck = Checkpointer(local, remote="s3://bucket/run", remote_options=opts, keep_last=1)
    try:
        said = [r.getMessage() for r in caplog.records if "going on with them" in r.message]
        assert len(said) == 1 and ".." not in said[0], said
        with pytest.warns(ResumeFallbackWarning, match="could not list the remote"):
            assert ck.restore(_fresh()) == 10
        ck.save(20, _state(20))
    finally:
        ck.close(timeout=1)
    assert any("still only local" in r.message for r in caplog.records)
    assert (local / "step_000000020" / "manifest.json").exists()


@pytest.mark.parametrize("how", ["denied", "down", pytest.param("stalls", marks=pytest.mark.slow)])
def test_a_listing_that_fails_at_open_names_the_store_not_the_local_directory(
    tmp_path, monkeypatch, caplog, how
):
    """The preflight writes, reads and deletes a probe object; the open then lists the store
    (new commits number after its). A listing that failed there (credentials without
    s3:ListBucket, a store that failed the listing) was taken for the local directory's
    failure: "cannot use <dirpath> as a checkpoint directory ... Check that the path is right
    and writable by this user", and one that stalled hung the construction (restore's listing
    is bounded since 26b32cf, not this one). Now it is the store's RemoteUnavailableError,
    bounded like the restore's; a store that did not answer with checkpoints on the local disk
    is a warning and the job goes on from them, as after a preflight that got no answer."""
    from resilient_callbacks import checkpointer as ckmod

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 1.0)  # (the stall's limit too)
    url = f"file://{tmp_path}/durable/run"
    local = tmp_path / "l"
    with Checkpointer(local, remote=url, async_save=False) as ck:
        ck.save(10, _state(10))
    release = threading.Event()

    def scan(self, *a, **k):
        if how == "denied":
            raise PermissionError("AccessDenied: s3:ListBucket")
        if how == "stalls":
            release.wait(60)
        raise ConnectionError("the store failed the listing")

    monkeypatch.setattr(RemoteStore, "scan", scan)
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    try:
        if how == "denied":
            with pytest.raises(RemoteUnavailableError, match="listing") as info:
                Checkpointer(local, remote=url)
            assert "cannot use" not in str(info.value) and url in str(info.value)
            assert "AccessDenied" in str(info.value)
            return
        ck = Checkpointer(local, remote=url)  # goes on from the local checkpoint
        try:
            said = [r.getMessage() for r in caplog.records if "going on with them" in r.message]
            assert len(said) == 1 and "listing" in said[0], said
            with pytest.warns(ResumeFallbackWarning, match="could not list the remote"):
                assert ck.restore(_fresh()) == 10
        finally:
            ck.close(timeout=1)
    finally:
        release.set()


def test_the_preflight_error_reads_as_one_sentence_per_part(tmp_path, monkeypatch):
    """S3's messages end with a period ("The AWS Access Key Id you provided does not exist in
    our records."): the preflight's error read "records.. Check the bucket name ..."."""
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    fs = RemoteStore(url).fs

    def refused(*a, **k):
        raise PermissionError("The AWS Access Key Id you provided does not exist in our records.")

    monkeypatch.setattr(fs, "pipe_file", refused)
    with pytest.raises(RemoteUnavailableError) as info:
        Checkpointer(tmp_path / "l", remote=url)
    assert "in our records. Check the bucket name" in str(info.value), str(info.value)


def test_an_unusable_local_remote_gets_filesystem_advice_not_cloud_advice(tmp_path):
    (tmp_path / "a_file").write_bytes(b"x")  # the remote's path runs through a file
    with pytest.raises(RemoteUnavailableError, match="not usable") as refused:
        Checkpointer(tmp_path / "l", remote=f"file://{tmp_path}/a_file/run")
    said = str(refused.value)
    assert "writable directory on a mounted filesystem" in said and "bucket" not in said


def test_an_endpoint_that_never_answers_does_not_keep_the_process_alive(tmp_path):
    """An endpoint that accepts connections and never replies (a black-holed load balancer):
    the error came in time, but the check's worker thread, stuck in the store's client, was
    joined at interpreter exit, so the process never exited."""
    pytest.importorskip("s3fs")
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    try:
        with pytest.raises(RemoteUnavailableError, match="no answer within 2 s"):
            Checkpointer(
                tmp_path / "l",
                remote="s3://bucket/run",
                remote_options={
                    "endpoint_url": f"http://127.0.0.1:{listener.getsockname()[1]}",
                    "key": "k",
                    "secret": "s",
                },
                remote_timeout=2,
            )
        stuck = [t for t in threading.enumerate() if t.name.startswith("rc-preflight")]
        assert all(t.daemon for t in stuck)  # (one still inside the client is not joined)
    finally:
        listener.close()


def test_remote_option_errors(tmp_path):
    d = tmp_path / "l"
    with pytest.raises(ConfigError, match=r"appl(y|ies) only with remote"):
        Checkpointer(d, remote_keep_last=3)
    with pytest.raises(ConfigError, match="remote_keep_last"):
        Checkpointer(d, remote="memory://x", remote_keep_last=0)
    with pytest.raises(ConfigError, match="inside dirpath"):
        Checkpointer(d, remote=str(d / "durable"))
    with pytest.raises(RemoteUnavailableError, match="Protocol not known: nosuchproto"):
        Checkpointer(d, remote="nosuchproto://bucket/x")
    Checkpointer(d).close()  # no lock left behind by the failed constructions


# ---------------------------------------------------------------------- S3 outages and kills


def test_s3_outage_mid_training_never_blocks_and_backlog_uploads(
    s3_server, s3_remote, tmp_path, caplog
):
    url, opts = s3_remote
    opts = {**opts, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    local = tmp_path / "local"
    seen_torn = []
    stop_watch = threading.Event()

    def watch():  # a reader polling the bucket never sees a committed-but-incomplete checkpoint
        while not stop_watch.is_set():
            if s3_server.running:
                try:
                    for e in RemoteStore(url, s3_server.options).scan():
                        if e.manifest is not None and e.problem:
                            seen_torn.append(e)
                except Exception:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    ck = Checkpointer(local, remote=url, remote_options=opts, keep_last=1)
    ck._sync.retry_base_s = 0.2
    ck._sync.retry_max_s = 1.0
    ck.save(10, _state(10, 1 << 18))
    ck.flush()
    assert ck._sync.wait(120)
    s3_server.stop()  # the store goes away
    try:
        t0 = time.monotonic()
        for s in (20, 30, 40):
            ck.save(s, _state(s, 1 << 18))
            ck.flush()  # local commit done; uploads are failing in the background
        # training was not held up by the outage: a save that waited for the store would wait
        # until it is back (the finally below). Loose: a loaded machine is slow (this test
        # took 1.8 s alone, 5.8 s beside one busy process on its core)
        assert time.monotonic() - t0 < 60
        deadline = time.monotonic() + 120

        def said() -> bool:  # the warning follows the failure count, from the upload thread
            return any("only local" in r.message for r in caplog.records)

        while not (ck.remote_status().failures and said()) and time.monotonic() < deadline:
            time.sleep(0.1)
        status = ck.remote_status()
        assert status.failures >= 1 and status.pending, status
        # the newest, only local, is kept although keep_last=1 and it is not uploaded
        assert (local / "step_000000040" / "manifest.json").exists()
        assert "step_000000040" in ck.remote_status().pending
        assert said()
    finally:
        s3_server.start()  # the store comes back
    ck.close(timeout=60)
    stop_watch.set()
    watcher.join()
    assert ck.remote_status().pending == []
    assert sorted(_committed(url, s3_server.options).values()) == [40]
    assert [n for n in os.listdir(local) if n.startswith("step_")] == ["step_000000040"]
    assert not seen_torn


CHILD = textwrap.dedent(
    """
    import json, os, sys, time, torch
    from resilient_callbacks import Checkpointer
    local, url, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    ck = Checkpointer(local, remote=url, remote_options=opts, keep_last=5, async_save=False)
    step = ck.restore({"w": torch.zeros(1 << 22)})
    orig = ck.remote.upload
    def slow_upload(*a, **k):
        print("UPLOADING", a[2], flush=True)
        time.sleep(0.5)
        return orig(*a, **k)
    ck.remote.upload = slow_upload
    for s in range(step + 10, step + 1000, 10):
        ck.save(s, {"w": torch.full((1 << 22,), float(s))})
        time.sleep(0.05)
    """
)


def test_with_remote_every_n_saves_best_and_archive_checkpoints_stay_somewhere(tmp_path):
    """Only every third checkpoint is uploaded, and the local disk kept only keep_last=1 (best
    and archive ones being "kept remotely"): archive steps and the best checkpoint that were
    not uploaded were deleted from both tiers. Now the local disk keeps them."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    val = {10: 0.1, 40: 0.4}
    with Checkpointer(
        local, remote=url, every_n_steps=5, keep_last=1, keep_every_n_steps=10, keep_best=1,
        monitor="val", remote_every_n_saves=3,
    ) as ck:  # fmt: skip
        for s in range(1, 41):
            ck.step(s, _state(s), metrics={"val": val.get(s, 1.0)})
    kept = {e.step for e in catalog.committed(catalog.scan(str(local)))}
    kept |= set(_committed(url, None).values())
    assert {10, 20, 30, 40} <= kept  # the archive steps; 10 is also the best


def test_a_new_run_started_with_resume_never_numbers_its_commits_after_the_remote(tmp_path):
    """A run started on purpose with resume="never" in a directory whose checkpoints live only
    remotely: its commits are numbered after the remote's (they were numbered from the local
    directory, so a later resume, which takes the highest commit number, went back to the
    older run)."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    with Checkpointer(local, remote=url, keep_last=5) as ck:
        for s in (10, 20, 30):
            ck.save(s, _state(s))
    shutil.rmtree(local)
    # (the remote holds the older run's checkpoints: each later run is told so, as it is)
    other_run = "checkpoint.s. of 1 other run"
    with Checkpointer(local, remote=url, keep_last=5, resume="never") as ck:
        assert ck.restore(_fresh()) == 0
        with pytest.warns(ForeignCheckpointsWarning, match=other_run):
            for s in (1, 2):
                ck.save(s, _state(s))
    shutil.rmtree(local)
    state = _fresh()
    with (
        Checkpointer(local, remote=url, keep_last=5) as ck,
        pytest.warns(ForeignCheckpointsWarning, match=other_run),
    ):
        assert ck.restore(state) == 2  # the run that committed last
    assert state["meta"] == {"v": 2}


def test_an_outage_at_restore_with_no_local_checkpoint_is_an_error_not_a_fresh_start(
    s3_server, s3_remote, tmp_path
):
    """The local directory is gone and the store cannot be listed when restore() runs: that
    is an error naming both, not "nothing to resume from" (restore returned 0 and the run
    started from scratch, with only a log line). Once the store is back, the same resumes."""
    from resilient_callbacks.errors import RemoteUnavailableError

    url, opts = s3_remote
    opts = {**opts, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    local = tmp_path / "local"
    with Checkpointer(local, remote=url, remote_options=opts) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    shutil.rmtree(local)
    ck = Checkpointer(local, remote=url, remote_options=opts)  # the store answers here...
    try:
        s3_server.stop()  # ... and is gone when the restore lists it
        with pytest.raises(RemoteUnavailableError, match="holds no checkpoint"):
            ck.restore(_fresh())
    finally:
        s3_server.start()
        ck.close()
    with Checkpointer(local, remote=url, remote_options=opts) as ck:
        assert ck.restore(_fresh()) == 20


@pytest.mark.parametrize("how", ["read fails", "damaged"])
def test_remote_checkpoints_whose_manifest_cannot_be_read_are_no_fresh_start(
    tmp_path, monkeypatch, how
):
    """A new node (empty dirpath) whose remote lists the run's checkpoints but cannot give their
    manifests (the store failed between the listing and the reads, or they are damaged):
    restore() returned 0 without a word and the run started from scratch beside them. Now they
    are candidates with their problem, so the restore fails naming each; once the store
    answers again, the same restore resumes. With a local copy, it is a loud fallback."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    kw = {"remote": url, "keep_last": 5}
    with Checkpointer(local, **kw) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    shutil.rmtree(local)
    manifests = [
        tmp_path / "durable" / "run" / n / "manifest.json"
        for n in ("step_000000010", "step_000000020")
    ]
    kept = [m.read_bytes() for m in manifests]
    ck = Checkpointer(local, remote=url, keep_last=5)
    try:
        if how == "read fails":

            def cat(paths, on_error="raise", **kw):
                return {p: ConnectionError("the store stopped answering") for p in paths}

            monkeypatch.setattr(ck.remote.fs, "cat", cat)
            monkeypatch.setattr(remote_reads, "backoff_s", lambda *a, **k: 0.0)  # (its retries)
            ck.remote._manifests.clear()  # (those read at construction are not read again)
        else:
            for m in manifests:
                m.write_text("{torn")
        with (
            pytest.warns(ResumeFallbackWarning, match="skipping checkpoint step_0000000[12]0"),
            pytest.raises(NoValidCheckpointError) as info,
        ):
            ck.restore(_fresh())
        said = str(info.value)
        assert said.index("step_000000020") < said.index("step_000000010"), said  # newest first
        assert ("stopped answering" if how == "read fails" else "unreadable manifest") in said
    finally:
        ck.close()
    monkeypatch.undo()
    for m, raw in zip(manifests, kept, strict=True):
        m.write_bytes(raw)
    with Checkpointer(local, remote=url, keep_last=5) as ck:
        assert ck.restore(_fresh()) == 20
    manifests[1].write_text("{torn")  # beside the local copy (downloaded): a loud fallback
    said = "remote.*step_000000020.*unreadable"
    with pytest.warns(ResumeFallbackWarning, match=said), Checkpointer(local, **kw) as ck:
        assert ck.restore(_fresh()) == 20
    with Checkpointer(local, remote=url, keep_last=5, resume=20) as ck:
        assert ck.restore(_fresh()) == 20  # the local copy of the step asked for


def test_s3_sigkill_mid_upload_leaves_only_complete_checkpoints(s3_server, s3_remote, tmp_path):
    url, opts = s3_remote
    local = tmp_path / "local"
    script, log = tmp_path / "child.py", tmp_path / "child.log"
    script.write_text(CHILD)
    # a process of its own, forked from the session's zygote that imported torch and s3fs
    # once (spawn_ranks.Zygote); its output goes to ``log``
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, str(script), str(local), url, json.dumps(opts)]
    proc = spawn_ranks.shared_zygote().spawn(cmd, env, log)
    deadline = time.monotonic() + 120
    while not log.exists() or log.read_text().count("UPLOADING") < 3:  # (the child opens it)
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no third upload within 120 s"
        time.sleep(0.01)
    time.sleep(0.7)  # inside the third upload (16 MB through multipart)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    committed = _committed(url, opts)  # asserts that every committed one is complete
    local_steps = sorted(
        int(n.split("_")[1]) for n in os.listdir(local) if n.startswith("step_") and "-" not in n
    )
    assert local_steps and max(local_steps) > max(committed.values(), default=0)
    # the next run re-uploads what was missing
    with Checkpointer(local, remote=url, remote_options=opts, keep_last=5) as ck:
        assert ck.restore({"w": torch.zeros(1 << 22)}) == max(local_steps)
    after = _committed(url, opts)
    assert max(after.values()) == max(local_steps)
    assert set(after.values()) >= set(local_steps[-5:]) & set(local_steps)


# ---------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    """Run ``resilient-ckpt ARGS`` in this process (a subprocess would import torch and s3fs
    again for each call; tests/test_cli.py runs the real executable)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from resilient_callbacks import cli

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = cli.main(list(args))
        except SystemExit as e:  # argparse errors
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


def _opts_args(opts) -> list[str]:
    return [a for k, v in (opts or {}).items() for a in ("-o", f"{k}={json.dumps(v)}")]


def test_cli_ls_pull_push_across_tiers(shared_remote, tmp_path):
    url, opts = shared_remote
    local = tmp_path / "local"
    with Checkpointer(
        local, remote=url, remote_options=opts, keep_last=1, remote_keep_last=2
    ) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    with (
        pytest.warns(ForeignCheckpointsWarning),  # local-only, of another run
        Checkpointer(local, keep_last=None, resume="never") as ck,
    ):
        ck.save(30, _state(30))
    out = _cli("ls", str(local), "--remote", url, *_opts_args(opts), "--json")
    assert out.returncode == 0, out.stderr
    tiers = {r["step"]: r["tier"] for r in json.loads(out.stdout)}
    assert tiers == {10: "remote", 20: "both", 30: "local-only"}
    text = _cli("ls", str(local), "--remote", url, *_opts_args(opts))
    assert "TIER" in text.stdout and "remote only" in text.stdout

    pulled = tmp_path / "pulled"
    out = _cli("pull", url, str(pulled), "--step", "10", *_opts_args(opts))
    assert out.returncode == 0, out.stderr
    assert "verified" in out.stdout
    state = _fresh()
    with Checkpointer(pulled) as ck:
        assert ck.restore(state) == 10
    assert torch.equal(state["w"], _state(10)["w"])

    out = _cli("push", str(local), url, *_opts_args(opts))
    assert out.returncode == 0, out.stderr
    assert "pushed step_000000030" in out.stdout and "already in" in out.stdout
    assert sorted(_committed(url, opts).values()) == [10, 20, 30]

    out = _cli("pull", url, str(tmp_path / "x"), "--step", "99", *_opts_args(opts))
    assert out.returncode == 1 and "no checkpoint of step 99" in out.stderr


def test_cli_gc_remote_applies_the_recorded_remote_retention(shared_remote, tmp_path, monkeypatch):
    """`gc DIR --remote URL`: the remote retention recorded in the newest manifest
    (remote_keep_last="all": nothing deleted), --keep-last overriding it, then the blobs no
    remaining remote checkpoint names; an upload without a manifest is kept while it may be
    live and deleted once old; the local directory is cleaned as before."""
    from resilient_callbacks import cli_remote_gc

    url, opts = shared_remote
    local = tmp_path / "local"
    with Checkpointer(
        local,
        remote=url,
        remote_options=opts,
        keep_last=1,
        remote_keep_last="all",
        incremental=True,
    ) as ck:
        for s in (10, 20, 30, 40):
            ck.save(s, _state(s, n=8192))  # 32 KiB tensors, each save's its own blobs
    st = RemoteStore(url, opts)
    st.fs.makedirs(f"{st.root}/step_000000050", exist_ok=True)
    st.fs.pipe_file(f"{st.root}/step_000000050/shared.safetensors", b"cut off")
    o = _opts_args(opts)

    kept = json.loads(_cli("gc", str(local), "--remote", url, *o, "--json").stdout)
    assert kept["remote"]["retention"]["keep_last"] is None and kept["remote"]["delete"] == []
    assert sorted(_committed(url, opts).values()) == [10, 20, 30, 40]

    dry = json.loads(
        _cli(
            "gc", str(local), "--remote", url, *o, "--keep-last", "2", "--dry-run", "--json"
        ).stdout
    )
    assert sorted(d["step"] for d in dry["remote"]["delete"]) == [10, 20]
    assert len(dry["remote"]["blobs_deleted"]) == 4
    assert sorted(_committed(url, opts).values()) == [10, 20, 30, 40]  # a dry run

    out = _cli("gc", str(local), "--remote", url, *o, "--keep-last", "2")
    assert out.returncode == 0, out.stderr
    assert "not kept by the remote retention" in out.stdout
    assert "may be an upload in progress" in out.stdout  # step_000000050, written just now
    assert sorted(_committed(url, opts).values()) == [30, 40]
    named = {b.path for e in st.scan() if e.manifest for b in e.manifest.blobs}
    listed = {p.rsplit("/", 1)[-1] for p in st.fs.ls(f"{st.root}/blobs", detail=False)}
    assert {n for n in listed if not n.startswith(".")} == named and len(named) == 4
    state = _fresh(8192)
    with Checkpointer(tmp_path / "fresh", remote=url, remote_options=opts) as ck:
        assert ck.restore(state) == 40
    assert torch.equal(state["w"], _state(40, n=8192)["w"])

    monkeypatch.setattr(cli_remote_gc, "STALE_UPLOAD_S", -1.0)  # as if a day had passed
    out = _cli("gc", str(tmp_path / "nowhere"), "--remote", url, *o, "--keep-last", "2")
    assert out.returncode == 0, out.stderr
    assert "upload without a manifest" in out.stdout
    assert not any(e.name == "step_000000050" for e in st.scan())


def test_uploads_to_a_tier_that_keeps_everything_do_not_list_it_each_time(tmp_path, monkeypatch):
    """With remote_keep_last='all' remote retention deletes nothing: the uploader no longer
    lists the whole store (every manifest) after each upload, which grew with its size."""
    from resilient_callbacks.remote import RemoteStore

    calls = [0]
    real = RemoteStore.scan

    def counted(self):
        calls[0] += 1
        return real(self)

    monkeypatch.setattr(RemoteStore, "scan", counted)
    url = f"file://{tmp_path}/remote"
    with Checkpointer(tmp_path / "l", remote=url, remote_keep_last="all", async_save=False) as ck:
        before = calls[0]
        for s in range(1, 7):
            ck.save(s, _state(s))
        ck.flush()
    assert calls[0] - before <= 1, calls  # (close may list it once)
    assert len([e for e in real(RemoteStore(url)) if e.problem is None]) == 6


def test_a_cut_off_upload_is_listed_and_the_uploader_deletes_it_a_day_later(tmp_path, monkeypatch):
    """A remote checkpoint folder without a manifest whose local copy is gone (a run killed
    mid-upload, then its retention deleted the local copy): `ls --remote` lists it as
    `uploading` (it was hidden, using the store's space), and the uploader's retention deletes
    it once untouched for a day (only `gc --remote` did: each kill of a preemptible job left one
    behind, for good)."""
    from resilient_callbacks import sync

    url = f"file://{tmp_path}/durable/run"
    with Checkpointer(tmp_path / "ck", remote=url, keep_last=2) as ck:
        ck.save(1, _state(1.0))
    st = RemoteStore(url)
    st.fs.makedirs(f"{st.root}/step_000000005", exist_ok=True)
    st.fs.pipe_file(f"{st.root}/step_000000005/shared.safetensors", b"cut off")
    out = _cli("ls", str(tmp_path / "ck"), "--remote", url, "--json")
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    torn = rows["step_000000005"]
    assert (torn["tier"], torn["status"], torn["step"], torn["bytes"]) == (
        "uploading",
        "incomplete",
        5,
        7,
    )
    assert "untouched for 24 h" in torn["problem"]
    text = _cli("ls", str(tmp_path / "ck"), "--remote", url).stdout
    line = next(x for x in text.splitlines() if x.split()[:1] == ["5"])
    assert "incomplete" in line and "uploading" in line and "remote only" in line, text

    def run(step: int) -> None:
        with Checkpointer(tmp_path / "ck", remote=url, keep_last=2) as ck:
            ck.restore(_fresh())
            ck.save(step, _state(float(step)))

    run(2)  # written just now: it may be an upload in progress elsewhere
    assert "step_000000005" in {e.name for e in st.scan()}
    monkeypatch.setattr(sync, "STALE_UPLOAD_S", -1.0)  # as if a day had passed
    run(3)
    assert "step_000000005" not in {e.name for e in st.scan()}
    assert sorted(_committed(url, None).values()) == [2, 3]


def test_keeping_every_checkpoint_the_uploader_still_deletes_cut_off_uploads(tmp_path, monkeypatch):
    """With keep_last=None nothing is listed after each upload (the listing grew with the
    store), so a kill's cut-off upload stayed for good. The uploader now looks once a process
    (and hourly): the first upload of a run deletes those untouched for a day, later uploads of
    the same process do not list the store again."""
    from resilient_callbacks import sync

    monkeypatch.setattr(sync, "STALE_UPLOAD_S", -1.0)  # as if a day had passed
    url = f"file://{tmp_path}/durable/run"
    st = RemoteStore(url)

    def cut_off(step: int) -> str:
        name = f"step_{step:09d}"
        st.fs.makedirs(f"{st.root}/{name}", exist_ok=True)
        st.fs.pipe_file(f"{st.root}/{name}/shared.safetensors", b"cut off")
        return name

    first = cut_off(50)
    with Checkpointer(tmp_path / "ck", remote=url) as ck:
        ck.restore(_fresh())
        ck.save(1, _state(1.0))
        ck.flush()
        assert ck._dir.sync.wait(60)  # uploaded, and the uploader's retention done
        assert first not in {e.name for e in st.scan()}
        second = cut_off(60)
        ck.save(2, _state(2.0))
        ck.flush()
        assert ck._dir.sync.wait(60)
        assert second in {e.name for e in st.scan()}  # within the hour: not listed again
    with Checkpointer(tmp_path / "ck", remote=url) as ck:
        ck.restore(_fresh())
        ck.save(3, _state(3.0))
    assert second not in {e.name for e in st.scan()}
    assert sorted(_committed(url, None).values()) == [1, 2, 3]


def test_gc_remove_corrupt_never_deletes_a_remote_checkpoint_whose_manifest_read_failed(
    tmp_path, monkeypatch
):
    """One manifest read failing while gc lists the store (a timeout, a connection reset:
    not a damaged manifest) made that checkpoint "corrupt", and `gc --remote --remove-corrupt`
    deleted it, and so was one a newer version of the library wrote (which the local gc
    keeps). Now both are kept and named; a damaged one is still deleted."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    with Checkpointer(local, remote=url, keep_last=5) as ck:
        for s in (10, 20, 30, 40):
            ck.save(s, _state(s))
    (tmp_path / "durable" / "run" / "step_000000010" / "manifest.json").write_text("{torn")
    newer = tmp_path / "durable" / "run" / "step_000000030" / "manifest.json"
    newer.write_text(json.dumps({**json.loads(newer.read_text()), "format_version": 99}))
    fs = RemoteStore(url).fs  # the object every store of this URL shares (fsspec's cache)
    real_cat = fs.cat

    def cat(path, recursive=False, on_error="raise", **kw):
        got = real_cat(path, recursive, on_error, **kw)
        return {
            p: ConnectionError("read timed out") if "step_000000020" in p else v
            for p, v in got.items()
        }

    monkeypatch.setattr(fs, "cat", cat)
    # (a read that fails so is tried again after 1 s, then 2 s, at each listing: not waited here)
    monkeypatch.setattr(remote_reads, "backoff_s", lambda *a, **k: 0.0)
    args = ("gc", str(local), "--remote", url, "--remove-corrupt", "--keep-last", "5", "--json")
    got = _cli(*args)
    assert got.returncode == 0, got.stderr
    remote = json.loads(got.stdout)["remote"]
    assert [d["name"] for d in remote["delete"]] == ["step_000000010"]
    kept = {k["name"]: k for k in remote["keep"]}
    assert "read timed out" in json.dumps(kept["step_000000020"])
    assert "newer than this library" in json.dumps(kept["step_000000030"])
    monkeypatch.undo()
    assert (tmp_path / "durable" / "run" / "step_000000030" / "shared.safetensors").exists()
    assert sorted(_committed(url, None).values()) == [20, 40]  # (30: unreadable here)


def test_blobs_of_a_remote_checkpoint_of_a_newer_format_are_not_collected(tmp_path):
    """A remote checkpoint whose manifest this version cannot read (a newer library wrote it
    to the same URL, or it is damaged) names blobs no one here can see: the collection that
    follows a remote deletion deleted them. Now it deletes no blob while such a manifest is
    there, and says why."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    with Checkpointer(
        local, remote=url, keep_last=1, remote_keep_last="all", incremental=True
    ) as ck:
        for s in (10, 20, 30):
            ck.save(s, _state(s, n=8192))  # each save's own blobs
    newest = tmp_path / "durable" / "run" / "step_000000030" / "manifest.json"
    m = json.loads(newest.read_text())
    blobs = [tmp_path / "durable" / "run" / "blobs" / b["path"] for b in m["blobs"]]
    assert blobs and all(b.exists() for b in blobs)
    m["format_version"] = 99
    newest.write_text(json.dumps(m))
    got = _cli("gc", str(local), "--remote", url, "--keep-last", "1", "--json")
    assert got.returncode == 0, got.stderr
    assert [d["name"] for d in json.loads(got.stdout)["remote"]["delete"]] == ["step_000000010"]
    assert all(b.exists() for b in blobs), "the newer checkpoint's blobs were deleted"


_GIVE_UP_SCRIPT = """
import sys, torch
from resilient_callbacks import Checkpointer, checkpointer, upload_wait
from resilient_callbacks.remote import RemoteStore

checkpointer.CLOSE_OUTAGE_S = 0.5  # (300 s by default)
upload_wait.LOOK_S = 0.05  # (close() looks at the uploads 20 times a second, not once)

def down(self, *a, **k):
    raise ConnectionError("the store is down")

RemoteStore.upload = down
local, url, how = sys.argv[1:]
state = {"w": torch.zeros(4)}
with Checkpointer(local, remote=url, every_n_steps=2) as ck:
    ck._sync.retry_base_s = ck._sync.retry_max_s = 0.05
    for step in range(1, 5):
        state["w"] += 1
        ck.step(step, state)
    if how == "fails":
        raise ValueError("the user's own error")
    if how == "exits":
        sys.exit(0)
print("loop ended")
"""


@pytest.mark.parametrize("how", ["ends", "fails", "exits"])
def test_a_job_whose_uploads_were_given_up_does_not_exit_0(tmp_path, how):
    """A plain loop in a `with Checkpointer(...)` block against a store that failed for longer
    than close()'s outage limit: close() gave up, logged a warning and returned, and the
    process exited 0, so a scheduler marked the job successful although its newest checkpoints
    never left the machine's disk. Now close() raises UploadIncompleteError naming them and
    the push command, and the exit status is 1; the user's own exception, if the loop failed,
    is the one that propagates (the close error is logged beside it). A ``sys.exit(0)`` in
    the block is no failure: it exited 0 past the logged error; the error is raised now."""
    url = f"file://{tmp_path / 'remote'}"
    # forked from the session's zygote (torch imported once)
    argv = [sys.executable, "-c", _GIVE_UP_SCRIPT, str(tmp_path / "l"), url, how]
    p = spawn_ranks.run_python(argv, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "loop ended" not in p.stdout
    tail = p.stderr.strip().splitlines()[-1]
    assert "step_000000004" in p.stderr and f"resilient-ckpt push {tmp_path / 'l'}" in p.stderr
    if how in ("ends", "exits"):
        assert tail.startswith("resilient_callbacks.errors.UploadIncompleteError"), p.stderr
    else:
        assert tail == "ValueError: the user's own error", p.stderr
    assert (tmp_path / "l" / "step_000000004" / "manifest.json").exists()


@pytest.mark.parametrize("code", [0, None, 3])
def test_a_with_block_left_by_sys_exit_0_raises_the_close_error(code):
    """closing.close_on_exit (the DCP writer's and the Trainer callback's end) logged a close
    that raised while any exception propagated: a ``sys.exit(0)`` then ended the job with
    status 0 past an UploadIncompleteError. A clean exit gives way to the close error now; an
    exit with a failure status of the user's stays theirs."""
    from resilient_callbacks import closing

    def close():
        raise UploadIncompleteError("gave up", ("step_1",), "/d", "file:///r")

    if code == 3:
        closing.close_on_exit(close, SystemExit(code))  # logged; SystemExit(3) goes on
    else:
        with pytest.raises(UploadIncompleteError):
            closing.close_on_exit(close, SystemExit(code))


def test_the_push_command_close_names_carries_the_remote_options(tmp_path, monkeypatch, caplog):
    """close()'s UploadIncompleteError named `resilient-ckpt push DIR URL` without the
    remote_options the run needed (an endpoint_url: MinIO, Ceph, R2): pasted as said, the
    command went to another store or none. It names each key as `-o KEY=...` now (the values
    may be secrets); filled in, the command uploads what close() gave up on."""
    from resilient_callbacks import checkpointer as ckmod
    from resilient_callbacks import upload_wait

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 0.5)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close() looks 20 times a second)
    url = f"file://{tmp_path}/durable/run"
    local = tmp_path / "my run"  # (a space: the path is quoted in the command)
    ck = Checkpointer(local, remote=url, remote_options={"auto_mkdir": True})
    ck._sync.retry_base_s = ck._sync.retry_max_s = 0.05

    def down(*a, **k):
        raise ConnectionError("the store is down")

    ck.remote.upload = down
    ck.save(10, _state(10))
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    with pytest.raises(UploadIncompleteError) as info:
        ck.close()
    said = str(info.value)
    command = f"resilient-ckpt push '{local}' {url} -o auto_mkdir=..."
    assert f"`{command}`" in said, said
    warned = [r.getMessage() for r in caplog.records if "still only local" in r.message]
    assert len(warned) == 1 and f"`{command}`" in warned[0], warned  # (the log line's too)
    got = _cli(*shlex.split(command.replace("...", "true"))[1:])
    assert got.returncode == 0, got.stderr
    assert _committed(url, None) == {"step_000000010": 10}


def test_close_lets_a_retry_that_moves_bytes_finish_past_the_outage_limit(tmp_path, monkeypatch):
    """One upload attempt failed (a blip), and its retry, a large checkpoint, moves bytes
    steadily for longer than the outage limit. The failure count stays up until an attempt
    succeeds, so close() took the whole retry for an outage and gave up on a healthy store
    (UploadIncompleteError, exit 1). An attempt that moves bytes is let finish now. (The
    upload moves a byte each time close() looks at the status: no race with the clock.)"""
    from resilient_callbacks import checkpointer as ckmod
    from resilient_callbacks import upload_wait

    # (the retry must start before this limit: generous, it costs nothing when it does)
    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 2.5)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close() looks 20 times a second)
    url = f"memory://rc-{uuid.uuid4().hex[:10]}/run"
    ck = Checkpointer(tmp_path / "l", remote=url, keep_last=1, async_save=False)
    ck._sync.retry_base_s = ck._sync.retry_max_s = 0.05
    real_upload, real_status = ck.remote.upload, ck._sync.status
    looks, attempts = [0], []

    def status():
        p = ck._sync._progress
        if p is not None and len(attempts) > 1:  # the retry, under way: a byte per look
            looks[0] += 1
            p.update(1)
        return real_status()

    def upload(local_dir, manifest, name, progress=None):
        attempts.append(name)
        if len(attempts) == 1:
            raise ConnectionError("a blip")
        while looks[0] < 60:  # (60 looks, 0.05 s apart at least: past the 2.5 s limit)
            time.sleep(0.01)
        return real_upload(local_dir, manifest, name, progress)

    ck.remote.upload, ck._sync.status = upload, status
    ck.save(10, _state(10))
    ck.close()  # no UploadIncompleteError: the store answered all along
    assert _committed(url, None) == {"step_000000010": 10}


def test_an_upload_finishing_after_close_gave_up_deletes_nothing(tmp_path, monkeypatch):
    """close() gave up on an upload that stopped answering and released the directory (the
    error raised). The abandoned upload may still end: its thread then ran the remote and the
    local retention, in a directory another Checkpointer of the process now writes (a
    notebook, a sweep retrying in-process): it deleted that one's checkpoint still held for
    upload (keep_last=1 locally, every checkpoint wanted remotely), which never reached the
    store. A stopped uploader's attempt may still commit remotely, but it deletes nothing."""
    from resilient_callbacks import checkpointer as ckmod
    from resilient_callbacks import upload_thread, upload_wait

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 1.0)  # (the second's uploads are real ones)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close() looks 20 times a second)
    url, local = f"memory://rc-{uuid.uuid4().hex[:10]}/run", tmp_path / "l"
    first = Checkpointer(local, remote=url, keep_last=1, async_save=False)
    released, started = threading.Event(), threading.Event()
    real = first.remote.upload

    def stalls(local_dir, manifest, name, progress=None):
        started.set()
        released.wait(60)
        return real(local_dir, manifest, name, progress)

    first.remote.upload = stalls
    first.save(10, _state(10))
    assert started.wait(120)
    with monkeypatch.context() as m, pytest.raises(UploadIncompleteError):
        m.setattr(upload_thread, "STOP_JOIN_S", 0.1)  # (for the hung attempt, given up)
        first.close()
    kw = {"keep_last": 1, "remote_keep_last": "all", "async_save": False}
    second = Checkpointer(local, remote=url, **kw)
    held = threading.Event()
    real_second = second.remote.upload

    def waits(local_dir, manifest, name, progress=None):
        held.wait(60)
        return real_second(local_dir, manifest, name, progress)

    second.remote.upload = waits
    try:
        assert second.restore(_fresh()) == 10
        for s in (20, 30):
            second.save(s, _state(s))
        released.set()  # the first one's upload ends, long after its close
        first._sync._thread.join(60)
        steps = sorted(n for n in os.listdir(local) if n.startswith("step_"))
        assert "step_000000020" in steps, steps  # held for upload by the second
    finally:
        released.set()
        held.set()
        second.close()
    assert sorted(_committed(url, None).values()) == [10, 20, 30]


def test_archive_points_of_an_earlier_policy_are_kept_remotely_as_locally(tmp_path):
    """A run saved archive points (keep_every_n_steps=10) to a remote; its resume runs without
    keep_every_n_steps. Archive points are kept forever, also after the options change (the
    local tier counts the policy each manifest records); the remote retention's candidates
    did not carry the remote policy recorded, so the remote deleted 10 and 20, and with a
    remote the local tier keeps none (kept remotely): the archives were lost in both tiers."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    opts = {"remote": url, "every_n_steps": 5, "keep_last": 1}
    with Checkpointer(local, keep_every_n_steps=10, **opts) as ck:
        for s in range(1, 21):
            ck.step(s, _state(s))
    with Checkpointer(local, **opts) as ck:
        assert ck.restore(_fresh()) == 20
        for s in range(21, 36):
            ck.step(s, _state(s))
    assert set(_committed(url, None).values()) == {10, 20, 35}
    # gc --drop-archives still counts them as any other
    out = _cli("gc", str(local), "--remote", url, "--drop-archives", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    assert sorted(d["step"] for d in json.loads(out.stdout)["remote"]["delete"]) == [10, 20]
