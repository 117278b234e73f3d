"""A restore from a remote store that is dying (it accepts connections, then stalls every
read) is bounded: the listing and each download give up after the outage limit without
progress, with an error naming what stalled, and the restore goes on as after any failed
read. The store is a local fsspec filesystem whose reads block on an event: no sleeps, no
timing asserts (the limit is lowered to a second; the test only waits for the error)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer, stall
from resilient_callbacks import checkpointer as ckmod
from resilient_callbacks.errors import (
    NoValidCheckpointError,
    RemoteUnavailableError,
    ResumeFallbackWarning,
)


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v))}


class _Clock:
    """``stall``'s clock, moved only by the test: a pause of a loaded machine never looks like a
    stalled store. ``idle_past_limit()``, called by work the restore's read thread does
    (``rc-restore-read``), makes each read of the clock 10 s later than the one before (ten
    times the lowered limit), as minutes of that work would, until the stall loop has read it
    three times (given the read up, or gone on)."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.reads, self.idle = 0.0, 0, False
        self.cond = threading.Condition()
        monkeypatch.setattr(stall, "time", self)

    def monotonic(self) -> float:
        with self.cond:
            self.reads += 1
            self.now += 10.0 if self.idle else 0.0
            self.cond.notify_all()
            return self.now

    def idle_past_limit(self) -> None:
        if threading.current_thread().name != "rc-restore-read":
            return
        with self.cond:
            self.idle, seen = True, self.reads
            self.cond.wait_for(lambda: self.reads >= seen + 3, timeout=60)
            self.idle = False


@pytest.fixture
def dying(tmp_path, monkeypatch):
    """(local dir, url, block): a run with steps 10 and 20 uploaded to a file:// store;
    ``block(ck, "get")`` makes that method of the store's filesystem hang until the test ends
    (or 120 s: the old code, which waited for it, then fails the test rather than hang)."""
    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 1.0)
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    with Checkpointer(local, remote=url, keep_last=5) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    release = threading.Event()

    def block(ck: Checkpointer, method: str) -> None:
        def hang(*a, **k):
            release.wait(120)
            raise ConnectionError("the store never answered")

        monkeypatch.setattr(ck.remote.fs, method, hang)

    yield local, url, block
    release.set()


def test_a_download_that_stalls_is_given_up_naming_the_checkpoint(dying, caplog):
    """A new node (empty dirpath) restores from a store that lists its checkpoints but never
    sends their bytes: restore() waited forever (s3fs gives up on a request after minutes,
    other filesystems never). Now each download is given up once no byte arrived for the
    outage limit, and the restore fails naming each checkpoint and what stalled."""
    local, url, block = dying
    shutil.rmtree(local)
    ck = Checkpointer(local, remote=url, keep_last=5)
    try:
        block(ck, "get")
        with pytest.raises(NoValidCheckpointError) as info, pytest.warns(ResumeFallbackWarning):
            ck.restore(_state(0))
    finally:
        ck.close()
    said = str(info.value)
    assert f"downloading {url}/step_000000020: no byte arrived" in said, said
    assert "RemoteUnavailableError" in said and "Retry when the store answers" in said, said
    assert "file(s) not begun" in said, said


def test_a_listing_that_stalls_falls_back_to_the_local_checkpoints(dying):
    """A job requeued while its store stalls every read, with its checkpoints on the local
    disk (the preflight only warns then): the restore's listing of the store hung forever.
    Now it is given up after the outage limit: a loud fallback to the local checkpoints."""
    local, url, block = dying
    ck = Checkpointer(local, remote=url, keep_last=5)
    try:
        block(ck, "find")
        with pytest.warns(ResumeFallbackWarning, match="listing .*: no answer"):
            assert ck.restore(_state(0)) == 20
    finally:
        ck.close(timeout=5)


def test_a_listing_that_stalls_with_nothing_local_is_an_error_not_a_hang(dying, caplog):
    local, url, block = dying
    shutil.rmtree(local)
    ck = Checkpointer(local, remote=url, keep_last=5)
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    try:
        block(ck, "find")
        with pytest.raises(RemoteUnavailableError, match="not starting from scratch") as info:
            ck.restore(_state(0))
        assert "no answer" in str(info.value)
    finally:
        ck.close(timeout=5)


