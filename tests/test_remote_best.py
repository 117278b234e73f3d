"""``keep_best`` with ``remote_every_n_saves`` > 1: the best checkpoint reaches the remote tier
(docs/remote.md, docs/multinode.md "Intervals per tier"). A save that is one of the best the
remote retention keeps (``remote_keep_best``, by default ``keep_best``) was uploaded only when it
was also an Nth save: otherwise it lay on the local disks only (in node-local mode: lost with a
node), and the remote kept the best of what it was given, not the run's best. Node-local tests:
two gloo ranks, one node each, through the worker of tests/test_nodelocal_failures.py, whose
rank 0's loss is the step (the best, the lowest: step 2, commit 1)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from resilient_callbacks import Checkpointer
from test_nodelocal_failures import _run


def _committed(remote: Path) -> list[str]:
    return sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))


def _forget_upload(history: Path, step: int) -> None:
    """Drop the ``upload`` records of ``step`` from a run's history: what a run of the library
    before this change left (it never uploaded that checkpoint, so it recorded no upload)."""
    lines = history.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        r = json.loads(line)
        if not (r.get("event") == "upload" and r.get("step") == step):
            kept.append(line)
    assert len(kept) < len(lines)
    history.write_text("".join(kept))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_node_local_the_best_checkpoint_is_uploaded_though_not_an_nth_save(tmp_path):
    """remote_every_n_saves=3 uploads commit 3 (step 6); the best, step 2 (commit 1), was not
    uploaded, and the store held step 6 alone: the run's best was on the nodes' disks only.
    It is now uploaded and committed as it is saved, and the remote retention keeps it."""
    _run(tmp_path, "first", 2, "--steps", "8", "--remote-every", "3", RC_KEEP_BEST=1,
         RC_KEEP_LAST=1)  # fmt: skip
    assert _committed(tmp_path / "remote") == ["step_000000002", "step_000000006"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_node_local_a_best_upload_a_stop_cut_off_is_uploaded_at_the_restart(tmp_path):
    """The uploads failed, then a kill after step 4: the restart queues again the uploads a
    stop cut off, but only of those due under remote_every_n_saves (none of commits 1 and 2):
    the best, step 2, stayed local. It is due as the best, so the restart uploads it."""
    _run(tmp_path, "first", 2, "--steps", "4", "--remote-every", "3", "--kill-at", "4",
         expect=-9, RC_UPLOADS_FAIL=1, RC_KEEP_BEST=1, RC_KEEP_LAST=1)  # fmt: skip
    assert _committed(tmp_path / "remote") == []
    out = _run(tmp_path, "second", 2, "--steps", "4", "--remote-every", "3", RC_KEEP_BEST=1,
               RC_KEEP_LAST=1)  # fmt: skip
    assert [rank[0]["restored"] for rank in out] == [4, 4], out
    assert _committed(tmp_path / "remote") == ["step_000000002"]


@pytest.mark.distributed
@pytest.mark.slow  # three runs of two ranks (about 5 s)
@pytest.mark.timeout(600)
def test_node_local_an_older_best_never_uploaded_is_uploaded_once_at_a_restart(tmp_path):
    """A run of the library before this change: the best, step 2 (commit 1), never uploaded,
    older than the store's newest commit of the run (step 6): the restart took it as uploaded
    and deleted there since, as any older checkpoint. It is uploaded where rank 0's history
    records no remote commit of it, as an archive point is; once deleted from the store on
    purpose (recorded), the next restart does not upload it again."""
    common = ("--steps", "8", "--remote-every", "3")
    env = {"RC_KEEP_BEST": 1, "RC_KEEP_LAST": 1, "RC_CAPTURE_LOG": 1}
    _run(tmp_path, "first", 2, *common, **env)
    remote = tmp_path / "remote"
    shutil.rmtree(remote / "step_000000002")  # (as before this change: never uploaded)
    _forget_upload(tmp_path / "node0" / "history.jsonl", 2)
    out = _run(tmp_path, "second", 2, *common, **env)
    assert [rank[0]["restored"] for rank in out] == [8, 8], out
    assert _committed(remote) == ["step_000000002", "step_000000006"], out[0][-1]["log"]
    for rank in out:
        said = rank[-1]["log"]
        assert "uploading its part of step_000000002, a best checkpoint" in said, said
    shutil.rmtree(remote / "step_000000002")  # (deleted on purpose: gc --remote, by hand)
    out = _run(tmp_path, "third", 2, *common, **env, RC_LOG_INFO=1)
    assert "not uploading step 2 (commit 1) again: committed remotely" in out[0][-1]["log"]
    assert _committed(remote) == ["step_000000006"]
    for node in (0, 1):  # (its copies stay)
        assert (tmp_path / f"node{node}" / "step_000000002").is_dir()


def _shared_run(local: str, url: str, last: int, **kw) -> int:
    """Saves of every step to ``last``, only every 3rd uploaded; the loss is lowest at step 2."""
    state = {"w": torch.zeros(4)}
    opts = {"every_n_steps": 1, "keep_last": 1, "keep_best": 1, "monitor": "loss"}
    opts |= {"remote": url, "remote_every_n_saves": 3, "async_save": False, **kw}
    with Checkpointer(local, **opts) as ck:
        start = ck.restore(state)
        for step in range(start + 1, last + 1):
            state["w"] += 1
            ck.step(step, state, metrics={"loss": 0.5 if step == 2 else float(step)})
    return start


def test_shared_the_best_checkpoint_is_uploaded_though_not_an_nth_save(tmp_path):
    """One writer on a shared filesystem: the same. Commits 3 and 6 were uploaded, the best
    (step 2) was not, and the remote retention kept step 6 alone."""
    local, remote = str(tmp_path / "local"), tmp_path / "durable"
    _shared_run(local, f"file://{remote}", 6)
    assert _committed(remote) == ["step_000000002", "step_000000006"]
    kept = sorted(n for n in os.listdir(local) if n.startswith("step_"))
    assert kept == ["step_000000002", "step_000000006"]  # (keep_best, keep_last)


def test_shared_an_older_best_never_uploaded_is_uploaded_once_at_a_restart(tmp_path, caplog):
    """A run of the library before this change never uploaded its best (step 2): the restart
    left it local. It is now uploaded; deleted from the store on purpose since (the history
    records its upload), the next restart does not upload it again."""
    local, remote = str(tmp_path / "local"), tmp_path / "durable"
    url = f"file://{remote}"
    _shared_run(local, url, 6)
    shutil.rmtree(remote / "step_000000002")  # (as before this change: never uploaded)
    _forget_upload(Path(local) / "history.jsonl", 2)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    assert _shared_run(local, url, 6) == 6
    assert _committed(remote) == ["step_000000002", "step_000000006"], caplog.text
    shutil.rmtree(remote / "step_000000002")  # (deleted on purpose: gc --remote, by hand)
    caplog.clear()
    assert _shared_run(local, url, 6) == 6
    assert "deleted from it since" in caplog.text, caplog.text
    assert _committed(remote) == ["step_000000006"]


def test_a_directory_that_cannot_be_read_counts_the_save_as_best(tmp_path, caplog):
    """The coordinator ranks a save among the directory's checkpoints; where it cannot list
    them (a file where the folder was, permission denied), one upload too many is harmless and
    the best missing from the store is not: it counts the save as best, said at WARNING
    (node-local: it decides for every node, which wait for its answer, so it never raises)."""
    from resilient_callbacks import remote_best
    from resilient_callbacks.retention import RetentionPolicy

    policy = RetentionPolicy(keep_last=1, keep_best=1, monitor="loss")
    blocked = tmp_path / "ck"
    blocked.write_text("not a folder")
    assert remote_best.is_best(str(blocked), "step_000000002", policy, "run1")
    assert "could not be read to tell (NotADirectoryError" in caplog.text, caplog.text
    assert not remote_best.is_best(str(blocked), "step_000000002", RetentionPolicy(), "run1")


def test_a_best_checkpoint_the_store_dropped_may_have_been_deleted_by_its_retention(caplog):
    """Node-local restart: a best checkpoint whose remote commit rank 0's history records, gone
    from the store, was said deleted by gc or by hand only; with remote_keep_best > keep_best
    the remote retention deletes one itself once the store holds better ones the nodes' disks
    no longer keep. The INFO now says so of a best one (not of an archive point: kept there)."""
    from types import SimpleNamespace

    from resilient_callbacks import node_recovery, remote_best

    d = SimpleNamespace(remote=SimpleNamespace(url="file:///store"), dirpath="/ck")
    kinds = {1: remote_best.BEST, 2: remote_best.ARCHIVE}
    caplog.set_level(logging.INFO, "resilient_callbacks")
    node_recovery._say_older(d, {1: 2, 2: 4}, {1, 2}, set(), [{1: 2, 2: 4}], kinds)
    said = caplog.text
    assert "not uploading step 2 (commit 1), step 4 (commit 2) again" in said, said
    assert "step(s) 2, best on the nodes' disks (keep_best), maybe by the remote retention" in said


def test_a_checkpoint_a_restore_found_corrupt_is_not_ranked_above_the_best(tmp_path):
    """A restore found the newest checkpoint (step 20, loss 1) corrupt by its checksum (same
    size) and fell back to step 10 (loss 5), saved before the run had a remote tier. The
    restart's retention pass did not count step 20, but its best decision ranked it first:
    step 10, the best of the valid ones, was not due and never uploaded (the later saves are
    worse: none of them is the best), so the run's true best was on the local disk only."""
    from resilient_callbacks.errors import ResumeFallbackWarning

    local, remote = tmp_path / "local", tmp_path / "durable"
    state = {"w": torch.zeros(4)}
    opts: dict = {"keep_last": 2, "keep_best": 1, "monitor": "loss", "async_save": False}
    with Checkpointer(local, **opts) as ck:
        for step, loss in ((10, 5.0), (20, 1.0)):
            ck.save(step, state, metrics={"loss": loss})
    f = next((local / "step_000000020").glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, wrong checksum
    opts |= {"keep_last": 1, "remote": f"file://{remote}", "remote_every_n_saves": 100}
    with pytest.warns(ResumeFallbackWarning, match="checksum"), Checkpointer(local, **opts) as ck:
        assert ck.restore(state) == 10
        for step, loss in ((30, 6.0), (40, 7.0)):
            ck.save(step, state, metrics={"loss": loss})
    assert _committed(remote) == ["step_000000010"]
    assert (local / "step_000000020").is_dir()  # (kept as corrupt, for inspection)


def test_the_best_decision_never_counts_a_checkpoint_a_restore_found_corrupt(tmp_path):
    """is_best, asked at each commit, ranks as the retention pass counts: a checkpoint a
    restore found corrupt (``Directory.found_corrupt``) is never one of the best. (At a
    commit it is on a branch the roll-back abandoned, ranked after the lineage's anyway.)"""
    from resilient_callbacks import remote_best
    from resilient_callbacks.manifest import read_manifest
    from resilient_callbacks.retention import RetentionPolicy

    with Checkpointer(tmp_path, keep_last=2, keep_best=1, monitor="loss") as ck:
        for step, loss in ((10, 5.0), (20, 1.0)):
            ck.save(step, {"w": torch.zeros(4)}, metrics={"loss": loss})
    run = read_manifest(str(tmp_path / "step_000000010")).run_id
    policy = RetentionPolicy(keep_last=1, keep_best=1, monitor="loss")
    root, ten, twenty = str(tmp_path), "step_000000010", "step_000000020"
    assert not remote_best.is_best(root, ten, policy, run)
    assert remote_best.is_best(root, ten, policy, run, corrupt={twenty})
    assert not remote_best.is_best(root, twenty, policy, run, corrupt={twenty})
