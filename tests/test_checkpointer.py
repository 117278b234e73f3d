"""The Checkpointer as a user observes it: manifests, integrity checks and fallback, explicit
resume, unsafe manifests, the directory lock, staging sweep, retention, triggers."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import warnings

import pytest
import safetensors.torch
import torch
import xxhash

import resilient_callbacks
import spawn_ranks
from resilient_callbacks import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    ForeignCheckpointsWarning,
    NoValidCheckpointError,
    ResumeFallbackWarning,
    UnsafeManifestError,
)
from resilient_callbacks import policy as rc_policy
from resilient_callbacks.manifest import SELF_CHECKSUM, check_relative, self_checksum


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v)), "extra": {"tag": v}}


def _fresh() -> dict:
    return {"w": torch.zeros(64), "extra": {"tag": None}}


def _step_dir(root, step: int, n: int = 0) -> str:
    return os.path.join(str(root), f"step_{step:09d}" + (f"-{n}" if n else ""))


def _steps_present(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def _make_run(root, steps=(10, 20, 30), **kw) -> None:
    with Checkpointer(root, **kw) as ck:
        for s in steps:
            assert ck.save(s, _state(s), metrics={"loss": 1.0 / s}) is True


def _manifest(path) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def _write_manifest(path, m) -> None:
    """Write manifest ``m`` sealed again (its own checksum recomputed): a tampering that knows
    the format, for the checks behind that one."""
    m[SELF_CHECKSUM] = self_checksum(m)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)


# --------------------------------------------------------------------------- manifest


def test_manifest_lists_every_file_with_size_and_xxh3(tmp_path):
    root = tmp_path / "ck"
    before = time.time()
    with Checkpointer(root) as ck:
        ck.save(7, _state(7), metrics={"loss": 0.5, "acc": torch.tensor(0.25), "bad": float("nan")})
        ck.flush()
        path = ck.last_save.path
    assert path == _step_dir(root, 7)
    m = _manifest(path)
    assert m["step"] == 7
    assert m["world_size"] == 1
    assert m["metrics"]["loss"] == 0.5 and m["metrics"]["acc"] == 0.25
    assert m["metrics"]["bad"] is None  # non-finite metrics are stored as null, JSON stays valid
    assert before - 1 <= m["created"] <= time.time() + 1
    assert m["versions"]["resilient_callbacks"] == resilient_callbacks.__version__
    assert m["versions"]["torch"] == torch.__version__
    assert isinstance(m["run_id"], str) and m["run_id"]
    listed = {f["path"]: f for f in m["files"]}
    on_disk = set(os.listdir(path)) - {"manifest.json"}
    assert set(listed) == on_disk
    assert "shared.safetensors" in listed and "shared.json" in listed
    for name, f in listed.items():
        with open(os.path.join(path, name), "rb") as fh:
            data = fh.read()
        assert f["size"] == len(data), name
        assert f["xxh3_64"] == xxhash.xxh3_64_hexdigest(data), name


def test_latest_path_and_checkpoints_listing(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    with Checkpointer(root) as ck:
        assert [e.step for e in ck.checkpoints()] == [10, 20, 30]
        assert ck.latest_path == _step_dir(root, 30)


# --------------------------------------------------------------------------- restore basics


def test_restore_empty_dir_returns_zero(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        st = _fresh()
        assert ck.restore(st) == 0
        assert torch.equal(st["w"], torch.zeros(64))


def test_restore_picks_newest(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    st = _fresh()
    with Checkpointer(root) as ck:
        assert ck.restore(st) == 30
        assert ck.restored_from == _step_dir(root, 30)
    assert torch.equal(st["w"], torch.full((64,), 30.0)) and st["extra"]["tag"] == 30


def test_resume_never_starts_fresh(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    st = _fresh()
    with Checkpointer(root, resume="never") as ck:
        assert ck.restore(st) == 0
    assert st["extra"]["tag"] is None


def test_resume_explicit_step_and_path(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    st = _fresh()
    with Checkpointer(root, resume=20) as ck:
        assert ck.restore(st) == 20
    assert st["extra"]["tag"] == 20
    st = _fresh()
    with Checkpointer(tmp_path / "other", resume=_step_dir(root, 10)) as ck:
        assert ck.restore(st) == 10
    assert st["extra"]["tag"] == 10


def test_resume_path_spelled_through_a_link_continues_the_run(tmp_path):
    """dirpath through a symlink, resume= naming a checkpoint by its real path: the run was
    taken for another one (new run id, a ForeignCheckpointsWarning, no restart recorded)."""
    root = tmp_path / "ck"
    _make_run(root)
    link = tmp_path / "link"
    link.symlink_to(root)
    run_id = _manifest(_step_dir(root, 30))["run_id"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpointer(link, resume=_step_dir(root, 20)) as ck:
            assert ck.restore(_fresh()) == 20
            ck.save(40, _state(40))
    assert _manifest(_step_dir(root, 40))["run_id"] == run_id


@pytest.mark.parametrize("spelling", ["link", "link/", "under_link", "file_url", "tilde"])
def test_a_dirpath_spelled_as_users_write_it_saves_and_retains_in_its_target(
    tmp_path, monkeypatch, spelling
):
    """A symlink (or a folder under one), a trailing slash, a file:// URL, ~: the checkpoints
    land in the real folder, retention deletes there, and every link stays a link."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("HOME", str(tmp_path / "link"))
    dirpath, where = {
        "link": (str(tmp_path / "link"), real),
        "link/": (f"{tmp_path / 'link'}/", real),
        "under_link": (str(tmp_path / "link" / "run"), real / "run"),
        "file_url": (f"file://{tmp_path / 'link'}/run", real / "run"),
        "tilde": ("~/run", real / "run"),
    }[spelling]
    for first in (1, 4):  # the second run resumes the first
        with Checkpointer(dirpath, keep_last=2, async_save=False) as ck:
            assert ck.restore(_fresh()) == (0 if first == 1 else 3)
            for step in range(first, first + 3):
                ck.save(step, _state(step))
    assert _steps_present(where) == ["step_000000005", "step_000000006"]
    assert (tmp_path / "link").is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


