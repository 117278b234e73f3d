"""What the retention pass after each commit costs, and that what it keeps between commits never
answers for a directory that changed. The pass checked the files of every kept checkpoint at
every commit (each listed file's size, each ``shared.json`` parsed): a run keeping hundreds of
archive points paid for all of them at every save. It now checks those its decision depends
on (:func:`resilient_callbacks.retention.plan_checking`) and deletes the same."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from resilient_callbacks import Checkpointer, catalog, known
from resilient_callbacks.known import KnownCheckpoints
from resilient_callbacks.retention import RetentionPolicy, plan, plan_checking
from resilient_callbacks.session import CommitSession
from test_retention import scenarios

STATE = {"w": torch.zeros(4)}


def _steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in root.glob("step_*/manifest.json"))


@st.composite
def _read(draw):  # type: ignore[no-untyped-def]
    """A scenario of test_retention's, some candidates recording a roll-back (``lineage``: a
    parent and a range of commits abandoned; the newest of a run that records one decides what
    is abandoned, whatever its files), some sharing a commit number (two runs in one
    directory), and those of the corrupt ones said corrupt upfront (a restore read them)."""
    cands, policy, run_id, protected = draw(scenarios())
    out = []
    for c in cands:
        if draw(st.booleans()):
            lo = draw(st.integers(0, 21))
            hi = draw(st.integers(lo, 21))
            parent = draw(st.one_of(st.none(), st.integers(0, 20)))
            c = dataclasses.replace(c, lineage={"parent": parent, "abandoned": [[lo, hi]]})
        if draw(st.integers(0, 5)) == 0:
            c = dataclasses.replace(c, seq=draw(st.integers(1, 20)))
        out.append(c)
    corrupt = [c.name for c in out if not c.valid]
    said = draw(st.sets(st.sampled_from(corrupt))) if corrupt else set()
    return out, policy, run_id, protected, said


@given(_read())
def test_checking_only_what_decides_deletes_what_checking_everything_deletes(sc):
    """Candidates read from their manifests (all valid but those known corrupt), whose files'
    check (``valid``) finds some corrupt: the plan deletes what :func:`plan` of the checked
    candidates deletes, and never asks twice."""
    cands, policy, run_id, protected, said = sc
    truth = {c.name: c.valid for c in cands}
    read = [c if c.name in said else dataclasses.replace(c, valid=True) for c in cands]
    asked: list[str] = []

    def valid(c):  # type: ignore[no-untyped-def]
        asked.append(c.name)
        return truth[c.name]

    got = plan_checking(read, policy, run_id, protected, valid)
    want = plan(cands, policy, run_id, protected)
    assert got.delete == want.delete
    assert set(got.keep) == set(want.keep)
    assert len(asked) == len(set(asked)) and not set(asked) & said, asked


def test_a_commit_checks_the_files_of_a_few_checkpoints_not_of_every_one_kept(
    tmp_path, monkeypatch
):
    """keep_last=2 with an archive point every 2 steps: at saves 21 to 30 (10 to 15 kept) each
    pass checks the files of the two newest and of the one it deletes, not of every archive
    (it checked all of them: 10 to 15 a commit)."""
    checked: list[str] = []
    verify = catalog.verify

    def counted(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        checked.append(os.path.basename(path))
        return verify(path, *args, **kwargs)

    monkeypatch.setattr(catalog, "verify", counted)
    opts = {"keep_last": 2, "keep_every_n_steps": 2, "capture_rng": False}
    with Checkpointer(str(tmp_path), async_save=False, preemption=False, **opts) as ck:
        for step in range(1, 21):
            ck.save(step, STATE)
        checked.clear()
        for step in range(21, 31):
            ck.save(step, STATE)
    assert len(checked) <= 10 * 3, checked
    assert _steps(tmp_path) == [*range(2, 30, 2), 29, 30]


def test_commit_sessions_of_one_directory_read_the_manifest_of_each_new_checkpoint_once(
    tmp_path, monkeypatch
):
    """CommitSessions used without a Checkpointer, one per save (a script's, a DeepSpeed
    engine's): each session's retention pass read every kept manifest (20 kept, 5 saves: 52
    reads). The passes now share what they read, by directory: 21 at the first, 1 a save after
    it; and delete what they deleted (keep_last=2 over archive points every 4 steps)."""
    reads: list[str] = []
    entry = known._entry

    def counted(name, path):  # type: ignore[no-untyped-def]
        reads.append(name)
        return entry(name, path)

    root = tmp_path / "ck"
    for step in range(1, 21):
        session = CommitSession(root, step, run_id="r" * 16, seq=step)
        session.begin()
        session.commit()
    monkeypatch.setattr(known, "_entry", counted)
    policy = RetentionPolicy(keep_last=2, keep_every_n_steps=4)
    for step in range(21, 26):
        session = CommitSession(root, step, run_id="r" * 16, seq=step, retention=policy)
        session.begin()
        session.commit()
        assert session.after_error is None
    assert len(reads) <= 21 + 4, reads
    assert _steps(root) == [4, 8, 12, 16, 20, 24, 25]


def test_a_checkpoint_corrupted_between_commits_is_seen_at_the_next(tmp_path):
    """keep_last=2: step 3, one of the two newest, loses a byte of its tensors between two
    commits. At the next pass it does not count (kept, as corrupt), so step 2 stays as one of
    the two newest valid instead of being deleted."""
    with Checkpointer(str(tmp_path), keep_last=2, async_save=False, preemption=False) as ck:
        for step in (1, 2, 3):
            ck.save(step, STATE)
        assert _steps(tmp_path) == [2, 3]
        tensors = tmp_path / "step_000000003" / "rank_00000.safetensors"
        tensors.write_bytes(tensors.read_bytes()[:-1])
        ck.save(4, STATE)
        assert _steps(tmp_path) == [2, 3, 4]
        ck.save(5, STATE)  # (step 3 stays: corrupt ones are left for inspection)
        assert _steps(tmp_path) == [3, 4, 5]


def test_a_checkpoint_deleted_or_replaced_between_commits_is_seen_at_the_next(tmp_path):
    """keep_last=1 and the best by loss: step 1 (loss 0.5) is the best. Replaced under its
    name by a copy of step 3 (loss 3.0: a hand, a pull), it no longer is: the next pass keeps
    step 4 (loss 1.0) as the best and the newest, and deletes the copy; step 4 deleted by hand
    before the next save is not counted either."""
    opts = {"keep_last": 1, "keep_best": 1, "monitor": "loss", "capture_rng": False}
    with Checkpointer(str(tmp_path), async_save=False, preemption=False, **opts) as ck:
        for step, loss in ((1, 0.5), (2, 2.0), (3, 3.0)):
            ck.save(step, STATE, metrics={"loss": loss})
        assert _steps(tmp_path) == [1, 3]
        shutil.copytree(tmp_path / "step_000000003", tmp_path / "copy")
        shutil.rmtree(tmp_path / "step_000000001")
        os.rename(tmp_path / "copy", tmp_path / "step_000000001")
        ck.save(4, STATE, metrics={"loss": 1.0})
        assert _steps(tmp_path) == [4]
        ck.save(5, STATE, metrics={"loss": 5.0})
        assert _steps(tmp_path) == [4, 5]
        shutil.rmtree(tmp_path / "step_000000004")
        ck.save(6, STATE, metrics={"loss": 6.0})
        assert _steps(tmp_path) == [5, 6]  # (the best of those left: step 5)


def _two_saved_and_listed(root: Path) -> tuple[KnownCheckpoints, dict[str, Any]]:
    """Steps 1 and 2 saved (loss 1.0, 2.0) into ``root``, listed once by a new
    :class:`KnownCheckpoints` (both manifests read): it, and its candidates by name."""
    with Checkpointer(str(root), keep_last=None, async_save=False, preemption=False) as ck:
        for step in (1, 2):
            ck.save(step, STATE, metrics={"loss": float(step)})
    cache = KnownCheckpoints()
    first = {c.name: c for _, c in cache.entries(str(root))}
    assert cache.looked == 2
    return cache, first


def test_a_manifest_no_longer_the_file_read_is_never_counted_and_is_read_again(tmp_path):
    """A manifest rewritten in place (by hand: another loss), its folder's inode unchanged: what
    was read at the commit before is not taken for it. The next listing sees its file changed
    (one ``stat`` a folder) and reads it again: the loss now written, valid."""
    known, first = _two_saved_and_listed(tmp_path)
    assert first["step_000000001"].metrics == {"loss": 1.0}
    path = tmp_path / "step_000000001" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc["metrics"] = {"loss": 0.25}
    del doc["manifest_xxh3_64"]  # (its own checksum: would call the edit damage)
    path.write_text(json.dumps(doc, indent=1))
    again = {c.name: c for _, c in known.entries(str(tmp_path))}
    assert known.looked == 3 and again["step_000000001"].metrics == {"loss": 0.25}
    assert known.valid(again["step_000000001"]) and known.valid(again["step_000000002"])
    assert {c.name: c for _, c in known.entries(str(tmp_path))} == again
    assert known.looked == 3  # (nothing changed since: nothing read)


def test_a_folder_made_again_with_a_deleted_ones_name_and_inode_is_read_at_the_listing(
    tmp_path, monkeypatch
):
    """Step 2's folder deleted and another checkpoint put in its place (another thread's
    save renamed in, a copy), with its inode (ext4 gives a freed one to the next folder made),
    and nobody calls :meth:`~.KnownCheckpoints.forget`: the next listing reads its manifest, not
    the deleted one's (the manifest file's identity differs, whatever the folder's inode)."""
    monkeypatch.setattr(known, "os", _SameInodes())
    cache, first = _two_saved_and_listed(tmp_path)
    assert first["step_000000002"].metrics == {"loss": 2.0}
    shutil.rmtree(tmp_path / "step_000000002")
    shutil.copytree(tmp_path / "step_000000001", tmp_path / "step_000000002")
    again = {c.name: c for _, c in cache.entries(str(tmp_path))}
    assert cache.looked == 3 and again["step_000000002"].metrics == {"loss": 1.0}