@pytest.mark.parametrize("method", ["get", "find"])
def test_a_pull_from_a_store_that_stalls_gives_up_naming_the_checkpoint(
    dying, tmp_path, monkeypatch, capsys, method
):
    """``resilient-ckpt pull`` from a store that stalls every read (its listing, or each
    file's bytes) waited on the client forever (s3fs: minutes per request). Now it gives up
    once nothing arrived for the outage limit and fails naming the checkpoint and files."""
    from resilient_callbacks import cli_remote
    from resilient_callbacks.cli import main

    _, url, _ = dying
    release = threading.Event()

    def hang(*a, **k):
        release.wait(120)  # the old code waited this long, then failed otherwise
        raise ConnectionError("the store never answered")

    real_store = cli_remote.store

    def dying_store(*a, **k):
        st = real_store(*a, **k)
        monkeypatch.setattr(st.fs, method, hang)
        return st

    monkeypatch.setattr(cli_remote, "store", dying_store)
    try:
        assert main(["pull", url, str(tmp_path / "pulled")]) == 1
    finally:
        release.set()
    said = capsys.readouterr().err
    if method == "get":
        assert f"downloading {url}/step_000000020: no byte arrived" in said, said
        assert "file(s) not begun" in said, said
    else:
        assert f"listing {url}: no answer" in said, said
    assert "the pull gave up after 1 s" in said and "Retry when the store answers" in said, said


def test_a_download_whose_bytes_all_arrived_is_not_given_up_while_it_is_verified(
    dying, monkeypatch
):
    """Every byte of a large checkpoint arrived, and the download then reads it all back to
    verify its checksums (minutes for hundreds of GB on a slow disk): no byte arrives from the
    store meanwhile, and the restore gave that up as a stalled store ("no byte arrived"),
    falling back to an older checkpoint or failing, with the store healthy. Now the wait for
    bytes ends once they all arrived (the manifest too): the local work is not bounded."""
    from resilient_callbacks import remote_download as remote_mod

    local, url, _ = dying
    shutil.rmtree(local)
    real = remote_mod.verify

    clock = _Clock(monkeypatch)

    def slow_verify(*a, **k):  # ten times the (lowered) outage limit of 1 s
        clock.idle_past_limit()
        return real(*a, **k)

    monkeypatch.setattr(remote_mod, "verify", slow_verify)
    ck = Checkpointer(local, remote=url, keep_last=5)
    try:
        assert ck.restore(_state(0)) == 20
    finally:
        ck.close(timeout=5)


def test_a_download_reading_local_blobs_back_is_not_given_up_as_stalled(tmp_path, monkeypatch):
    """An incremental checkpoint's download first reads back each blob it names that the local
    store already holds (and each one it fetched) to check its checksum: local work, minutes
    for large blobs on a slow disk, with no byte arriving from the store. The restore gave it up
    as a stalled store and fell back until NoValidCheckpointError, the store healthy."""
    from torch import nn

    from resilient_callbacks import remote_blob_fetch

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 1.0)
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    m[0].requires_grad_(False)  # its weight: a blob
    with Checkpointer(local, incremental=True, remote=url, async_save=False) as ck:
        ck.save(10, {"model": m})
    for n in os.listdir(local):  # the checkpoint lost, the local blob store kept
        if n.startswith("step_"):
            shutil.rmtree(local / n)
    assert os.listdir(local / "blobs")  # (the blob the download reads back)
    real = remote_blob_fetch.digest_file

    clock = _Clock(monkeypatch)

    def slow(*a, **k):  # ten times the (lowered) outage limit of 1 s
        clock.idle_past_limit()
        return real(*a, **k)

    monkeypatch.setattr(remote_blob_fetch, "digest_file", slow)
    live = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    with Checkpointer(local, incremental=True, remote=url, async_save=False) as ck:
        assert ck.restore({"model": live}) == 10
    assert torch.equal(live[0].weight, m[0].weight)