# --------------------------------------------------------------------------- integrity


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 3)


@pytest.mark.parametrize(
    "damage, fname, why",
    [
        (_flip_last_byte, "shared.safetensors", "checksum"),
        (_flip_last_byte, "shared.json", "checksum"),
        (_flip_last_byte, "rank_00000.safetensors", "checksum"),
        (_truncate, "shared.safetensors", "size"),
        (os.remove, "shared.safetensors", "missing"),
        (os.remove, "shared.json", "missing"),
    ],
    ids=[
        "flip-tensors",
        "flip-structure",
        "flip-rank",
        "truncate",
        "delete-tensors",
        "delete-structure",
    ],
)
def test_damaged_newest_falls_back_with_warning(tmp_path, damage, fname, why):
    root = tmp_path / "ck"
    _make_run(root)
    damage(os.path.join(_step_dir(root, 30), fname))
    st = _fresh()
    with Checkpointer(root) as ck, pytest.warns(ResumeFallbackWarning) as rec:
        assert ck.restore(st) == 20
    assert st["extra"]["tag"] == 20 and torch.equal(st["w"], torch.full((64,), 20.0))
    msgs = [str(w.message) for w in rec if issubclass(w.category, ResumeFallbackWarning)]
    assert len(msgs) == 1
    assert "step_000000030" in msgs[0] and fname in msgs[0] and why in msgs[0]
    # the damaged checkpoint is left in place for inspection
    assert os.path.isdir(_step_dir(root, 30))


