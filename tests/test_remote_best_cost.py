"""What the decision "is this save one of the run's best" (``keep_best`` with
``remote_every_n_saves``: :mod:`resilient_callbacks.remote_best`) costs at each commit, and that
what it keeps between commits never answers for a directory that changed. The coordinator
checked every file of every kept checkpoint at each commit (node-local: every rank waits for its
answer): a run keeping hundreds of archive points paid for all of them at every save."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from resilient_callbacks import Checkpointer, catalog, known, remote_best
from resilient_callbacks.manifest import read_manifest
from resilient_callbacks.retention import RetentionPolicy
from test_retention_cost import _SameInodes


def _committed(remote: Path) -> list[str]:
    return sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))


def _opts(tmp_path: Path) -> dict[str, object]:
    """Every checkpoint kept; only the best (keep_best=1 by loss) is uploaded."""
    return {
        "keep_last": None, "keep_best": 1, "monitor": "loss", "async_save": False,
        "preemption": False, "capture_rng": False, "remote": f"file://{tmp_path / 'durable'}",
        "remote_every_n_saves": 10**6,
    }  # fmt: skip


def test_a_commit_checks_the_files_of_a_few_checkpoints_not_of_every_one_kept(
    tmp_path, monkeypatch
):
    """30 checkpoints kept, each save worse than the first: the decision at each of saves 21
    to 30 looks at the manifest of the one just committed and checks the files of those ranked
    above it until keep_best are intact (here the first), not of all 20-30 (it did before)."""
    looked: list[str] = []
    check = catalog.check

    def counted(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        looked.append(name)
        return check(name, *args, **kwargs)

    monkeypatch.setattr(catalog, "check", counted)
    state = {"w": torch.zeros(4)}
    with Checkpointer(str(tmp_path / "ck"), **_opts(tmp_path)) as ck:
        for step in range(1, 21):
            ck.save(step, state, metrics={"loss": float(step)})
        looked.clear()
        for step in range(21, 31):
            ck.save(step, state, metrics={"loss": float(step)})
    assert len(looked) <= 10 * 3, looked  # (the new one, the best, the new one's own sizes)
    assert _committed(tmp_path / "durable") == ["step_000000001"]


def test_a_best_checkpoint_deleted_since_the_last_commit_is_not_ranked(tmp_path):
    """The best, step 1, deleted from the directory between two commits (by hand; gc when no
    writer holds it): step 4, better than the rest, is the best now and uploaded. Nothing kept
    from the commits before answers for the checkpoint gone."""
    local, state = tmp_path / "ck", {"w": torch.zeros(4)}
    with Checkpointer(str(local), **_opts(tmp_path)) as ck:
        for step, loss in ((1, 0.5), (2, 2.0), (3, 3.0)):
            ck.save(step, state, metrics={"loss": loss})
        shutil.rmtree(local / "step_000000001")
        ck.save(4, state, metrics={"loss": 1.0})
        ck.save(5, state, metrics={"loss": 5.0})
    assert _committed(tmp_path / "durable") == ["step_000000001", "step_000000004"]


def _three(root: Path) -> None:
    """Steps 1, 2, 3 of one run, losses 2.0, 3.0, 0.25 (the best: step 3)."""
    with Checkpointer(str(root), keep_last=None, async_save=False, preemption=False) as ck:
        for step, loss in ((1, 2.0), (2, 3.0), (3, 0.25)):
            ck.save(step, {"w": torch.zeros(4)}, metrics={"loss": loss})


def _is_best(root: Path, name: str, ranked: known.KnownCheckpoints) -> bool:
    run_id = read_manifest(str(root / name)).run_id
    policy = RetentionPolicy(keep_last=1, keep_best=1, monitor="loss")
    return remote_best.is_best(str(root), name, policy, run_id, ranked)


def test_what_the_ranking_keeps_between_commits_never_answers_for_a_changed_directory(tmp_path):
    """The writer's ranking keeps the checkpoints it read between commits. The best, step 3,
    then replaced by another folder under its name (a copy of step 2, loss 3.0: a hand, a
    pull), then deleted (gc, a hand): step 1 is the best each time, as a fresh reading says;
    a file of step 3 of another size (corrupt) makes step 1 the best too."""
    root = tmp_path / "ck"
    _three(root)
    ranked = known.KnownCheckpoints()
    assert not _is_best(root, "step_000000001", ranked)
    assert ranked.looked == 3
    assert not _is_best(root, "step_000000001", ranked)
    assert ranked.looked == 3  # (nothing new: no manifest read again)
    shutil.copytree(root / "step_000000002", tmp_path / "copy")
    shutil.rmtree(root / "step_000000003")
    os.rename(tmp_path / "copy", root / "step_000000003")
    assert _is_best(root, "step_000000001", ranked)
    assert ranked.looked == 4
    shutil.rmtree(root / "step_000000003")
    assert _is_best(root, "step_000000001", ranked)
    assert not _is_best(root, "step_000000002", ranked)

    again = tmp_path / "again"
    _three(again)
    ranked = known.KnownCheckpoints()
    assert not _is_best(again, "step_000000001", ranked)
    tensors = again / "step_000000003" / "rank_00000.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-1])
    assert _is_best(again, "step_000000001", ranked)


def test_a_corrupt_checkpoint_is_never_one_of_the_best(tmp_path):
    """The best, step 1, has a file of another size (a retention pass finds it corrupt): the
    ranking passes over it, so step 2, the best of the rest, is uploaded; step 3 is not."""
    local, state = tmp_path / "ck", {"w": torch.zeros(4)}
    with Checkpointer(str(local), **_opts(tmp_path)) as ck:
        ck.save(1, state, metrics={"loss": 0.5})
        tensors = local / "step_000000001" / "rank_00000.safetensors"
        tensors.write_bytes(tensors.read_bytes()[:-1])
        for step, loss in ((2, 1.0), (3, 2.0)):
            ck.save(step, state, metrics={"loss": loss})
    uploaded = _committed(tmp_path / "durable")  # (step 1's upload may have met the damage)
    assert "step_000000002" in uploaded and "step_000000003" not in uploaded, uploaded


def test_a_commit_under_the_name_and_inode_of_a_checkpoint_just_deleted_is_ranked_by_its_own(
    tmp_path, monkeypatch
):
    """keep_last=1, keep_best=1 by loss, and a roll-back to step 1: the pass after the branch's
    step 2 deletes the abandoned step 3, and the next save, step 3 again (loss 0.05: the best),
    is committed under its name in a folder with its inode (ext4 reuses a freed inode at once).
    Its own manifest is ranked, not the deleted folder's (loss 6.0): it is uploaded."""
    monkeypatch.setattr(known, "os", _SameInodes())
    local, state = tmp_path / "ck", {"w": torch.zeros(4)}
    opts = {**_opts(tmp_path), "keep_last": 1}
    with Checkpointer(str(local), **opts) as ck:
        for step, loss in ((1, 0.1), (2, 5.0), (3, 6.0)):
            ck.save(step, state, metrics={"loss": loss})
    with Checkpointer(str(local), resume=1, **opts) as ck:
        assert ck.restore(state) == 1
        for step, loss in ((2, 5.0), (3, 0.05), (4, 7.0)):
            ck.save(step, state, metrics={"loss": loss})
    durable = tmp_path / "durable"
    losses = [read_manifest(str(durable / n)).metrics["loss"] for n in _committed(durable)]
    assert 0.05 in losses, losses