class _SameInodes:
    """:mod:`os` as :mod:`resilient_callbacks.known` sees it on a filesystem that gives a folder
    made again under the name of one just deleted the deleted one's inode (ext4 often does):
    each folder's inode in a listing is its name's."""

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(os, name)

    @contextlib.contextmanager
    def scandir(self, path):  # type: ignore[no-untyped-def]
        class Entry:
            def __init__(self, d):  # type: ignore[no-untyped-def]
                self.d = d

            def __getattr__(self, name):  # type: ignore[no-untyped-def]
                return getattr(self.d, name)

            def inode(self):  # type: ignore[no-untyped-def]
                return zlib.crc32(self.d.name.encode())

        with os.scandir(path) as listing:
            yield [Entry(d) for d in listing]


def test_a_commit_under_the_name_and_inode_of_a_checkpoint_just_deleted_is_read(
    tmp_path, monkeypatch
):
    """keep_last=1, keep_best=1 by loss; a roll-back to step 1 (the best) while 3 exists. The
    pass after the new branch's step 2 deletes the abandoned step 3, and the next save, step 3
    again, is committed under its name, in a folder with its inode. That save's manifest is
    read, not the one of the folder deleted (an abandoned commit, older than step 2): it is
    the newest, and the pass deletes step 2, as a scan of every manifest does (it kept it)."""
    monkeypatch.setattr(known, "os", _SameInodes())
    opts = {"keep_last": 1, "keep_best": 1, "monitor": "loss", "capture_rng": False}
    run = {"async_save": False, "preemption": False, **opts}
    with Checkpointer(str(tmp_path), **run) as ck:
        for step, loss in ((1, 0.1), (2, 5.0), (3, 6.0)):
            ck.save(step, STATE, metrics={"loss": loss})
    assert _steps(tmp_path) == [1, 3]
    state = {"w": torch.zeros(4)}
    with Checkpointer(str(tmp_path), resume=1, **run) as ck:
        assert ck.restore(state) == 1
        ck.save(2, state, metrics={"loss": 5.0})
        assert _steps(tmp_path) == [1, 2]  # (the abandoned step 3 deleted)
        ck.save(3, state, metrics={"loss": 6.0})
        assert _steps(tmp_path) == [1, 3]
