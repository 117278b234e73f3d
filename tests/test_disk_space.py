"""Disk-space preflight on a real, small filesystem (a tmpfs): a save that will not fit is
warned about before it is attempted, and a commit that leaves too little room for the next one
says so a save interval ahead."""

from __future__ import annotations

import errno
import io
import logging
import os
import subprocess

import pytest
import torch

from resilient_callbacks import Checkpointer, CheckpointWriteError

MB = 300_000  # float32 elements: 1.2 MB a checkpoint


def _state(v: float = 1.0) -> dict:
    return {"w": torch.full((MB,), float(v))}


def _warnings(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_commit_that_leaves_no_room_for_the_next_save_warns_ahead(
    small_tmpfs, caplog, async_save
):
    """keep_last=3 on a 4 MiB disk: three 1.2 MB checkpoints fit, the fourth save cannot (it
    writes before retention deletes). The step after the third commit says so (training goes
    on: there is a next save); the fourth save fails with ENOSPC, keeping the three."""
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    root = small_tmpfs / "ck"
    with Checkpointer(root, keep_last=3, async_save=async_save, every_n_steps=1000) as ck:
        for step in (1, 2):
            ck.save(step, _state(step))
            ck.flush()
        assert not _warnings(caplog, "will not fit")
        ck.save(3, _state(3))
        ck.flush()
        assert not ck.step(3, _state(3))  # (not due)
        ck._dir.trash.wait(60.0)  # (the check runs once retention's deletions are done)
        ahead = _warnings(caplog, "the next save will not fit")
        assert len(ahead) == 1, ahead
        assert str(root) in ahead[0] and "step 3" in ahead[0] and "lower keep_last" in ahead[0]
        caplog.clear()
        if async_save:
            ck.save(4, _state(4))
            with pytest.raises(CheckpointWriteError) as ei:
                ck.flush()
        else:
            with pytest.raises(CheckpointWriteError) as ei:
                ck.save(4, _state(4))
        assert ei.value.errno == errno.ENOSPC
        before = _warnings(caplog, "the save of step 4 will likely fail")
        assert len(before) == 1, [r.getMessage() for r in caplog.records]
        assert [e.step for e in ck.checkpoints()] == [1, 2, 3]
        assert not [n for n in os.listdir(root) if n.startswith(".staging")]


def test_a_disk_filled_by_something_else_is_warned_about_before_the_save(small_tmpfs, caplog):
    """Room for keep_last + 1 checkpoints at first; another file then takes the space: the
    next save is warned about before it writes, fails with ENOSPC, and once the space is back
    the save after it commits (and retention deletes the older one only then)."""
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    root = small_tmpfs / "ck"
    junk = small_tmpfs / "other-job.log"
    with Checkpointer(root, keep_last=1, async_save=False) as ck:
        ck.save(1, _state(1))
        assert not _warnings(caplog, "will not fit")
        junk.write_bytes(b"x" * 2_000_000)
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(2, _state(2))
        assert ei.value.errno == errno.ENOSPC
        said = _warnings(caplog, "the save of step 2 will likely fail")
        assert len(said) == 1 and "MB free" in said[0], [r.getMessage() for r in caplog.records]
        assert [e.step for e in ck.checkpoints()] == [1]
        junk.unlink()
        caplog.clear()
        ck.save(3, _state(3))
        assert [e.step for e in ck.checkpoints()] == [3]
    assert not _warnings(caplog, "will not fit") and not _warnings(caplog, "will likely fail")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_file_size_limit_is_named_with_what_to_do(tmp_path, async_save):
    """A real EFBIG: this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) lowered to 8 MB
    for the test (Python ignores SIGXFSZ, so the write fails instead of killing the process).
    The save fails, nothing is committed, its staging is removed, the message names the limit
    and what to do, and the next save that fits commits."""
    import resource
    import signal

    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    root = tmp_path / "ck"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with Checkpointer(root, keep_last=1, async_save=async_save) as ck:
        ck.save(1, {"w": torch.zeros(1000)})
        ck.flush()
        resource.setrlimit(resource.RLIMIT_FSIZE, (8_000_000, hard))
        try:
            with pytest.raises(CheckpointWriteError) as ei:
                ck.save(2, {"w": torch.zeros(4_000_000)})  # a 16 MB file
                ck.flush()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert ei.value.errno == errno.EFBIG, str(ei.value)
        said = str(ei.value)
        assert "ulimit -f" in said and "Nothing was committed" in said, said
        assert sorted(n for n in os.listdir(root) if n != ".lock") == [
            "history.jsonl",
            "latest",
            "step_000000001",
        ]
        ck.save(3, {"w": torch.zeros(1000)})
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000000003"]


@pytest.fixture
def read_only_view(tmp_path):
    """A function that makes a directory read-only for this process, really: a read-only bind
    mount over it as root (root ignores permission bits; writes through the mount fail with
    EROFS), chmod 0555 otherwise (EACCES). It returns the function that makes it writable."""

    def make(path):
        if os.geteuid() != 0:
            os.chmod(path, 0o555)
            return lambda: os.chmod(path, 0o755)
        r = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"root cannot bind-mount here to make a directory read-only: {r.stderr}")
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True)
        if r.returncode != 0:
            subprocess.run(["umount", str(path)], capture_output=True)
            pytest.skip(f"cannot remount read-only: {r.stderr}")
        return lambda: subprocess.run(["umount", str(path)], check=True)

    return make


