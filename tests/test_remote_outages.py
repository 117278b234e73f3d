"""The remote tier behind a store that answers errors (a flaky proxy in front of moto's S3
server, :mod:`flaky_proxy`): what a lost answer, an error burst or revoked credentials leave."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings

import torch

from flaky_proxy import FlakyProxy
from resilient_callbacks import Checkpointer, ResumeFallbackWarning
from resilient_callbacks.filewrite import encode_json, write_bytes
from resilient_callbacks.manifest import FileEntry, Manifest
from resilient_callbacks.remote import NO_MANIFEST, RemoteStore
from resilient_callbacks.remote_commit import NodeUploader, RemoteCommitter
from resilient_callbacks.retention import RetentionPolicy

RETRIES = {"max_attempts": 2, "mode": "standard"}


def _state(v: float) -> dict:
    return {"w": torch.full((256,), float(v))}


def test_a_remote_commit_whose_answer_was_lost_is_still_this_processs(
    s3_server, s3_remote, tmp_path, caplog
):
    """The store wrote the manifest of step 10 but its answer was lost (a 500 after the work,
    a reset connection): the attempt failed, and by its retry step 20 had superseded it. Step
    10 was committed remotely by this process all the same: the remote retention deletes it
    (keep_last=1), and it is no checkpoint of 'another live process' (it was kept for ever and
    named as one)."""
    url, opts = s3_remote
    answered = threading.Event()  # the lost answer is held until step 20 is queued
    lost: list[str] = []

    def rule(method: str, path: str, query: str) -> str | None:
        if method == "PUT" and path.endswith("step_000000010/manifest.json"):
            lost.append(path)  # (every try of the client's: its retries are lost too)
            assert answered.wait(60)
            return "lost"
        return None

    proxy = FlakyProxy(s3_server.endpoint, rule)
    try:
        caplog.set_level(logging.INFO, "resilient_callbacks")
        ck = Checkpointer(
            tmp_path / "local",
            remote=url,
            remote_options={
                **opts,
                "endpoint_url": proxy.endpoint,
                "config_kwargs": {"retries": RETRIES},
            },
            keep_last=1,
            async_save=False,
        )
        ck._sync.retry_base_s = ck._sync.retry_max_s = 0.01
        ck.save(10, _state(10))
        ck.save(20, _state(20))  # committed locally and queued behind step 10's upload
        answered.set()
        ck.close(timeout=60)
    finally:
        answered.set()
        proxy.close()
    assert lost, "the manifest PUT of step 10 was not seen"
    committed = {e.name: e.manifest.step for e in RemoteStore(url, opts).scan() if e.manifest}
    assert committed == {"step_000000020": 20}, committed
    assert not [r for r in caplog.records if "another live process" in r.getMessage()]


def _restored_through_a_burst(
    tmp_path, s3_server, url, opts, hit, monkeypatch
) -> tuple[list[str], dict]:
    """A restore into an empty directory through a proxy that fails every request ``hit``
    (method, path) names until the retry is announced ("trying again" logged); the requests
    it failed, and the restored state. A ResumeFallbackWarning fails it. The retry goes at
    once (its 1 s backoff waits for nothing: the burst ends when it is announced)."""
    from resilient_callbacks import remote_reads, stall

    monkeypatch.setattr(stall, "backoff_s", lambda *a, **k: 0.0)  # (a download's retry)
    monkeypatch.setattr(remote_reads, "backoff_s", lambda *a, **k: 0.0)  # (a manifest read's)
    burst = threading.Event()  # the store fails the reads until the retry is announced
    burst.set()
    failed: list[str] = []

    def rule(method: str, path: str, query: str) -> str | None:
        if hit(method, path) and burst.is_set():
            failed.append(path)
            return "error"
        return None

    class Announced(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "trying again" in record.getMessage():
                burst.clear()

    proxy = FlakyProxy(s3_server.endpoint, rule)
    # (the client's own retries and their waits, seconds each, cut short: the burst outlasts them)
    proxied = {**opts, "endpoint_url": proxy.endpoint, "config_kwargs": {"retries": RETRIES}}
    handler = Announced()
    logging.getLogger("resilient_callbacks").addHandler(handler)
    try:
        state = {"w": torch.zeros(256)}
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResumeFallbackWarning)
            ck = Checkpointer(
                tmp_path / "wiped",
                remote=url,
                remote_options=proxied,
                keep_last=2,
            )
            try:
                assert ck.restore(state) == 20
            finally:
                ck.close()
    finally:
        logging.getLogger("resilient_callbacks").removeHandler(handler)
        proxy.close()
    return failed, state


def test_a_download_that_fails_at_restore_is_tried_again_not_rolled_back(
    s3_server, s3_remote, tmp_path, monkeypatch
):
    """The store answers 500 to every read of the newest remote checkpoint for a while (longer
    than its client's own retries) as a wiped node restores: the download is tried again, and
    the run resumes from it. It fell back to the older one at once (a ResumeFallbackWarning,
    the run sent back a whole save interval) over an error burst the next try rides out."""
    url, opts = s3_remote
    with Checkpointer(tmp_path / "first", remote=url, remote_options=opts, keep_last=2) as ck:
        ck.save(10, _state(10))
        ck.save(20, _state(20))
    failed, state = _restored_through_a_burst(
        tmp_path,
        s3_server,
        url,
        opts,
        lambda m, p: m == "GET" and "/step_000000020/" in p and not p.endswith(".json"),
        monkeypatch,
    )
    assert failed, "no read of step 20 was failed"
    assert torch.equal(state["w"], torch.full((256,), 20.0))


def test_a_full_durable_disk_at_the_manifest_leaves_no_torn_commit(small_tmpfs, tmp_path):
    """A ``file://`` remote whose disk fills up just as the manifest is written (every data
    file fitted): the upload fails and is retried, and nothing is left that reads as a
    committed checkpoint. The write left an empty manifest.json: a checkpoint committed and
    damaged, which every restore skipped with a warning, whose name the retry could not take
    (it went to ``-r1``), and which stopped the collection of blobs until
    ``gc --remove-corrupt``."""
    url = f"file://{small_tmpfs}/run"
    ck = Checkpointer(tmp_path / "local", remote=url, keep_last=1, async_save=False)
    ck._sync.retry_base_s = ck._sync.retry_max_s = 0.01
    ck.save(10, _state(10))
    assert ck._sync.wait(60)
    filled, first, freed = threading.Event(), threading.Event(), threading.Event()
    upload = ck.remote.upload

    def held(*a, **k):  # waits until the disk is filled, its retry until the test freed it
        assert (freed if first.is_set() else filled).wait(60)
        try:
            return upload(*a, **k)
        finally:
            first.set()

    ck.remote.upload = held
    filler = small_tmpfs / "filler"
    try:
        ck.save(20, _state(20))  # committed locally; its upload waits
        local20 = tmp_path / "local" / "step_000000020"
        want = {p.name: p.stat().st_size for p in local20.iterdir() if p.name != "manifest.json"}
        st = os.statvfs(small_tmpfs)
        room = sum(-(-n // st.f_frsize) * st.f_frsize for n in want.values())
        filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - room))  # room for the files only
        filled.set()
        assert first.wait(60)
        got = {p.name: p.stat().st_size for p in (small_tmpfs / "run" / "step_000000020").iterdir()}
        assert {n: got.get(n) for n in want} == want  # (every file fitted, the manifest did not)
        torn = [
            e for e in RemoteStore(url).scan() if e.manifest is None and e.problem != NO_MANIFEST
        ]
        assert not torn, torn
    finally:
        filled.set()
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()
        freed.set()
    ck.close(timeout=60)
    entries = RemoteStore(url).scan()
    assert [(e.name, e.problem) for e in entries] == [("step_000000020", None)], entries


def test_a_manifest_read_that_fails_at_restore_is_tried_again_not_rolled_back(
    s3_server, s3_remote, tmp_path, monkeypatch
):
    """As above for the newest remote checkpoint's manifest: the store answers 500 to its
    reads (longer than its client's retries) while a wiped node lists it. Unread, it was
    skipped loudly for the older checkpoint (and its name left for good to a checkpoint that
    was never damaged); it is read again, and the run resumes from it."""
    url, opts = s3_remote
    with Checkpointer(tmp_path / "first", remote=url, remote_options=opts, keep_last=2) as ck:
        ck.save(10, _state(10))
        ck.save(20, _state(20))
    failed, state = _restored_through_a_burst(
        tmp_path,
        s3_server,
        url,
        opts,
        lambda m, p: m == "GET" and p.endswith("/step_000000020/manifest.json"),
        monkeypatch,
    )
    assert failed, "no read of step 20's manifest was failed"
    assert torch.equal(state["w"], torch.full((256,), 20.0))


def test_a_node_local_remote_commit_whose_answer_was_lost_is_still_this_processs(
    s3_server, s3_remote, tmp_path, caplog
):
    """Node-local mode's remote commit (the coordinator's manifest over every node's part):
    the store wrote step 2's manifest and every answer was lost, so the commit was given up.
    It was committed all the same, by this process: the retention after step 3's commit
    deletes it (keep_last=1), and it is no checkpoint of 'another live process'."""
    url, opts = s3_remote
    proxy = FlakyProxy(
        s3_server.endpoint,
        lambda m, p, q: (
            "lost" if m == "PUT" and p.endswith("step_000000002/manifest.json") else None
        ),
    )
    store = RemoteStore(
        url, {**opts, "endpoint_url": proxy.endpoint, "config_kwargs": {"retries": RETRIES}}
    )
    caplog.set_level(logging.INFO, "resilient_callbacks")
    committer = RemoteCommitter(store, 2, RetentionPolicy(keep_last=1), max_attempts=1)
    up = [NodeUploader(store, str(tmp_path / f"node{r}"), r) for r in (0, 1)]
    try:
        committer.refresh_max_seq()  # (the listing at open: an empty store)
        for seq, step in ((1, 2), (2, 3)):
            name = f"step_{step:09d}"
            files = []
            for r in (0, 1):
                (tmp_path / f"node{r}" / name).mkdir(parents=True)
                d = write_bytes(
                    str(tmp_path / f"node{r}" / name / f"rank_{r:05d}.bin"), bytes([r]) * 100
                )
                files.append(FileEntry(f"rank_{r:05d}.bin", d.size, d.xxh3_64, r, "tensors"))
            m = Manifest(step=step, run_id="run1", seq=seq, world_size=2, files=files)
            committer.expect(("run1", seq), name, encode_json(m.to_json()))
            for r, u in enumerate(up):
                u.enqueue(name, name, ("run1", seq), [files[r]])
                assert u.wait(120)
                for rep in u.take_reports():
                    committer.report(r, rep)
            committer.wait(120)
        committer.stop()
        committer._thread.join(60)  # (its retention after the commit is done)
    finally:
        committer.stop()
        for u in up:
            u.stop()
        proxy.close()
    assert committer.abandoned == ["step_000000002"]  # (as far as it could tell)
    committed = {e.name for e in RemoteStore(url, opts).scan() if e.manifest}
    assert committed == {"step_000000003"}, committed
    assert not [r for r in caplog.records if "another live process" in r.getMessage()]