def test_a_request_ending_a_restore_wait_is_raised_without_exit_on_preemption(dying, monkeypatch):
    """exit_on_preemption=False (the caller decides what a preemption ends): a request that
    ends the restore's wait on a stalled store is the caller's RemoteWaitPreemptedError, not
    the process's exit with the preemption code."""
    from resilient_callbacks.errors import RemoteWaitPreemptedError

    local, url, _ = dying
    shutil.rmtree(local)
    ck = Checkpointer(local, remote=url, keep_last=5, exit_on_preemption=False)
    release = threading.Event()

    def hang(*a, **k):  # the store lists, then sends no byte; a cloud notice comes
        ck.watcher.trigger("notice")
        release.wait(60)
        raise ConnectionError("the store never answered")

    monkeypatch.setattr(ck.remote.fs, "get", hang)  # (fsspec caches the instance)
    try:
        with pytest.raises(RemoteWaitPreemptedError, match="notice arrived while the restore"):
            ck.restore(_state(0))
    finally:
        release.set()
        ck.close(timeout=5)
    assert not ck.preempted


_PREEMPTED_WHILE_LISTING = """
import os, signal, sys, threading
import torch
from fsspec.implementations.local import LocalFileSystem
from resilient_callbacks import Checkpointer, checkpointer

checkpointer.CLOSE_OUTAGE_S = 60.0  # the outage limit (5 min by default), the test's bound 240 s
local, url, when = sys.argv[1:]

def hang(*a, **k):  # the store stops answering its listing; the scheduler's SIGTERM comes
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(240)
    raise ConnectionError("the store never answered")

if when == "construction":
    LocalFileSystem.find = hang
resume = "never" if when == "never" else "auto"  # (never: the listing numbers new commits)
ck = Checkpointer(local, remote=url, keep_last=5, resume=resume)
LocalFileSystem.find = hang
ck.restore({"model": torch.nn.Linear(3, 2)})
print("restored", ck.restored_from, flush=True)
"""


@pytest.mark.parametrize("when", ["construction", "restore", "never"])
def test_a_sigterm_while_a_listing_stalls_ends_the_wait(tmp_path, when):
    """Since the signal handlers are installed first in Checkpointer(), a SIGTERM while the
    construction's (or the restore's) listing of a store that stopped answering waited (up to
    the outage limit, 5 min) was recorded and the wait went on, past the grace period to the
    SIGKILL; at the restore it then fell back to the local checkpoints, perhaps older (with
    resume="never", started afresh numbered after the local ones only). The
    request now ends the wait: RemoteWaitPreemptedError, nothing restored or saved, and the
    plain script (no try, no close) exits 75 saying so in one line: no traceback (it ended
    with the error's traceback and 1, or 75 after a line saying the signal came 'after the
    last step()')."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    with Checkpointer(local, remote=url, keep_last=5) as ck:
        for s in (10, 20):
            ck.save(s, {"model": torch.nn.Linear(3, 2)})
    if when == "construction":
        shutil.rmtree(local)  # (a new node: else the listing's failure is only a warning)
    before = sorted(os.listdir(f"{tmp_path}/durable/run"))
    # a process of its own, forked from the session's zygote (its own signal handlers)
    out = spawn_ranks.run_python(
        [sys.executable, "-c", _PREEMPTED_WHILE_LISTING, str(local), url, when],
        timeout=240,  # (the old code waited the 60 s limit, then went on)
    )
    assert out.returncode == 75, out.stdout + out.stderr
    who = "construction" if when == "construction" else "restore"
    said = [ln for ln in out.stderr.splitlines() if "RemoteWaitPreemptedError" in ln]
    assert len(said) == 1, out.stderr
    assert f"RemoteWaitPreemptedError: listing {url}: SIGTERM arrived while the {who}" in said[0]
    assert said[0].endswith("exiting with code 75 so the scheduler restarts the job"), said
    assert "Traceback" not in out.stderr and "after the last step()" not in out.stderr, out.stderr
    assert "restored" not in out.stdout
    assert sorted(os.listdir(f"{tmp_path}/durable/run")) == before


_PREEMPTED_WHILE_DOWNLOADING = """
import os, signal, sys, threading
import torch
from fsspec.implementations.local import LocalFileSystem
from resilient_callbacks import Checkpointer, checkpointer

checkpointer.CLOSE_OUTAGE_S = 60.0  # the outage limit (5 min by default), the test's bound 240 s
local, url = sys.argv[1:]