@pytest.mark.parametrize("async_save", [False, True])
def test_a_directory_made_read_only_mid_run_says_so_and_saving_resumes(
    tmp_path, read_only_view, async_save
):
    """dirpath turns read-only between two saves (a filesystem remounted read-only after disk
    errors, an operator's chmod): the save fails with the errno kept, the message says the
    directory is not writable and what to do, nothing is committed or deleted, and the next
    save once it is writable again commits (retention goes on)."""
    root = tmp_path / "ck"
    with Checkpointer(root, keep_last=1, async_save=async_save) as ck:
        ck.save(1, {"w": torch.zeros(10)})
        ck.flush()
        writable = read_only_view(root)
        try:
            with pytest.raises(CheckpointWriteError) as ei:
                ck.save(2, {"w": torch.ones(10)})
                ck.flush()
        finally:
            writable()
        assert ei.value.errno in (errno.EROFS, errno.EACCES), str(ei.value)
        said = str(ei.value)
        assert "is not writable by this process now" in said and "make it writable" in said
        assert [e.step for e in ck.checkpoints()] == [1]
        ck.save(3, {"w": torch.full((10,), 3.0)})
        ck.flush()
        assert [e.step for e in ck.checkpoints()] == [3]


def test_the_first_save_of_a_restarted_process_on_a_full_disk_is_warned_about(small_tmpfs, caplog):
    """A job requeued onto a disk that filled up meanwhile: the restore works, and the first
    save (no save of this process to compare with) is warned about before it writes, by the
    size of the checkpoint it restored from; it fails with ENOSPC, keeping that checkpoint."""
    root = small_tmpfs / "ck"
    with Checkpointer(root, keep_last=1, async_save=False) as ck:
        ck.save(1, _state(1))
    (small_tmpfs / "other-job.log").write_bytes(b"x" * 2_500_000)
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(root, keep_last=1, async_save=False) as ck:
        st = _state(0)
        assert ck.restore(st) == 1 and float(st["w"][0]) == 1.0
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(2, _state(2))
        assert ei.value.errno == errno.ENOSPC
        said = _warnings(caplog, "the save of step 2 will likely fail")
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert [e.step for e in ck.checkpoints()] == [1]


def test_a_full_disk_counts_the_best_and_archive_checkpoints_it_must_hold(small_tmpfs):
    """keep_last=1 with keep_best and archives: the disk must hold more than keep_last + 1
    checkpoints, and the ENOSPC message says which (it said 'keep_last + 1 (2 here)' only,
    though the best and the archive steps stayed on the disk)."""
    root = small_tmpfs / "ck"
    opts = dict(keep_last=1, keep_best=1, monitor="val", keep_every_n_steps=10)
    with Checkpointer(root, async_save=False, **opts) as ck:
        ck.save(10, _state(1), metrics={"val": 0.9})  # an archive step
        ck.save(11, _state(2), metrics={"val": 0.1})  # the best
        with pytest.raises(CheckpointWriteError) as ei:
            for step in range(12, 16):  # the fourth 1.2 MB checkpoint does not fit
                ck.save(step, _state(step), metrics={"val": 0.9})
        said = str(ei.value)
        assert ei.value.errno == errno.ENOSPC and "(2 here)" in said, said
        assert "plus up to 1 kept as best by val" in said, said
        assert "plus every archive step (keep_every_n_steps=10)" in said, said
        assert [e.step for e in ck.checkpoints()][:2] == [10, 11]


