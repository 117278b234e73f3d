"""Incremental checkpoints with the remote tier, on a real S3 API server (moto) through s3fs:
a blob is uploaded once, remote retention deletes only unreferenced blobs, and a run whose
local directory is gone resumes from the remote copy exactly."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from torch import nn

from resilient_callbacks import Checkpointer
from resilient_callbacks.remote import RemoteStore
from resilient_callbacks.remote_blobs import listing


def _state() -> dict:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 32))
    m[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    return {"model": m, "opt": opt}


def _train(state: dict, step: int) -> None:
    torch.manual_seed(step)
    state["model"](torch.randn(4, 256)).square().mean().backward()
    state["opt"].step()
    state["opt"].zero_grad()


def test_blobs_are_uploaded_once_and_resume_from_remote_is_exact(s3_remote, tmp_path):
    url, opts = s3_remote
    state = _state()
    puts: list[str] = []
    with Checkpointer(
        tmp_path / "local",
        incremental=True,
        keep_last=1,
        remote=url,
        remote_options=opts,
        remote_keep_last=2,
        async_save=False,
    ) as ck:
        fs = ck.remote.fs  # the real s3fs filesystem; count what it is asked to put
        real_put = fs.put

        def counting_put(lpath, rpath, *a, **kw):
            puts.extend([rpath] if isinstance(rpath, str) else rpath)
            return real_put(lpath, rpath, *a, **kw)

        fs.put = counting_put
        try:
            for step in range(1, 5):
                _train(state, step)
                ck.save(step, state)
                ck._dir.sync.wait(60)
        finally:
            del fs.put
        want = {k: v.clone() for k, v in state["model"].state_dict().items()}
        want_opt = state["opt"].state_dict()["state"]
    frozen = "blobs/"  # the frozen layer's weight: one blob, put once in four uploads
    blob_puts = [p for p in puts if frozen in p]
    per_name: dict[str, int] = {}
    for p in blob_puts:
        per_name[p.rsplit("/", 1)[1]] = per_name.get(p.rsplit("/", 1)[1], 0) + 1
    assert max(per_name.values()) == 1, per_name  # no blob was ever uploaded twice
    store = RemoteStore(url, opts)
    entries = [e for e in store.scan() if e.manifest is not None]
    assert [e.manifest.step for e in entries] == [3, 4]
    assert all(e.problem is None for e in entries)
    live = {b.path for e in entries for b in e.manifest.blobs}
    remote_blobs = {n for n in listing(store) if not n.startswith(".")}
    assert remote_blobs == live  # remote retention left no unreferenced blob, none missing
    shared = set.intersection(*({b.path for b in e.manifest.blobs} for e in entries))
    assert shared  # the frozen weight is one object both remote checkpoints refer to

    shutil.rmtree(tmp_path / "local")
    fresh = _state()
    with torch.no_grad():
        for p in fresh["model"].parameters():
            p.zero_()
    with Checkpointer(
        tmp_path / "local", incremental=True, remote=url, remote_options=opts, async_save=False
    ) as ck:
        assert ck.restore(fresh) == 4
        assert ck.last_restore is not None and ck.last_restore.tier == "remote"
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, want[k]), k
    got_opt = fresh["opt"].state_dict()["state"]
    assert got_opt.keys() == want_opt.keys()
    for k, v in got_opt.items():
        assert torch.equal(v["momentum_buffer"], want_opt[k]["momentum_buffer"])


def test_pull_makes_a_self_contained_copy(tmp_path, capsys):
    """``resilient-ckpt pull`` of an incremental checkpoint brings the blobs it refers to: the
    pulled directory verifies and restores on its own."""
    from resilient_callbacks.cli import main

    url = f"file://{tmp_path}/durable"
    state = _state()
    with Checkpointer(
        tmp_path / "local", incremental=True, remote=url, async_save=False, keep_last=1
    ) as ck:
        for step in (1, 2):
            _train(state, step)
            ck.save(step, state)
        want = {k: v.clone() for k, v in state["model"].state_dict().items()}
    assert main(["pull", url, str(tmp_path / "copy")]) == 0
    shutil.rmtree(tmp_path / "local")
    shutil.rmtree(tmp_path / "durable")
    assert main(["verify", str(tmp_path / "copy"), "--all"]) == 0
    assert "every checksum matches" in capsys.readouterr().out
    fresh = _state()
    with Checkpointer(tmp_path / "copy", async_save=False) as ck:
        assert ck.restore(fresh) == 2
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, want[k]), k


def test_push_repairs_a_torn_blob_that_two_remote_checkpoints_share(tmp_path, capsys):
    """The frozen layer's blob, shared by both remote checkpoints, torn: both are
    'remote-corrupt'; push uploads the blob again and both are whole. It refused ("named by a
    remote checkpoint"), after uncommitting the first, and never recovered."""
    import json

    from resilient_callbacks.cli import main

    url = f"file://{tmp_path}/durable"
    state = _state()
    with Checkpointer(tmp_path / "local", incremental=True, remote=url, async_save=False) as ck:
        for step in (1, 2):
            _train(state, step)
            ck.save(step, state)
    store = RemoteStore(url)
    shared = set.intersection(*({b.path for b in e.manifest.blobs} for e in store.scan()))
    torn = tmp_path / "durable" / "blobs" / sorted(shared)[0]
    torn.write_bytes(torn.read_bytes()[:100])
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "local"), "--remote", url, "--json"]) == 0
    out = capsys.readouterr().out
    assert [r["tier"] for r in json.loads(out)] == ["remote-corrupt"] * 2, out
    assert main(["push", str(tmp_path / "local"), url]) == 0
    assert "its remote copy was damaged" in capsys.readouterr().out
    assert main(["ls", str(tmp_path / "local"), "--remote", url, "--json"]) == 0
    assert [r["tier"] for r in json.loads(capsys.readouterr().out)] == ["both"] * 2
    assert all(e.problem is None for e in store.scan())