def hang(*a, **k):  # the store lists, then never sends a byte; the scheduler's SIGTERM comes
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(240)
    raise ConnectionError("the store never answered")

ck = Checkpointer(local, remote=url, keep_last=5)
LocalFileSystem.get = hang
ck.restore({"model": torch.nn.Linear(3, 2)})
print("restored", ck.restored_from, flush=True)
"""


def test_a_sigterm_while_a_download_stalls_ends_the_wait(tmp_path):
    """A new node (empty dirpath) restores from a store that lists its checkpoints and then
    sends no byte; SIGTERM comes. The download waited out the outage limit (5 min) for each
    checkpoint in turn, past the grace period to the SIGKILL, as a listing did. The request
    now ends the wait: RemoteWaitPreemptedError naming the download, nothing restored, no
    fallback to an older checkpoint; the script exits 75, said in one line (no traceback)."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    with Checkpointer(local, remote=url, keep_last=5) as ck:
        for s in (10, 20):
            ck.save(s, {"model": torch.nn.Linear(3, 2)})
    shutil.rmtree(local)
    before = sorted(os.listdir(f"{tmp_path}/durable/run"))
    out = spawn_ranks.run_python(
        [sys.executable, "-c", _PREEMPTED_WHILE_DOWNLOADING, str(local), url],
        timeout=240,  # (the old code waited the 60 s limit for each checkpoint, then failed)
    )
    assert out.returncode == 75, out.stdout + out.stderr[-3000:]
    said = f"RemoteWaitPreemptedError: downloading {url}/step_000000020: SIGTERM arrived while"
    assert said in out.stderr, out.stderr[-3000:]
    assert "exiting with code 75 so the scheduler restarts the job" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "step_000000010" not in out.stderr, out.stderr[-3000:]  # (not tried next)
    assert "restored" not in out.stdout
    assert sorted(os.listdir(f"{tmp_path}/durable/run")) == before
    assert not [n for n in os.listdir(local) if n.startswith("step_")]


_TWO_CHECKPOINTERS_PREEMPTED_AT_RESTORE = """
import os, signal, sys, threading
import torch
from fsspec.implementations.local import LocalFileSystem
from resilient_callbacks import Checkpointer, checkpointer

checkpointer.CLOSE_OUTAGE_S = 60.0  # the outage limit (5 min by default), the test's bound 240 s
ema_dir, local, url = sys.argv[1:]

def hang(*a, **k):  # the store lists, then never sends a byte; the scheduler's SIGTERM comes
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(240)
    raise ConnectionError("the store never answered")

ema = Checkpointer(ema_dir, keep_last=5)  # a second Checkpointer of the process (an EMA's)
ck = Checkpointer(local, remote=url, keep_last=5)
LocalFileSystem.get = hang
ck.restore({"model": torch.nn.Linear(3, 2)})
print("restored", ck.restored_from, flush=True)
"""


def test_a_request_ending_a_restore_wait_tells_another_checkpointer_nothing_was_saved(tmp_path):
    """A model's Checkpointer's restore waits on a stalled store; SIGTERM ends the wait and the
    process exits 75 without saving. The process's other Checkpointer (an EMA's), closed at
    exit, said "another Checkpointer of this process saved and is exiting": nothing was saved.
    It now says the process is exiting for the request, with nothing saved."""
    local, url = tmp_path / "local", f"file://{tmp_path}/durable/run"
    with Checkpointer(local, remote=url, keep_last=5) as ck:
        ck.save(10, {"model": torch.nn.Linear(3, 2)})
    shutil.rmtree(local)
    out = spawn_ranks.run_python(
        [
            sys.executable,
            "-c",
            _TWO_CHECKPOINTERS_PREEMPTED_AT_RESTORE,
            str(tmp_path / "ema"),
            str(local),
            url,
        ],
        timeout=240,
    )
    assert out.returncode == 75, out.stdout + out.stderr[-3000:]
    assert "restored" not in out.stdout
    assert "saved and is exiting" not in out.stderr, out.stderr[-3000:]
    said = [ln for ln in out.stderr.splitlines() if "another Checkpointer" in ln]
    assert len(said) == 1, out.stderr[-3000:]
    assert "is exiting for it before anything was saved" in said[0], said
    assert str(tmp_path / "ema") in said[0], said