@pytest.fixture
def few_inodes_tmpfs(tmp_path):
    """A tmpfs with 16 inodes (needs root and mount permission)."""
    mnt = tmp_path / "few-inodes"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=16", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill its inodes: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_dirpath_on_a_full_filesystem_is_said_to_be_full(few_inodes_tmpfs):
    """Opening a new dirpath on a filesystem with no inode left (mkdir fails with ENOSPC) said
    'check that the path is right and writable by this user', which it was."""
    root = few_inodes_tmpfs
    with pytest.raises(OSError) as full:
        for n in range(100):  # every inode taken
            (root / f"f{n}").touch()
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(CheckpointWriteError) as ei:
        Checkpointer(root / "ck")
    said = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and "filesystem is full" in said, said
    assert "writable by this user" not in said


def test_a_dirpath_past_the_disk_quota_is_said_to_be(tmp_path, monkeypatch):
    """Creating a new dirpath failed with EDQUOT (this user's inodes or blocks used up on a
    shared filesystem) and was said as 'check that the path is right and writable by this
    user', which it was. Now the quota is named, with how to check it."""
    real_makedirs, where = os.makedirs, str(tmp_path / "ck")

    def over_quota(path, *a, **k):  # (mkdir as on a filesystem whose quota is used up)
        if str(path) == where:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))
        return real_makedirs(path, *a, **k)

    monkeypatch.setattr(os, "makedirs", over_quota)
    with pytest.raises(CheckpointWriteError) as ei:
        Checkpointer(where)
    monkeypatch.undo()
    said = str(ei.value)
    assert ei.value.errno == errno.EDQUOT and "disk quota" in said and "`quota -s`" in said, said
    assert "writable by this user" not in said


class _OverQuota(io.FileIO):
    """A real file, created, whose writes fail as on a filesystem whose quota for this user is
    exhausted (a shared cluster filesystem: the disk has room, the user's share has not)."""

    def write(self, b) -> int:  # type: ignore[no-untyped-def]
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))


@pytest.mark.parametrize("async_save", [False, True])
def test_an_exceeded_disk_quota_is_named_with_how_to_check_it(tmp_path, monkeypatch, async_save):
    """A save failing with EDQUOT got the bare "Disk quota exceeded", with no word on what the
    quota must hold or how to see it (ENOSPC, EFBIG and EROFS each say). Now the message says
    the quota is exceeded, counts the checkpoints it must hold as the full-disk message does,
    and names `quota -s`; nothing is committed, and the next save that fits commits."""
    from resilient_callbacks import tensorfile

    def over_quota(path, mode="r", *a, **k):  # the checkpoint's files, in its staging folder
        if "w" in mode and ".staging-" in str(path):
            return _OverQuota(path, "w")
        return open(path, mode, *a, **k)

    root = tmp_path / "ck"
    opts = dict(keep_last=2, keep_best=1, monitor="val", async_save=async_save)
    with Checkpointer(root, **opts) as ck:
        ck.save(1, {"w": torch.zeros(1000)}, metrics={"val": 1.0})
        ck.flush()
        monkeypatch.setattr(tensorfile, "open", over_quota, raising=False)
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(2, {"w": torch.ones(1000)}, metrics={"val": 0.5})
            ck.flush()
        monkeypatch.undo()
        said = str(ei.value)
        assert ei.value.errno == errno.EDQUOT, said
        assert "disk quota (of this user, its group or project)" in said, said
        assert "`quota -s`" in said and "The disk is full" not in said, said
        assert "keep_last + 1 checkpoints (3 here), plus up to 1 kept as best by val" in said
        assert [e.step for e in ck.checkpoints()] == [1]
        assert not [n for n in os.listdir(root) if n.startswith(".staging")]
        ck.save(3, {"w": torch.full((1000,), 3.0)}, metrics={"val": 0.1})
        ck.flush()
        assert [e.step for e in ck.checkpoints()] == [1, 3]


