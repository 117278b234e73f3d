"""Orders of events in which a kept incremental checkpoint could lose a blob it needs: a
collection of the blob store by the uploader's retention (another thread) while a save commits,
and the like. Each test runs the real code and forces the interleaving at the moment it matters
(no sleeps)."""

from __future__ import annotations

import threading

import torch

import spawn_ranks
from resilient_callbacks import Checkpointer, catalog, session
from test_part_blobs import FrozenAndTrained, _train


def _in_another_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_a_collection_while_a_save_commits_keeps_the_part_blobs_it_promoted(tmp_path, monkeypatch):
    """With a remote tier, the uploader's retention collects the blob store in its own thread
    whenever an upload lets it delete a checkpoint, while the persist thread commits the next
    save. The blobs the ranks of that save staged are moved into the store before its manifest
    is written; a collection between the two must not take them (the committed checkpoint
    would name a deleted blob, found only at restore)."""
    root = tmp_path / "ck"
    part = FrozenAndTrained()
    real = session.promote_staged
    with Checkpointer(root, keep_last=1, incremental=True, preemption=False) as ck:

        def promote_then_collect(staging, dirpath, manifest):
            real(staging, dirpath, manifest)
            _in_another_thread(ck._dir.blobs.collect)  # the uploader's retention, now

        _train(part, 1)
        ck.save(1, {"engine": part})
        ck.flush()
        monkeypatch.setattr(session, "promote_staged", promote_then_collect)
        _train(part, 2)
        ck.save(2, {"engine": part})
        ck.flush()
    found = catalog.committed(catalog.scan(str(root), catalog.Depth.FULL))
    assert [(e.name, e.status, e.problem) for e in found] == [
        ("step_000000002", catalog.Status.VALID, None)
    ]
    fresh = FrozenAndTrained()
    with Checkpointer(root, preemption=False) as ck:
        assert ck.restore({"engine": fresh}) == 2
    assert torch.equal(fresh.trained, part.trained)


def test_an_upload_after_a_roll_back_restore_never_deletes_the_checkpoint_restored(tmp_path):
    """A run rolled back (``resume=`` an older checkpoint of the directory) while newer ones
    of the run wait for their upload: the restore queues the newest for upload, and the
    retention after that upload must not delete the checkpoint the run restored from before
    the run commits its first save. Before, ``keep_last=1`` deleted it (only the abandoned
    newer checkpoint counted): a kill before the first save resumed the abandoned timeline,
    and the first save's blobs referred to a checkpoint that was gone."""
    root, remote = tmp_path / "ck", f"file://{tmp_path}/remote"
    part = FrozenAndTrained()
    with Checkpointer(root, keep_last=None, incremental=True, preemption=False) as ck:
        for step in (1, 2, 3):
            _train(part, step)
            ck.save(step, {"engine": part})
    back = root / "step_000000001"
    fresh = FrozenAndTrained()
    ck = Checkpointer(root, keep_last=1, remote=remote, resume=str(back), preemption=False)
    try:
        assert ck.restore({"engine": fresh}) == 1
        assert ck._dir.sync is not None and ck._dir.sync.wait(60)  # the newest is uploaded
        assert back.is_dir()
        _train(fresh, 2)
        ck.save(2, {"engine": fresh})
        ck.flush()
    finally:
        ck.close()
    # the new branch's first save committed: the lineage now says what to keep
    newest = catalog.committed(catalog.scan(str(root), catalog.Depth.FULL))[-1]
    assert newest.manifest is not None and newest.manifest.step == 2
    assert newest.status is catalog.Status.VALID, newest.problem


KILLED_BEFORE_COMMIT = r"""
import os, signal, sys
import torch
from resilient_callbacks import Checkpointer, remote_blob_put
sys.path.insert(0, sys.argv[3])
from test_part_blobs import FrozenAndTrained, _train

root, url = sys.argv[1], sys.argv[2]
part = FrozenAndTrained()
with Checkpointer(root, incremental=True, remote=url, remote_keep_last="all",
                  async_save=False, preemption=False) as ck:
    _train(part, 1)
    ck.save(1, {"engine": part})
ck = Checkpointer(root, incremental=True, remote=url, remote_keep_last="all",
                  async_save=False, preemption=False)
ck.restore({"engine": part})
# the upload of step 2 is killed once its blobs and files are up, before its manifest
remote_blob_put.settle = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
_train(part, 2)
ck.save(2, {"engine": part})
ck.close()
"""


def test_the_blobs_of_an_upload_a_kill_cut_off_are_collected_keeping_every_checkpoint(tmp_path):
    """SIGKILL during the upload of step 2, after its blobs and files went up and before its
    manifest; the local directory is then lost (a new machine resumes from the remote). With
    ``remote_keep_last="all"`` the uploader deletes the cut-off folder a day later, but it
    collected blobs only after its retention deleted a checkpoint, which keeping every one it
    never does: the blobs only that upload had put (the trained tensor of step 2) stayed for
    good. They go with the folder now."""
    import json
    import os
    import shutil
    import sys
    import time
    from pathlib import Path

    from resilient_callbacks.remote import RemoteStore

    script = tmp_path / "killed.py"
    script.write_text(KILLED_BEFORE_COMMIT)
    root, remote = tmp_path / "local", tmp_path / "durable"
    url = f"file://{remote}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    tests = str(Path(__file__).parent)
    # a process of its own, forked from the session's zygote (torch imported once)
    argv = [sys.executable, str(script), str(root), url, tests]
    run = spawn_ranks.run_python(argv, env, timeout=300)  # (only bounds a hang)
    assert run.returncode == -9, run.stderr[-2000:]
    cut = remote / "step_000000002"
    assert cut.is_dir() and not (cut / "manifest.json").exists()
    shutil.rmtree(root)  # the local copy of step 2 is lost with its machine
    day_ago = time.time() - 25 * 3600  # a day passes
    for p in [*cut.rglob("*"), cut]:
        os.utime(p, (day_ago, day_ago))
    for marker in (remote / "blobs").glob(".inflight-*.json"):
        body = json.loads(marker.read_text())
        marker.write_text(json.dumps(body | {"created": day_ago}))

    part = FrozenAndTrained()
    with Checkpointer(
        root, incremental=True, remote=url, remote_keep_last="all", preemption=False
    ) as ck:
        assert ck.restore({"engine": part}) == 1
        _train(part, 3)
        ck.save(3, {"engine": part})
    store = RemoteStore(url)
    entries = store.scan()
    assert sorted(e.name for e in entries) == ["step_000000001", "step_000000003"]
    live = {b.path for e in entries if e.manifest for b in e.manifest.blobs}
    assert sorted(os.listdir(remote / "blobs")) == sorted(live)