def test_gc_remote_deletes_the_blobs_a_killed_upload_left_when_it_deletes_no_checkpoint(
    tmp_path, capsys
):
    """A blob no manifest names and its in-flight marker, a day old (what a killed upload
    leaves): ``gc --remote`` deletes both, also when no checkpoint is due for deletion (it
    collected blobs only after deleting a checkpoint, while --dry-run listed them)."""
    import json
    import os
    import time

    from resilient_callbacks.cli import main

    url, remote = f"file://{tmp_path}/durable", tmp_path / "durable"
    state = _state()
    with Checkpointer(tmp_path / "local", incremental=True, remote=url, async_save=False) as ck:
        for step in (1, 2):
            _train(state, step)
            ck.save(step, state)
    orphan = "0123456789abcdef0123456789abcdef.safetensors"
    (remote / "blobs" / orphan).write_bytes(b"x" * 100)
    marker = remote / "blobs" / ".inflight-deadbeef0000.json"
    marker.write_text(json.dumps({"created": time.time() - 25 * 3600, "blobs": [orphan]}))
    before = set(os.listdir(remote / "blobs"))
    args = ["gc", str(tmp_path / "local"), "--remote", url, "--json"]
    assert main([*args, "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["remote"]["blobs_deleted"] == [orphan]
    assert set(os.listdir(remote / "blobs")) == before
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["remote"]["blobs_deleted"] == [orphan]
    assert set(os.listdir(remote / "blobs")) == before - {orphan, marker.name}
    assert main(["pull", url, str(tmp_path / "copy")]) == 0


KILLED_UPLOAD = r"""
import os, signal, sys
import torch
from torch import nn
from resilient_callbacks import Checkpointer

root, url, mode = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 32))
m[0].requires_grad_(False)
state = {"model": m}
ck = Checkpointer(root, incremental=True, remote=url, async_save=False, keep_last=2)
start = ck.restore(state)
if mode != "resume":
    from resilient_callbacks import remote_put
    real_copy = remote_put._copy

    def copy(src, dst, buf, progress):  # the blob copy is killed half-way
        if "/blobs/" not in dst:
            return real_copy(src, dst, buf, progress)
        name = os.path.basename(dst)  # .upload-<tag>-<blob>: a copy under a blob's name
        target = dst if mode == "tmp" else dst[: -len(name)] + name.split("-", 2)[2]
        data = open(src, "rb").read()
        with open(target, "wb") as f:
            f.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    remote_put._copy = copy
for step in range(start + 1, start + 3):
    with torch.no_grad():
        m[1].weight.add_(1.0)
    ck.save(step, state)
    if mode != "resume":
        ck.close()  # waits for the upload of step 1, which kills the process
ck.close()
print("CLOSED", start, flush=True)
"""


@pytest.mark.parametrize("where", ["tmp", "final"])
def test_a_blob_upload_killed_part_way_does_not_block_later_uploads(tmp_path, where):
    """SIGKILL while a blob is copied to a ``file://`` remote. ``tmp``: as this library copies
    (a temporary name renamed into place): nothing torn under the blob's name. ``final``: as a
    non-atomic store would (or an older version did), half the blob under its own name: every
    later upload failed ("another size ... not replacing it") and the remote tier was dead;
    the next run of the run uploads it again, as no remote checkpoint names it."""
    import sys

    import spawn_ranks
    from resilient_callbacks.cli import main

    script = tmp_path / "killed_upload.py"
    script.write_text(KILLED_UPLOAD)
    url, local = f"file://{tmp_path}/durable", str(tmp_path / "local")

    def run(mode: str) -> tuple[int, str]:
        """The script as a process of its own, forked from the session's zygote that imported
        torch and the library once (spawn_ranks.Zygote); its exit status and output."""
        log = tmp_path / f"{mode}.log"
        env = dict(os.environ, PYTHONHASHSEED="0")  # (the zygote's: else a fresh interpreter)
        p = spawn_ranks.shared_zygote().spawn(
            [sys.executable, str(script), local, url, mode], env, log
        )
        return p.wait(timeout=120), log.read_text()

    rc, out = run(where)
    assert rc == -9, out[-2000:]
    blobs = tmp_path / "durable" / "blobs"
    names = [n for n in os.listdir(blobs) if n.endswith(".safetensors")]
    if where == "tmp":
        assert all(n.startswith(".upload-") for n in names), names  # none under a blob's name
    else:
        assert len(names) == 1 and not names[0].startswith(".")
    rc, out = run("resume")
    assert rc == 0, out[-2000:]
    assert "CLOSED 1" in out  # resumed at step 1, committed before its upload
    store = RemoteStore(url)
    assert sorted(e.manifest.step for e in store.scan() if e.manifest) == [2, 3]
    here = os.path.join(local, "blobs")
    local_blobs = {n: os.path.getsize(os.path.join(here, n)) for n in os.listdir(here)}
    assert {n: s for n, s in listing(store).items() if n in local_blobs} == local_blobs
    assert main(["pull", url, str(tmp_path / "copy")]) == 0  # every checksum verified


def _damage_blob_only_newest_names(remote_root) -> str:
    """Flip a byte (same size) of a blob the newest remote checkpoint names and the older one
    does not; return the blob's name."""
    import json

    older, newest = sorted(p for p in remote_root.iterdir() if p.name.startswith("step_"))
    names = [
        {b["path"] for b in json.loads((p / "manifest.json").read_text())["blobs"]}
        for p in (older, newest)
    ]
    name = sorted(names[1] - names[0])[0]
    path = remote_root / "blobs" / name
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF
    path.write_bytes(bytes(data))
    return name


def test_pull_falls_back_loudly_past_a_newest_checkpoint_whose_blob_rotted(tmp_path, capsys):
    """A blob only the newest remote checkpoint names is damaged in place (same size): the
    sizes the store lists are right, the checksum is not. ``pull`` (no ``--step``) says which
    checkpoint it skipped and why, and pulls the next newest, as a restore falls back; it
    leaves no downloaded blob that no pulled checkpoint names. ``--step`` of the damaged one
    fails, saying how to find a good one."""
    from resilient_callbacks.blobs import live_blobs
    from resilient_callbacks.cli import main

    url = f"file://{tmp_path}/durable"
    state = _state()
    with Checkpointer(
        tmp_path / "local", incremental=True, remote=url, async_save=False, keep_last=2
    ) as ck:
        for step in (1, 2):
            _train(state, step)
            ck.save(step, state)
            if step == 1:
                want = {k: v.clone() for k, v in state["model"].state_dict().items()}
    bad = _damage_blob_only_newest_names(tmp_path / "durable")
    capsys.readouterr()
    assert main(["pull", url, str(tmp_path / "copy")]) == 0
    out, err = capsys.readouterr()
    assert "step_000000002" in err and bad in err and "manifest says" in err, err
    assert "step_000000001" in out, out
    copy = tmp_path / "copy"
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith("step_")) == [
        "step_000000001"
    ]
    assert sorted(os.listdir(copy / "blobs")) == sorted(live_blobs(str(copy)) or ())
    assert main(["verify", str(copy), "--all"]) == 0
    fresh = _state()
    with Checkpointer(copy, async_save=False) as ck:
        assert ck.restore(fresh) == 1
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, want[k]), k
    capsys.readouterr()
    assert main(["pull", url, str(tmp_path / "copy2"), "--step", "2"]) == 1
    err = capsys.readouterr().err
    assert bad in err and "--step" in err and "verify" in err, err