@pytest.mark.parametrize("end", ["final save", "committed during close", "emergency save"])
def test_the_runs_last_save_gives_no_warning_about_a_next_save(small_tmpfs, caplog, end):
    """keep_last=3 on a 4 MiB disk: the third commit leaves no room for a fourth checkpoint.
    When that third save is the run's last (``final=True``, or a background save that
    commits while ``close()`` waits for it) there is no next save, yet "the next save will
    not fit" was warned at the end of every such run. Now it is not. An emergency save (a
    preemption's, before the process exits) is the last too: the check, on the trash bin's
    thread, could run before close() began, and warned."""
    import threading

    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    root = small_tmpfs / "ck"
    ck = Checkpointer(root, keep_last=3, async_save=end != "final save")
    try:
        for step in (1, 2):
            ck.save(step, _state(step))
            ck.flush()
        if end == "final save":
            ck.save(3, _state(3), final=True)
        elif end == "emergency save":
            ck.emergency_save(3, _state(3))
            ck._dir.trash.wait(60.0)  # (the check, were there one, runs before close() begins)
        else:
            closing, real_commit = threading.Event(), ck._dir.commit.commit

            def after_close_began(staging, step, manifest, **kw):  # type: ignore[no-untyped-def]
                assert closing.wait(60)  # (then close() is under way: it set closed first)
                return real_commit(staging, step, manifest, **kw)

            ck._dir.commit.commit = after_close_began
            ck.save(3, _state(3))
            real_persist_wait = ck._saver.persister.wait_all

            def wait_all(*a, **k):  # type: ignore[no-untyped-def]
                closing.set()  # close() waits for the save: let it commit
                return real_persist_wait(*a, **k)

            ck._saver.persister.wait_all = wait_all
    finally:
        ck.close()
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == [
        f"step_{s:09d}" for s in (1, 2, 3)
    ]
    assert not _warnings(caplog, "the next save will not fit"), caplog.text


@pytest.mark.parametrize("then", ["trains on", "closes", "saves again"])
@pytest.mark.parametrize("save", ["emergency_save()", "save()", "step()"])
def test_a_save_warns_of_the_next_only_when_training_goes_on(
    tmp_path, caplog, monkeypatch, save, then
):
    """A plain loop that calls ``emergency_save()`` (it detected a failure itself), ``save()``
    or a ``step()`` that saves, and then trains on has a next save: a disk too small for it is
    said at the next step, a save interval ahead. ``emergency_save()`` gave no warning at all
    (taken for the run's last save, as a preemption's is). One followed by ``close()`` is the
    run's last: no warning (a ``save()`` or a periodic save warned "the next save will not
    fit" at the end of such runs: the check, on the trash bin's thread, ran before close()).
    A loop that only calls ``save()`` is warned before its next save writes. The free-space
    probe reports 1 kB free (less than a checkpoint)."""
    from resilient_callbacks import space

    monkeypatch.setattr(space, "free_bytes", lambda path: 1_000)
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    every = 2 if save == "step()" else 1000  # (step 2 due, step 3 not)
    ck = Checkpointer(tmp_path / "ck", every_n_steps=every, async_save=False, preemption=False)
    try:
        assert not ck.step(1, _state(1))  # (not due: no save)
        if save == "save()":
            assert ck.save(2, _state(2))
        elif save == "emergency_save()":
            assert ck.emergency_save(2, _state(2))
        else:
            assert ck.step(2, _state(2))
        if then == "trains on":
            assert not ck.step(3, _state(3))
        elif then == "saves again":
            assert ck.save(3, _state(3))
        ck._dir.trash.wait(60.0)  # (the check, were there one, runs before close() begins)
        ahead = _warnings(caplog, "the next save will not fit")
        assert len(ahead) == (then == "trains on"), caplog.text
        assert all("step 2" in a for a in ahead)
        before = _warnings(caplog, "the save of step 3 will likely fail")
        assert len(before) == (then == "saves again"), caplog.text
    finally:
        ck.close()
    assert len(_warnings(caplog, "the next save will not fit")) == (then == "trains on")


def test_a_save_after_an_emergency_save_checks_once(tmp_path, caplog, monkeypatch):
    """``emergency_save()``, then ``save()``, then training: the second save's commit checks
    the next save fits; the step after it does not say so a second time."""
    from resilient_callbacks import space

    monkeypatch.setattr(space, "free_bytes", lambda path: 1_000)
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(tmp_path / "ck", every_n_steps=1000, async_save=False) as ck:
        assert ck.emergency_save(1, _state(1))
        assert ck.save(2, _state(2))
        assert not ck.step(3, _state(3))
        ck._dir.trash.wait(60.0)
        ahead = _warnings(caplog, "the next save will not fit")
        assert len(ahead) == 1 and "step 2" in ahead[0], caplog.text