def test_two_damaged_fall_back_two_levels(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    _flip_last_byte(os.path.join(_step_dir(root, 30), "shared.safetensors"))
    _truncate(os.path.join(_step_dir(root, 20), "shared.safetensors"))
    st = _fresh()
    with Checkpointer(root) as ck, pytest.warns(ResumeFallbackWarning) as rec:
        assert ck.restore(st) == 10
    text = " | ".join(str(w.message) for w in rec)
    assert "step_000000030" in text and "step_000000020" in text


def test_all_corrupt_raises_no_valid_checkpoint(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    _flip_last_byte(os.path.join(_step_dir(root, 30), "shared.safetensors"))
    _truncate(os.path.join(_step_dir(root, 20), "shared.safetensors"))
    os.remove(os.path.join(_step_dir(root, 10), "shared.json"))
    st = _fresh()
    with (
        Checkpointer(root) as ck,
        pytest.warns(ResumeFallbackWarning),
        pytest.raises(NoValidCheckpointError) as ei,
    ):
        ck.restore(st)
    msg = str(ei.value)
    for s in (10, 20, 30):
        assert f"step_{s:09d}" in msg
    assert "resume='never'" in msg  # says how to proceed
    assert st["extra"]["tag"] is None, "state was modified although nothing was restored"


def _tear(m):
    return '{"format": "resilient_callbacks.checkp'


def _newer_format(m):
    return json.dumps({**m, "format_version": 99})


def _not_an_object(m):
    return "[]"


def _unsafe(m):
    m["files"][0]["path"] = "../escape"
    return json.dumps(m)


@pytest.mark.parametrize(
    "edit",
    [_tear, _newer_format, _not_an_object, _unsafe],
    ids=["torn-json", "newer-format-version", "not-an-object", "unsafe-path"],
)
def test_unreadable_manifest_is_never_a_silent_fresh_start(tmp_path, edit):
    """The only checkpoint's manifest.json cannot be used (torn write, bit rot, written by a
    newer version, tampered): restore() must not return 0 as if the directory were empty."""
    root = tmp_path / "ck"
    _make_run(root, steps=(10,))
    path = _step_dir(root, 10)
    text = edit(_manifest(path))
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write(text)
    st = _fresh()
    with Checkpointer(root) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumeFallbackWarning)
        try:
            got = ck.restore(st)
        except CheckpointError as e:
            assert "step_000000010" in str(e)
            return
    pytest.fail(f"restore() returned {got} (a silent fresh start) although {path} exists")


def test_unreadable_manifest_of_newest_falls_back_with_warning(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    with open(os.path.join(_step_dir(root, 30), "manifest.json"), "w") as f:
        f.write("not json")
    st = _fresh()
    with Checkpointer(root) as ck, pytest.warns(ResumeFallbackWarning, match="step_000000030"):
        assert ck.restore(st) == 20


def test_torn_directory_without_manifest_is_ignored(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    torn = _step_dir(root, 40)
    os.makedirs(torn)
    safetensors.torch.save_file(
        {"w": torch.full((64,), 40.0)}, os.path.join(torn, "shared.safetensors")
    )
    with open(os.path.join(str(root), "latest"), "w") as f:
        f.write("step_000000040\n")  # the advisory pointer is never trusted
    st = _fresh()
    with Checkpointer(root) as ck:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResumeFallbackWarning)
            assert ck.restore(st) == 30
        assert [e.step for e in ck.checkpoints()] == [10, 20, 30]


def test_explicit_corrupt_step_raises(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    _flip_last_byte(os.path.join(_step_dir(root, 20), "shared.safetensors"))
    with (
        Checkpointer(root, resume=20) as ck,
        pytest.raises(CheckpointCorruptError, match="step_000000020"),
    ):
        ck.restore(_fresh())
    _truncate(os.path.join(_step_dir(root, 10), "shared.safetensors"))
    with (
        Checkpointer(root, resume=10) as ck,
        pytest.raises(CheckpointCorruptError, match="step_000000010"),
    ):
        ck.restore(_fresh())
    with (
        Checkpointer(root, resume=_step_dir(root, 20)) as ck,
        pytest.raises(CheckpointCorruptError),
    ):
        ck.restore(_fresh())


def test_explicit_missing_path_raises_not_found(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    missing = str(tmp_path / "nope" / "step_000000099")
    with Checkpointer(root, resume=missing) as ck, pytest.raises(CheckpointNotFoundError) as ei:
        ck.restore(_fresh())
    assert isinstance(ei.value, FileNotFoundError)
    with Checkpointer(root, resume=missing) as ck, pytest.raises(FileNotFoundError):
        ck.restore(_fresh())
    # a directory that exists but is not a committed checkpoint
    with Checkpointer(root, resume=str(tmp_path)) as ck, pytest.raises(CheckpointNotFoundError):
        ck.restore(_fresh())
    # a step number as a string (from a command line) is a path: the error says so
    with (
        Checkpointer(root, resume="20") as ck,
        pytest.raises(CheckpointNotFoundError, match=r"a step number is an int: resume=20"),
    ):
        ck.restore(_fresh())


def test_explicit_step_not_present_lists_steps(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    with Checkpointer(root, resume=25) as ck, pytest.raises(CheckpointNotFoundError) as ei:
        ck.restore(_fresh())
    msg = str(ei.value)
    assert "25" in msg and "10" in msg and "20" in msg and "30" in msg
    assert isinstance(ei.value, FileNotFoundError)


# --------------------------------------------------------------------------- unsafe manifests

_OPENED: list[str] = []
_WATCH = [False]


def _audit(event, args):
    if _WATCH[0] and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def test_a_manifest_damaged_in_a_way_that_still_parses_is_refused_by_its_own_checksum(tmp_path):
    """One digit of the newest manifest's step flipped (30 -> 31): the manifest still parses and
    every file still verifies, but its own checksum does not match: skipped, loudly, and
    ``verify`` says corrupt. (Believed, a node-local restore resumed one node at step 31 and
    the other at 30, and hung.) A manifest without the checksum (older writers) is read."""
    root = tmp_path / "ck"
    _make_run(root)
    newest = os.path.join(_step_dir(root, 30), "manifest.json")
    with open(newest) as f:
        text = f.read()
    assert '"step": 30,' in text
    with open(newest, "w") as f:
        f.write(text.replace('"step": 30,', '"step": 31,'))
    with Checkpointer(root) as ck, pytest.warns(ResumeFallbackWarning, match="own checksum"):
        assert ck.restore(_fresh()) == 20
    from test_cli import cli  # the CLI in-process (the real executable: test_cli.py)

    out = cli("verify", str(root))
    assert out.returncode == 1 and "own checksum" in out.stdout + out.stderr, out

    older = _manifest(_step_dir(root, 20))
    del older[SELF_CHECKSUM]
    with open(os.path.join(_step_dir(root, 20), "manifest.json"), "w") as f:
        json.dump(older, f)  # as written before manifests carried their checksum
    os.remove(newest)
    with Checkpointer(root) as ck:
        assert ck.restore(_fresh()) == 20


@pytest.mark.parametrize("bad", ["../evil", "../../evil", "/etc/passwd", "sub/../../evil"])
def test_unsafe_manifest_is_corrupt_and_nothing_outside_is_touched(tmp_path, bad):
    root = tmp_path / "ck"
    _make_run(root, keep_last=None)
    evil_inside_root = root / "evil"
    evil_outside = tmp_path / "evil"
    for p in (evil_inside_root, evil_outside):
        p.write_bytes(b"precious")
    newest = _step_dir(root, 30)
    m = _manifest(newest)
    target = next(f for f in m["files"] if f["path"] == "shared.safetensors")
    target["path"] = bad
    _write_manifest(newest, m)

    st = _fresh()
    _OPENED.clear()
    _WATCH[0] = True
    try:
        with Checkpointer(root, keep_last=1) as ck:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                got = ck.restore(st)
            # retention after a new save must not follow the unsafe names either
            ck.save(31, _state(31))
    finally:
        _WATCH[0] = False
    assert got == 20 and st["extra"]["tag"] == 20
    opened = {os.path.realpath(p) for p in _OPENED}
    for p in (evil_inside_root, evil_outside, "/etc/passwd"):
        assert os.path.realpath(p) not in opened, f"{p} was opened"
    assert evil_inside_root.read_bytes() == b"precious" and evil_outside.read_bytes() == b"precious"
    assert os.path.exists("/etc/passwd")
    assert os.path.isdir(newest), "the tampered checkpoint is left for inspection"
    fallback = [str(w.message) for w in rec if issubclass(w.category, ResumeFallbackWarning)]
    assert fallback and "step_000000030" in fallback[0], (
        "the checkpoint with an unsafe manifest was skipped without a ResumeFallbackWarning; "
        f"warnings seen: {[str(w.message) for w in rec]}"
    )


def test_unsafe_manifest_explicit_path_raises(tmp_path):
    root = tmp_path / "ck"
    _make_run(root)
    m = _manifest(_step_dir(root, 30))
    m["files"][0]["path"] = "../evil"
    _write_manifest(_step_dir(root, 30), m)
    with (
        Checkpointer(tmp_path / "o", resume=_step_dir(root, 30)) as ck,
        pytest.raises(CheckpointCorruptError) as ei,
    ):
        ck.restore(_fresh())
    assert isinstance(ei.value, UnsafeManifestError)


def test_unsafe_manifest_resumed_by_step_raises_its_own_class(tmp_path):
    """resume=<step> of a checkpoint whose manifest names a file outside it: the error is an
    UnsafeManifestError, as for resume=<path> (it was a plain CheckpointCorruptError)."""
    root = tmp_path / "ck"
    _make_run(root)
    m = _manifest(_step_dir(root, 30))
    m["files"][0]["path"] = "../evil"
    _write_manifest(_step_dir(root, 30), m)
    with Checkpointer(root, resume=30) as ck, pytest.raises(UnsafeManifestError, match="evil"):
        ck.restore(_fresh())


@pytest.mark.parametrize(
    "name",
    [
        "../evil",
        "/etc/passwd",
        "a/../../b",
        "..",
        ".",
        "",
        "a//b",
        "a\\b",
        "C:evil",
        "a/./b",
        "x\x00y",
        "\\\\server\\share",
    ],
)
def test_check_relative_rejects(name):
    with pytest.raises(UnsafeManifestError):
        check_relative(name)


@pytest.mark.parametrize(
    "name", ["shared.safetensors", "rank_00000.json", "sub/dir/file.bin", "a..b"]
)
def test_check_relative_accepts(name):
    check_relative(name)


# --------------------------------------------------------------------------- lock

_HOLDER = r"""
import sys, time
from resilient_callbacks import Checkpointer
ck = Checkpointer(sys.argv[1])
print("READY", flush=True)
time.sleep(120)
"""


def test_lock_same_process_conflicts_then_released_by_close(tmp_path):
    root = tmp_path / "ck"
    first = Checkpointer(root)
    try:
        # flock locks belong to an open file description: a second Checkpointer in the same
        # process opens the lock file again and conflicts too
        with pytest.raises(CheckpointLockedError) as ei:
            Checkpointer(root)
        assert isinstance(ei.value, BlockingIOError)
        assert str(root) in str(ei.value)
    finally:
        first.close()
    with Checkpointer(root) as ck:
        assert ck.save(1, _state(1))


def test_lock_other_process_then_killed(tmp_path):
    root = tmp_path / "ck"
    # a process of its own, forked from the session's zygote (torch imported once)
    errs = tmp_path / "holder.err"
    proc = spawn_ranks.Piped([sys.executable, "-c", _HOLDER, str(root)], err=errs)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", errs.read_text()
        with pytest.raises(CheckpointLockedError) as ei:
            Checkpointer(root)
        assert f"pid {proc.pid}" in str(ei.value)  # names the holder
        assert "dirpath" in str(ei.value)  # says how to fix
        assert not any(n.startswith("step_") for n in os.listdir(root))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    with Checkpointer(root) as ck:  # a killed holder never leaves the directory locked
        assert ck.save(1, _state(1))


def test_closed_checkpointer_refuses_to_save(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    ck.close()
    ck.close()  # idempotent
    with pytest.raises(CheckpointError, match="closed"):
        ck.save(1, _state(1))


# --------------------------------------------------------------------------- staging sweep


def test_leftover_staging_is_swept_on_open(tmp_path):
    root = tmp_path / "ck"
    _make_run(root, steps=(10,))
    stale = root / ".staging-step_000000010-abc"
    stale.mkdir()
    (stale / "shared.safetensors").write_bytes(b"partial")
    stale2 = root / ".staging-step_000000020-0123456789ab"
    stale2.mkdir()
    unrelated = root / "notes"
    unrelated.mkdir()
    with Checkpointer(root) as ck:
        assert not stale.exists() and not stale2.exists()
        assert unrelated.exists()
        assert ck.restore(_fresh()) == 10


def test_folders_of_the_user_are_neither_counted_nor_deleted(tmp_path):
    """A user's copies of checkpoints ("my backup of 20", "step_000000010.bak") took slots of
    keep_last and were deleted by retention; a folder with another tool's manifest.json made
    every restore fail (all "corrupt"); a step_-named folder without a manifest was rm -rf'd by
    the next writer. Only step_<n> folders are checkpoints, and only our leftovers are swept."""
    import shutil

    root = tmp_path / "ck"
    _make_run(root, steps=(10, 20))
    shutil.copytree(_step_dir(root, 20), root / "my backup of 20")
    shutil.copytree(_step_dir(root, 10), root / "step_000000010.bak")
    (root / "exported_model").mkdir()
    (root / "exported_model" / "manifest.json").write_text('{"tool": "someone else"}')
    (root / "step_000000099").mkdir()
    (root / "step_000000099" / "notes.txt").write_text("mine")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeFallbackWarning)
        with Checkpointer(root, every_n_steps=10, keep_last=2) as ck:
            assert ck.restore(_fresh()) == 20
            for s in (30, 40):
                ck.save(s, _state(s))
            ck.flush()
            assert [e.step for e in ck.checkpoints()] == [30, 40]
    for mine in ("my backup of 20", "step_000000010.bak", "exported_model", "step_000000099"):
        assert (root / mine).is_dir(), mine
    assert (root / "step_000000099" / "notes.txt").read_text() == "mine"


def test_a_leftover_that_cannot_be_deleted_is_reported_as_such(tmp_path, caplog, monkeypatch):
    """A staging folder holding a file that cannot be deleted (open on NFS, immutable): the
    next writer said "removed" and went on saying so at every start."""
    root = tmp_path / "ck"
    _make_run(root, steps=(10,))
    stale = root / ".staging-step_000000020-0123456789ab"
    stale.mkdir()
    import resilient_callbacks.commit as rc_commit

    monkeypatch.setattr(rc_commit.shutil, "rmtree", lambda *a, **k: None)  # deletes nothing
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"), Checkpointer(root) as ck:
        assert ck.restore(_fresh()) == 10
    assert "could not remove 1 leftover" in caplog.text and "removed" not in caplog.text.replace(
        "could not remove", ""
    )


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_failed_directory_sync_after_the_rename_is_still_a_commit(
    tmp_path, monkeypatch, caplog, async_save
):
    """EIO from syncing the parent directory after the rename: the checkpoint is visible and
    restorable, yet was reported "not committed", and the next save reused its commit number."""
    import errno

    import resilient_callbacks.commit as rc_commit

    root = tmp_path / "ck"
    real = rc_commit.fsync_dir

    def fsync_dir(path):
        if os.path.samefile(path, root):
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(rc_commit, "fsync_dir", fsync_dir)
    logs = caplog.at_level(logging.WARNING, logger="resilient_callbacks")
    with logs, Checkpointer(root, async_save=async_save) as ck:
        for s in (1, 2):
            assert ck.save(s, _state(s)) is True
        ck.flush()
        seqs = [e.manifest.seq for e in ck.checkpoints()]
    assert seqs == sorted(set(seqs)) and len(seqs) == 2, seqs
    assert "syncing its directory failed" in caplog.text
    with Checkpointer(root) as ck:
        assert ck.restore(_fresh()) == 2


# --------------------------------------------------------------------------- retention


def test_retention_keep_last_and_best_over_twenty_saves(tmp_path):
    root = tmp_path / "ck"
    losses = {s: 10.0 - s for s in range(1, 8)}  # improving until step 7 (loss 3.0)
    losses.update({s: 5.0 + (s % 3) for s in range(8, 21)})  # worse afterwards
    losses[12] = float("nan")  # never the best
    losses[15] = 3.0  # a tie with step 7 (the newer one wins or either is fine)
    with Checkpointer(
        root, every_n_steps=1, keep_last=2, keep_best=1, monitor="loss", mode="min"
    ) as ck:
        for s in range(1, 21):
            assert ck.step(s, _state(s), metrics={"loss": losses[s]}) is True
            ck.flush()
            present = {int(n[5:14]) for n in _steps_present(root)}
            assert s in present
            assert s - 1 in present or s == 1
            best_so_far = min(losses[k] for k in range(1, s + 1) if losses[k] == losses[k])
            assert any(losses[k] == best_so_far for k in present), f"best lost after step {s}"
    present = _steps_present(root)
    assert len(present) == 3, present
    assert present[-2:] == ["step_000000019", "step_000000020"]
    assert present[0] in ("step_000000007", "step_000000015")


def test_retention_best_mode_max(tmp_path):
    root = tmp_path / "ck"
    acc = [0.1, 0.9, 0.3, 0.2, 0.4, 0.5]
    with Checkpointer(
        root, every_n_steps=1, keep_last=1, keep_best=2, monitor="acc", mode="max"
    ) as ck:
        for s, a in enumerate(acc, start=1):
            ck.step(s, _state(s), metrics={"acc": a})
    # retention runs after every save: step 5 (0.4) is second best until step 6 (0.5) arrives
    assert _steps_present(root) == ["step_000000002", "step_000000006"]


def test_retention_archive_points_survive(tmp_path):
    root = tmp_path / "ck"
    saved = []
    with Checkpointer(root, every_n_steps=3, keep_last=2, keep_every_n_steps=5) as ck:
        for s in range(1, 21):
            if ck.step(s, _state(s)):
                saved.append(s)
    assert saved == [3, 5, 6, 9, 10, 12, 15, 18, 20]  # archive steps are always saved
    assert _steps_present(root) == [f"step_{s:09d}" for s in (5, 10, 15, 18, 20)]


def test_retention_never_deletes_a_corrupt_checkpoint(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(root, every_n_steps=1, keep_last=1) as ck:
        ck.step(1, _state(1))
        ck.step(2, _state(2))
        ck.flush()
        _truncate(os.path.join(_step_dir(root, 2), "shared.safetensors"))
        for s in (3, 4):
            ck.step(s, _state(s))
    assert _steps_present(root) == ["step_000000002", "step_000000004"]


def test_foreign_run_is_reported_and_never_deleted(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(root, every_n_steps=1, keep_last=1) as ck:
        for s in range(1, 4):
            ck.step(s, _state(s))
        old_run = ck.run_id
    assert _steps_present(root) == ["step_000000003"]

    with Checkpointer(root, every_n_steps=1, keep_last=1, resume="never") as ck:
        assert ck.restore(_fresh()) == 0
        with pytest.warns(ForeignCheckpointsWarning) as rec:
            assert ck.step(1, _state(101))
        assert old_run in str(rec[0].message)
        ck.flush()
        # the new run's fresh checkpoint and the old run's checkpoint both survive
        assert _steps_present(root) == ["step_000000001", "step_000000003"]
        for s in (2, 3, 4):
            ck.step(s, _state(100 + s))
        new_run = ck.run_id
    assert new_run != old_run
    present = _steps_present(root)
    runs = {n: _manifest(os.path.join(root, n))["run_id"] for n in present}
    assert runs == {"step_000000003": old_run, "step_000000004": new_run}, runs
    st = _fresh()
    with Checkpointer(root) as ck, pytest.warns(ForeignCheckpointsWarning):
        # resuming the new run: the old run's checkpoint is reported again, and kept
        assert ck.restore(st) == 4
    assert st["extra"]["tag"] == 104
    assert "step_000000003" in _steps_present(root)


def test_new_run_same_step_as_foreign_does_not_overwrite(tmp_path):
    root = tmp_path / "ck"
    _make_run(root, steps=(5,))
    with (
        Checkpointer(root, resume="never", keep_last=1) as ck,
        pytest.warns(ForeignCheckpointsWarning),
    ):
        ck.save(5, _state(55))
    present = _steps_present(root)
    assert present == ["step_000000005", "step_000000005-1"]
    assert (
        safetensors.torch.load_file(os.path.join(root, "step_000000005", "shared.safetensors"))[
            "w"
        ][0]
        == 5
    )


def test_resumed_run_continues_retention(tmp_path):
    """After restore, the run continues: its old checkpoints count for keep_last."""
    root = tmp_path / "ck"
    with Checkpointer(root, every_n_steps=1, keep_last=2) as ck:
        for s in range(1, 4):
            ck.step(s, _state(s))
    with Checkpointer(root, every_n_steps=1, keep_last=2) as ck, warnings.catch_warnings():
        warnings.simplefilter("error", ForeignCheckpointsWarning)
        assert ck.restore(_fresh()) == 3
        for s in range(4, 6):
            ck.step(s, _state(s))
    assert _steps_present(root) == ["step_000000004", "step_000000005"]


# --------------------------------------------------------------------------- triggers


def test_step_every_n_steps_returns_true_when_saved(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(root, every_n_steps=5) as ck:
        got = [ck.step(s, _state(s)) for s in range(1, 13)]
    assert [s for s, g in zip(range(1, 13), got, strict=True) if g] == [5, 10]
    assert _steps_present(root) == ["step_000000005", "step_000000010"]


def test_a_step_counter_that_jumps_over_a_multiple_still_saves(tmp_path):
    """Lightning's global_step counts every optimizer.step() of a batch: with two optimizers on
    alternate batches it jumps by 2 and passed over multiples of every_n_steps, so a whole epoch
    went without a checkpoint. The step that passes a multiple is saved; after a restore the
    count goes on from the restored step."""
    root = tmp_path / "ck"
    steps = [1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 20, 22, 24, 26]
    with Checkpointer(root, every_n_steps=5) as ck:
        saved = [s for s in steps if ck.step(s, _state(s))]
    assert saved == [6, 10, 15, 20, 26]
    with Checkpointer(root, every_n_steps=5) as ck:
        assert ck.restore(_fresh()) == 26
        assert [s for s in (28, 29, 31, 32) if ck.step(s, _state(s))] == [31]


def test_saving_same_step_twice_returns_false(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(root, every_n_steps=5) as ck:
        assert ck.step(5, _state(5)) is True
        assert ck.step(5, _state(5)) is False
        assert ck.save(5, _state(5)) is False
        assert ck.save(6, _state(6)) is True
        assert ck.save(6, _state(6)) is False
    assert _steps_present(root) == ["step_000000005", "step_000000006"]


def test_saving_an_earlier_step_again_is_a_new_checkpoint_and_newest(tmp_path):
    """Only a repeat of the *last* committed step is skipped (same state twice). An earlier step
    saved again holds a new state (e.g. after rolling back) and becomes the newest checkpoint."""
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        assert ck.save(5, _state(5)) is True
        assert ck.save(6, _state(6)) is True
        assert ck.save(5, _state(50)) is True
    assert _steps_present(root) == ["step_000000005", "step_000000005-1", "step_000000006"]
    target = _state(0)
    with Checkpointer(root) as ck:
        assert ck.restore(target) == 5
    assert torch.equal(target["w"], _state(50)["w"])


def test_after_restore_the_restored_step_is_not_saved_again(tmp_path):
    root = tmp_path / "ck"
    _make_run(root, steps=(10,), every_n_steps=10)
    with Checkpointer(root, every_n_steps=10) as ck:
        assert ck.restore(_fresh()) == 10
        assert ck.step(10, _state(10)) is False
        assert ck.step(20, _state(20)) is True
    assert _steps_present(root) == ["step_000000010", "step_000000020"]


def test_no_trigger_step_never_saves(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        assert not any(ck.step(s, _state(s)) for s in range(1, 5))
        assert ck.save(4, _state(4)) is True


def test_every_seconds_with_fake_clock(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(rc_policy.time, "monotonic", lambda: now[0])
    root = tmp_path / "ck"
    with Checkpointer(root, every_seconds=10) as ck:
        assert ck.step(1, _state(1)) is False
        now[0] += 9.5
        assert ck.step(2, _state(2)) is False
        now[0] += 0.5
        assert ck.step(3, _state(3)) is True  # 10 s since construction
        assert ck.step(4, _state(4)) is False  # clock reset by the save
        now[0] += 10
        assert ck.step(5, _state(5)) is True
        now[0] += 3
        assert ck.save(6, _state(6)) is True  # a forced save resets the clock too
        now[0] += 8
        assert ck.step(7, _state(7)) is False
        now[0] += 2
        assert ck.step(8, _state(8)) is True
    assert _steps_present(root) == [f"step_{s:09d}" for s in (3, 5, 6, 8)]


def test_every_seconds_and_every_n_steps_combined(tmp_path, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(rc_policy.time, "monotonic", lambda: now[0])
    with Checkpointer(tmp_path / "ck", every_seconds=20, every_n_steps=4) as ck:
        got = []
        for s in range(1, 10):
            now[0] += 7  # 7 s per step; any save (by either trigger) restarts the clock
            got.append(ck.step(s, _state(s)))
    saved = [s for s, g in zip(range(1, 10), got, strict=True) if g]
    assert saved == [3, 4, 7, 8]


def test_every_seconds_real_time(tmp_path):
    """A step saves once ``every_seconds`` of real time passed since the last save (or the
    start). "Not yet" is asserted only where the test saw that less than the interval had
    passed: on a loaded machine a first save (or the start) can take longer than 0.3 s."""
    with Checkpointer(tmp_path / "ck", every_seconds=0.3) as ck:
        clock = ck._trigger.clock  # .last: when the interval began (monotonic)

        def step(s: int) -> tuple[bool, bool]:
            began = clock.last
            saved = ck.step(s, _state(s))
            return saved, time.monotonic() - began < 0.3

        saved, early = step(1)
        assert not (early and saved)  # within 0.3 s of the start: no save
        time.sleep(0.35)
        assert step(2)[0] is True
        saved, early = step(3)
        assert not (early and saved)  # within 0.3 s of step 2's save: none


# --------------------------------------------------------------------------- adapters' seams


def test_continued_from_records_the_start_there_and_names_a_newer_checkpoint_it_skips(tmp_path):
    from resilient_callbacks import history

    _make_run(tmp_path, steps=(10, 20, 30))
    with Checkpointer(tmp_path, resume="never") as ck:
        with pytest.warns(UserWarning, match=r"from step 20.*step_000000030.*steps 21-30 are"):
            ck.continued_from(20, "train(resume_from_checkpoint=...)")
        with pytest.warns(ForeignCheckpointsWarning):  # the older run's, under a new run id
            ck.save(25, _state(25))
    starts = [r for r in history.records(str(tmp_path)) if r["event"] == "start"]
    assert starts[-1]["step"] == 20  # not 25, the first save of the run
    assert starts[-1]["source"] == "train(resume_from_checkpoint=...)"
    with Checkpointer(tmp_path / "other", resume="never") as ck, warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing newer: nothing to say
        ck.continued_from(5, "fit(ckpt_path='x.ckpt')")
    # after a restore() that found nothing (the run started at step 0), before any save: the
    # run goes on from there (it recorded nothing: the report said step 0; migration probe)
    with Checkpointer(tmp_path / "third") as ck:
        assert ck.restore(_state(0)) == 0
        ck.continued_from(5, "old.pt")
        ck.save(6, _state(6))
        with pytest.raises(CheckpointError, match="call it instead of restore"):
            ck.continued_from(5, "old.pt")  # after a save: too late
    records = history.records(str(tmp_path / "third"))
    assert [(r["event"], r["step"]) for r in records][:2] == [("start", 0), ("continued", 5)]
    assert records[1]["source"] == "old.pt"
    from resilient_callbacks.report import lives

    assert [life.begin_step for life in lives(records)] == [5]
    # one step newer: "step 9 is trained again" (it said "steps 9-9 are"; a Trainer probe)
    _make_run(tmp_path / "fourth", steps=(8, 9))
    with (
        Checkpointer(tmp_path / "fourth", resume="never") as ck,
        pytest.warns(UserWarning, match=r"wins and step 9 is trained again"),
    ):
        ck.continued_from(8, "train(resume_from_checkpoint=True)")


def test_keep_best_on_a_metric_no_save_reported_is_said_at_close(tmp_path, caplog):
    with (
        caplog.at_level("WARNING", logger="resilient_callbacks"),
        Checkpointer(tmp_path / "a", keep_best=1, monitor="eval_loss") as ck,
    ):
        ck.save(1, _state(1), metrics={"loss": 1.0})
        ck.save(2, _state(2), metrics={"loss": 0.5})
    said = [r.getMessage() for r in caplog.records if "monitor='eval_loss'" in r.getMessage()]
    assert said and "none was kept as the best" in said[0] and "loss" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="resilient_callbacks"):
        with Checkpointer(tmp_path / "b", keep_best=1, monitor="eval_loss") as ck:
            ck.save(1, _state(1), metrics={"loss": 1.0, "eval_loss": 2.0})
            ck.save(2, _state(2), metrics={"loss": 0.5})
        # a later process of the same run whose saves carry no evaluation: the run's do
        with Checkpointer(tmp_path / "b", keep_best=1, monitor="eval_loss") as ck:
            ck.restore(_fresh())
            ck.save(3, _state(3), metrics={"loss": 0.4})
    assert not [r for r in caplog.records if "monitor='eval_loss'" in r.getMessage()]


_FALLBACK_SCRIPT = """
import logging, os, sys, torch
from resilient_callbacks import Checkpointer
root = sys.argv[1]
if sys.argv[2] == "configured":
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
with Checkpointer(root) as ck:
    for step in (10, 20):
        ck.save(step, {"w": torch.full((8,), float(step))})
path = os.path.join(root, "step_000000020", "manifest.json")
with open(path, "r+b") as f:
    f.write(b"#")
with Checkpointer(root) as ck:
    assert ck.restore({"w": torch.zeros(8)}) == 10
"""


@pytest.mark.parametrize(
    "logging_setup", ["none", pytest.param("configured", marks=pytest.mark.slow)]
)
def test_a_fallback_is_printed_once_without_logging_configured(tmp_path, logging_setup):
    """Warned and logged: with no logging handler, logging's last-resort handler printed the
    warning's text a second time on stderr."""
    # forked from the session's zygote (torch imported once), no logging set up there either
    argv = [sys.executable, "-c", _FALLBACK_SCRIPT, str(tmp_path / "ck"), logging_setup]
    out = spawn_ranks.run_python(argv, timeout=120)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "falling back to an older" in line]
    if logging_setup == "none":
        assert len(said) == 1, out.stderr
    else:  # the warning, and the log record for the logs
        assert len(said) == 2 and sum(line.startswith("LOG ") for line in said) == 1, out.stderr


def test_a_step_that_goes_back_is_said_once_and_saving_goes_on(tmp_path):
    """A load of the caller's own after restore() (DeepSpeed's engine.load_checkpoint of an
    older tag) rewound the state and the steps in silence, and retention then deleted the
    newer checkpoint; now it is said, once, and the schedule counts on from there."""
    root = tmp_path / "ck"
    state = {"w": torch.ones(2)}
    with Checkpointer(root, every_n_steps=5, keep_last=2, async_save=False) as ck:
        for s in range(1, 11):
            ck.step(s, state)
        with pytest.warns(UserWarning, match="went back from step 10 to 8") as caught:
            for s in range(8, 16):
                ck.step(s, state)
            for s in range(3, 5):
                ck.step(s, state)
    assert len([w for w in caught if "went back" in str(w.message)]) == 1
    assert sorted(_steps_present(root)) == ["step_000000010", "step_000000015"]


def test_close_unregisters_its_exit_hook(tmp_path):
    """Each Checkpointer's atexit hook stayed registered after close(): one per trial of a
    sweep run in one process (the long-run probe: 200 open/close cycles, 200 hooks). CPython
    keeps the emptied slot, so what is checked is that the hook itself is freed."""
    import gc
    import weakref

    hooks = []
    for i in range(3):
        with Checkpointer(tmp_path / f"ck{i}") as ck:
            ck.save(1, {"w": torch.ones(2)})
            hooks.append(weakref.ref(ck._at_exit))
    del ck
    gc.collect()
    assert [h() for h in hooks] == [None, None, None]


def test_latest_that_cannot_be_updated_is_removed_not_left_stale(tmp_path, monkeypatch):
    """`latest` not updatable (a full disk): it kept naming a checkpoint that retention then
    deleted (shell scripts that read it broke); now it is removed, with a warning."""
    import errno

    from resilient_callbacks import commit

    root = tmp_path / "ck"
    with Checkpointer(root, keep_last=1, async_save=False) as ck:
        ck.save(1, {"w": torch.ones(2)})
        assert (root / "latest").read_text().strip() == "step_000000001"

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(commit, "write_latest_pointer", full)
        ck.save(2, {"w": torch.ones(2)})
    assert not (root / "latest").exists()
    with Checkpointer(root) as again:
        assert [e.step for e in again.checkpoints()] == [2]


class _SavedByAnOlderVersion:
    """A wrapped module as earlier versions of this library saved it: its keys prefixed."""

    def __init__(self, module: torch.nn.Module, prefix: str) -> None:
        self.module, self.prefix = module, prefix

    def state_dict(self) -> dict:
        return {f"{self.prefix}{k}": v for k, v in self.module.state_dict().items()}

    def load_state_dict(self, sd: dict) -> None:
        raise AssertionError("only saved from")


def test_a_wrapped_model_and_its_plain_module_resume_each_others_checkpoints(tmp_path):
    """torch.compile's wrapper prefixes its module's keys with "_orig_mod.", DataParallel and
    DistributedDataParallel with "module.": a run that turned compiling on or off, or went from
    DDP to one process (or an evaluation of a DDP run), could not resume (missing and
    unexpected keys). The module inside the wrapper is what is saved and loaded now, and a
    checkpoint whose keys all carry a wrapper's prefix (written before) loads into either."""

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    saved = model(0)
    saved_opt = torch.optim.AdamW(saved.parameters(), lr=0.1)
    saved(torch.ones(2, 4)).sum().backward()
    saved_opt.step()
    wrappers = {
        "plain": lambda m: m,
        "compiled": torch.compile,
        "dp": torch.nn.DataParallel,
        "compiled dp": lambda m: torch.compile(torch.nn.DataParallel(m)),
    }
    old = {
        "old compiled": _SavedByAnOlderVersion(saved, "_orig_mod."),
        "old dp": _SavedByAnOlderVersion(saved, "module."),
        "old compiled dp": _SavedByAnOlderVersion(saved, "_orig_mod.module."),
    }
    saves = {**{k: w(saved) for k, w in wrappers.items()}, **old}
    for i, (as_saved, save_as) in enumerate(saves.items()):
        with Checkpointer(tmp_path / str(i)) as ck:
            ck.save(1, {"model": save_as, "opt": saved_opt})
        for as_loaded, wrap in wrappers.items():
            fresh = model(1)
            live = wrap(fresh)
            opt = torch.optim.AdamW(live.parameters(), lr=0.1)
            with Checkpointer(tmp_path / str(i), read_only=True) as ck:
                assert ck.restore({"model": live, "opt": opt}) == 1
            for a, b in zip(saved.state_dict().values(), fresh.state_dict().values(), strict=True):
                assert torch.equal(a, b), (as_saved, as_loaded)
            assert opt.state_dict()["state"][0]["step"] == 1


def test_a_model_whose_own_keys_start_with_module_is_not_unwrapped(tmp_path):
    """A plain module with a submodule named "module" keeps its keys: only keys none of which
    the live module has are taken for a wrapper's."""

    class Holder(torch.nn.Module):
        def __init__(self, v: float) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            torch.nn.init.constant_(self.module.weight, v)

    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": Holder(3.0)})
    live = Holder(0.0)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": live}) == 1
    assert torch.equal(live.module.weight, torch.full((2, 2), 3.0))