def _flip_largest(folder) -> None:
    victim = max((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_resume_of_a_step_whose_local_blob_rotted_loads_its_remote_copy(tmp_path):
    """``resume=2`` with step 2's frozen blob damaged on the local disk and whole in the remote
    tier: the restore names the local copy and loads the remote one, exactly (remote.md: a
    damaged local copy is followed by its remote copy; ``resume=<step>`` finds that step in
    either tier). It raised CheckpointCorruptError on the local copy and never tried the
    remote. With both copies damaged the explicit choice still fails, never an older step."""
    from resilient_callbacks.errors import CheckpointCorruptError, ResumeFallbackWarning

    url = f"file://{tmp_path}/durable"
    state, want = _state(), {}
    with Checkpointer(
        tmp_path / "local", incremental=True, remote=url, keep_last=3, async_save=False
    ) as ck:
        for step in (1, 2, 3):
            _train(state, step)
            ck.save(step, state)
            want[step] = {k: v.clone() for k, v in state["model"].state_dict().items()}
    _flip_largest(tmp_path / "local" / "blobs")  # the frozen weight, named by every step
    fresh = _state()
    with (
        pytest.warns(ResumeFallbackWarning, match="trying its copy in the remote tier"),
        Checkpointer(tmp_path / "local", remote=url, resume=2, async_save=False) as ck,
    ):
        assert ck.restore(fresh) == 2
        assert ck.last_restore is not None and ck.last_restore.tier == "remote"
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, want[2][k]), k

    _flip_largest(tmp_path / "local" / "blobs")
    _flip_largest(tmp_path / "durable" / "blobs")
    with (
        pytest.warns(ResumeFallbackWarning),
        Checkpointer(tmp_path / "local", remote=url, resume=2, async_save=False) as ck,
        pytest.raises(CheckpointCorruptError, match="step_000000002"),
    ):
        ck.restore(_state())


def _put_straight(bucket: str, objects: dict[str, bytes]) -> None:
    """Objects written into the moto server's store itself, not through its HTTP API: 1200
    puts through s3fs took 13 s on a loaded 2-core machine, these 0.1 s. The library still
    reads and deletes them through the S3 API."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for key, data in objects.items():
        backend.put_object(bucket, key, data)


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_a_remote_store_of_more_objects_than_one_listing_page_is_seen_whole(s3_remote, tmp_path):
    """S3 lists at most 1000 keys per request. A blob store past that (1100 unused blobs, a
    killed run's, beside the run's own; every step_* key sorts after blobs/, so the
    checkpoints come pages later): the scan finds every checkpoint, an upload reuses the
    blobs already there, blob collection deletes every unused blob (in a few requests, not
    1100) and no used one, and a restore from the remote loads every blob it needs."""
    from resilient_callbacks import remote_blobs

    url, opts = s3_remote
    bucket, prefix = url[len("s3://") :].split("/", 1)
    unused = {f"{i:032x}.safetensors" for i in range(1100)}
    _put_straight(bucket, {f"{prefix}/blobs/{n}": b"x" * 8 for n in unused})
    store = RemoteStore(url, opts)
    assert set(listing(store)) == unused
    state = _state()
    ck = Checkpointer(
        tmp_path / "local",
        incremental=True,
        remote=url,
        remote_options=opts,
        keep_last=1,
        remote_keep_last="all",
        async_save=False,
    )
    for step in (1, 2):
        _train(state, step)
        ck.save(step, state)
    ck._dir.sync.wait(60)
    fs = ck.remote.fs  # (fsspec's cached instance: the one the store below uses too)
    puts: list[str] = []
    real_put = fs.put

    def counting_put(lpath, rpath, *a, **kw):
        puts.extend(rpath if isinstance(rpath, list) else [rpath])
        return real_put(lpath, rpath, *a, **kw)

    fs.put = counting_put
    try:
        ck.save(3, state)  # nothing trained: every blob is one uploaded before
        ck.close()
    finally:
        fs.put = real_put  # (not del: fsspec's sync methods are the instance's own)
    assert puts and not [p for p in puts if "/blobs/" in p]
    entries = store.scan()
    assert [e.manifest.step for e in entries if e.committed] == [1, 2, 3]
    used = {b.path for e in entries for b in e.manifest.blobs}
    assert used and not used & unused
    assert {n for n in listing(store) if not n.startswith(".")} == used | unused
    deletes: list[str] = []
    real_rm, real_rm_file = store.fs.rm, store.fs.rm_file
    store.fs.rm = lambda p, *a, **kw: (deletes.append("rm"), real_rm(p, *a, **kw))[1]
    store.fs.rm_file = lambda p, *a, **kw: (deletes.append("rm_file"), real_rm_file(p, *a, **kw))[1]
    try:
        assert set(remote_blobs.collect(store)) == unused
    finally:
        store.fs.rm, store.fs.rm_file = real_rm, real_rm_file
    assert len(deletes) < 10, deletes  # (the collect marker's own removal counts one)
    assert {n for n in listing(store) if not n.startswith(".")} == used
    fresh = _state()
    with Checkpointer(tmp_path / "elsewhere", remote=url, remote_options=opts) as again:
        assert again.restore(fresh) == 3
    for a, b in zip(fresh["model"].parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def _refusing(store, monkeypatch, error: Exception) -> list[int]:
    """A batched delete (S3's DeleteObjects) of several keys raises ``error`` (the size of
    each batch noted)."""
    real, batches = store.fs.call_s3, []

    def call_s3(method, *a, **kw):
        if method == "delete_objects" and len(kw["Delete"]["Objects"]) > 1:
            batches.append(len(kw["Delete"]["Objects"]))
            raise error
        return real(method, *a, **kw)

    monkeypatch.setattr(store.fs, "call_s3", call_s3)
    return batches


def test_unused_blobs_of_a_store_that_refuses_batched_deletes_go_one_by_one(
    s3_remote, monkeypatch, caplog
):
    """An S3-compatible store without DeleteObjects answers a batch with an error: every
    collection failed there (it deleted one blob per request before batches); it now deletes
    them one by one after the first refused batch."""
    import logging

    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    from resilient_callbacks import remote_blobs

    url, opts = s3_remote
    bucket, prefix = url[len("s3://") :].split("/", 1)
    unused = [f"{i:032x}.safetensors" for i in range(5)]
    _put_straight(bucket, {f"{prefix}/blobs/{n}": b"x" for n in unused})
    store = RemoteStore(url, opts)
    monkeypatch.setattr(remote_blobs, "DELETE_BATCH", 2)
    answer = {  # as the store's client raises it: its answer, 501 (s3fs translates it)
        "Error": {"Code": "NotImplemented", "Message": "DeleteObjects is not implemented"},
        "ResponseMetadata": {"HTTPStatusCode": 501},
    }
    refusal = translate_boto_error(ClientError(answer, "DeleteObjects"))
    batches = _refusing(store, monkeypatch, refusal)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    assert remote_blobs.collect(store) == unused
    assert batches == [2] and listing(store) == {}  # (an answered batch leaves no marker)
    said = [r.getMessage() for r in caplog.records]
    assert any("a batched delete failed" in m and "one by one" in m for m in said), said


def test_blobs_deleted_one_by_one_stop_at_the_deadline(s3_remote, monkeypatch):
    """A batch that failed (a blob gone meanwhile) is deleted again blob by blob: those
    deletes went on past the collection's deadline, after which an upload may rely on a blob
    that was unused. (Under a prefix holding ``?`` every blob went by its own request too;
    on S3 they now go in batches: test_remote_requests.py.)"""
    import types

    from resilient_callbacks import remote_blobs

    url, opts = s3_remote
    bucket, prefix = url[len("s3://") :].split("/", 1)
    unused = [f"{i:032x}.safetensors" for i in range(5)]
    _put_straight(bucket, {f"{prefix}/blobs/{n}": b"x" for n in unused})
    store = RemoteStore(url, opts)
    monkeypatch.setattr(remote_blobs, "DELETE_BATCH", 3)
    _refusing(store, monkeypatch, FileNotFoundError("one went meanwhile"))
    clock = [0.0]  # the collection's own clock: the deadline passes after the first delete
    monkeypatch.setattr(
        remote_blobs, "time", types.SimpleNamespace(time=time.time, monotonic=lambda: clock[0])
    )
    real_rm_file = store.fs.rm_file

    def rm_file(p, *a, **kw):
        if p.endswith(".safetensors"):
            clock[0] += 2 * remote_blobs.COLLECT_MAX_S
        return real_rm_file(p, *a, **kw)

    monkeypatch.setattr(store.fs, "rm_file", rm_file)
    assert remote_blobs.collect(store) == unused[:1]
    assert sorted(listing(store)) == unused[1:]
