"""Invalid options, unusable directories and a full disk: clear errors, nothing committed."""

from __future__ import annotations

import errno
import os
import re
import warnings

import pytest
import torch

from resilient_callbacks import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
    ForeignCheckpointsWarning,
)


def _state(n: int, v: float = 1.0) -> dict:
    return {"w": torch.full((n,), v), "extra": {"n": n}}


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"keep_best": 1}, "monitor="),
        ({"monitor": "loss"}, "keep_best=1"),
        ({"keep_last": 0}, ">= 1"),
        ({"keep_last": -2}, ">= 1"),
        ({"keep_best": 1, "monitor": "loss", "mode": "avg"}, "'min' or 'max'"),
        ({"every_n_steps": 0}, ">= 1"),
        ({"every_n_steps": 2.5}, "int"),
        ({"every_seconds": -1}, "> 0"),
        ({"every_seconds": 0}, "> 0"),
        ({"keep_every_n_steps": 0}, ">= 1"),
        ({"resume": True}, "'auto'"),
        ({"resume": False}, "'auto'"),
        ({"resume": -3}, ">= 0"),
        ({"resume": 1.5}, "'auto'"),
        ({"capture_rng": "yes"}, "True or False"),
        # saves in flight would share one set of host buffers: torn checkpoints that verify
        ({"max_in_flight": 2}, "if_busy='skip'"),
        ({"max_in_flight": 0}, "one save is written at a time"),
        # named as the Checkpointer's option, not the watcher's (grace_period_s)
        ({"grace_period": "30"}, "grace_period='30'"),
        # a typo: a ConfigError naming the options (it was a TypeError from MetadataPoller)
        ({"metadata_notices": {"kind": "aws", "interval": 5}}, "'interval'; the options are"),
        ({"mtbf_hours": 8}, "mtbf_hours applies only to the adaptive schedule"),
    ],
)
def test_invalid_options_fail_at_construction(tmp_path, kwargs, hint):
    d = tmp_path / "ck"
    with pytest.raises(ConfigError) as ei:
        Checkpointer(d, **kwargs)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, CheckpointError)
    assert hint in str(ei.value), str(ei.value)
    assert not d.exists(), "a rejected configuration must not create the directory"


@pytest.mark.parametrize("url", ["s3://bucket/ckpts", "gs://b/c", "hdfs://x/y"])
def test_object_store_dirpath_is_rejected(url):
    with pytest.raises(ConfigError, match="local") as ei:
        Checkpointer(url)
    # it said "not supported", not that remote= is how checkpoints reach an object store
    assert f"remote={url!r}" in str(ei.value), str(ei.value)


@pytest.mark.parametrize(
    ("resume", "hint"),
    [
        ("latest", "resume='auto' (the default)"),
        ("last", "resume='auto' (the default)"),
        ("step_000000003", "relative to the working directory, not to dirpath"),
    ],
)
def test_a_resume_path_that_is_not_there_says_what_was_meant(tmp_path, monkeypatch, resume, hint):
    """resume='latest' (DeepSpeed's word, Lightning's ckpt_path='last') and the bare name of a
    checkpoint in dirpath were each 'no checkpoint at <cwd>/latest', naming no fix."""
    root = tmp_path / "ck"
    with Checkpointer(root, async_save=False) as ck:
        ck.restore(_state(2))
        ck.save(3, _state(2))
    monkeypatch.chdir(tmp_path)
    with Checkpointer(root, resume=resume) as ck, pytest.raises(CheckpointNotFoundError) as ei:
        ck.restore(_state(2))
    assert hint in str(ei.value), str(ei.value)
    if resume.startswith("step_"):
        assert f"resume={str(root / resume)!r}" in str(ei.value)


def test_empty_dirpath_is_rejected():
    with pytest.raises(ConfigError):
        Checkpointer("")


def test_file_url_and_pathlike_dirpath_are_accepted(tmp_path):
    with Checkpointer(f"file://{tmp_path}/a") as ck:
        assert ck.dirpath == str(tmp_path / "a")
    with Checkpointer(tmp_path / "b") as ck:
        assert ck.dirpath == str(tmp_path / "b")


# --------------------------------------------------------------------------- unusable dirs


def test_a_dirpath_that_is_a_dangling_symlink_names_its_missing_target(tmp_path):
    """A link to a scratch folder not made yet: it said only "File exists" (what mkdir says
    of a link to nowhere). Nothing is created at the link's target."""
    (tmp_path / "link").symlink_to(tmp_path / "scratch" / "run1")
    with pytest.raises(CheckpointWriteError) as ei:
        Checkpointer(tmp_path / "link")
    said = str(ei.value)
    assert f"symbolic link to {tmp_path / 'scratch' / 'run1'}, which does not exist" in said
    assert (tmp_path / "link").is_symlink() and not (tmp_path / "scratch").exists()


def test_dirpath_under_a_regular_file(tmp_path):
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    with pytest.raises(CheckpointError) as ei:
        Checkpointer(f / "sub")
    msg = str(ei.value)
    assert str(f / "sub") in msg and "Not a directory" in msg


@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "read_only"])
def test_a_dirpath_that_is_one_checkpoint_is_refused(tmp_path, read_only):
    """The CLI takes one checkpoint's folder where it reads; a Checkpointer given one once
    started a fresh run inside it (lock, history, step_*), where the parent's retention or gc
    would delete that run with the checkpoint."""
    with Checkpointer(tmp_path / "run", async_save=False) as ck:
        ck.save(60, _state(4, 6.0))
        one = str(ck.last_save.path)
    before = sorted(os.listdir(one))
    kwargs = {"read_only": True} if read_only else {"every_n_steps": 10}
    with pytest.raises(ConfigError, match="is one checkpoint") as info:
        Checkpointer(one, **kwargs)
    assert str(tmp_path / "run") in str(info.value) and f"resume={one!r}" in str(info.value)
    assert sorted(os.listdir(one)) == before  # nothing written inside it
    # what the message says to do restores it
    state = _state(4)
    with Checkpointer(tmp_path / "run", read_only=True, resume=one) as ck:
        assert ck.restore(state) == 60
    assert torch.equal(state["w"], torch.full((4,), 6.0))


def test_another_tools_manifest_beside_the_checkpoints_is_no_checkpoint(tmp_path):
    """A manifest.json of another tool at the top of dirpath: the directory was refused as
    "one checkpoint", and a requeued job failed to start; only a manifest of ours is one."""
    root = tmp_path / "outputs"
    with Checkpointer(root, async_save=False) as ck:
        ck.save(10, _state(4, 3.0))
    (root / "manifest.json").write_text('{"files": ["train.bin"]}')
    state = _state(4)
    with Checkpointer(root, async_save=False) as ck:
        assert ck.restore(state) == 10
    assert torch.equal(state["w"], torch.full((4,), 3.0))


def test_dirpath_is_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match=str(f)):
        Checkpointer(f)
    assert f.read_text() == "x"


# --------------------------------------------------------------------------- other bad calls


@pytest.mark.parametrize("step", [-1, 1.0, "3", True, None])
def test_bad_step_values(tmp_path, step):
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(TypeError):
        ck.save(step, _state(4))
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(("step_", ".staging"))]


def test_non_numeric_metric_is_rejected_before_writing(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(TypeError, match="loss"):
        ck.save(1, _state(4), metrics={"loss": "low"})
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(("step_", ".staging"))]


@pytest.mark.parametrize(
    ("value", "said"), [(torch.ones(3), "a tensor of shape (3,)"), (None, "None"), ("n/a", "'n/a'")]
)
def test_a_metric_that_is_not_a_number_is_refused_at_the_first_step(tmp_path, value, said):
    """A bad metric was found only at the first step that saved (hours into a run, perhaps),
    and a tensor of several elements as torch's own 'cannot be converted to Scalar', naming
    no metric (the docs walkthrough). Now the first step() says which and why, reading no
    tensor."""
    state = {"w": torch.zeros(2)}
    with Checkpointer(tmp_path, every_n_steps=5) as ck:
        assert not ck.step(1, state, metrics={"loss": torch.tensor(0.5), "lr": 1e-3, "n": "7"})
        with pytest.raises(TypeError, match=f"metric 'bad' is {re.escape(said)}: metrics are"):
            ck.step(2, state, metrics={"loss": 0.5, "bad": value})
        assert ck.checkpoints() == []


def test_restore_into_a_bare_value_is_rejected(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, 5)
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointMismatchError):
        ck.restore(6)


# --------------------------------------------------------------------------- disk full


def _save_failing(ck, step, state, async_save):
    """A save that fails: synchronously it raises from save(); in the background it raises
    from the next flush (or save, or close), never lost."""
    if async_save:
        assert ck.save(step, state) is True
        with pytest.raises(CheckpointWriteError) as ei:
            ck.flush()
    else:
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(step, state)
    return ei.value


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_raises_write_error_and_commits_nothing(small_tmpfs, async_save):
    root = small_tmpfs / "ck"
    with Checkpointer(root, async_save=async_save) as ck:
        assert ck.save(1, _state(1000, 1.0)) is True
        # 8 MB of float32 on a 4 MiB filesystem
        err = _save_failing(ck, 2, _state(2_000_000, 2.0), async_save)
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC, (err.errno, str(err))
        assert "step 2" in str(err)
        assert "needs room for every checkpoint (keep_last=None keeps them all)" in str(err)
        names = os.listdir(root)
        assert [n for n in names if n.startswith("step_")] == ["step_000000001"]
        assert not [n for n in names if n.startswith(".staging")], names
        assert [e.step for e in ck.checkpoints()] == [1]
        assert ck.latest_path == os.path.join(str(root), "step_000000001")

        # the older checkpoint is intact and restorable
        st = _state(1000, 0.0)
        st["extra"]["n"] = None
        assert ck.restore(st) == 1
        assert torch.equal(st["w"], torch.full((1000,), 1.0)) and st["extra"]["n"] == 1000

        # once the state fits again, saving works again (same step number)
        assert ck.save(2, _state(1000, 3.0)) is True
    names = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    assert names == ["step_000000001", "step_000000002"]
    st = _state(1000, 0.0)
    with Checkpointer(root) as ck:
        assert ck.restore(st) == 2
    assert torch.equal(st["w"], torch.full((1000,), 3.0))


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_with_retention_does_not_delete_the_good_checkpoint(small_tmpfs, async_save):
    root = small_tmpfs / "ck"
    with Checkpointer(root, every_n_steps=1, keep_last=1, async_save=async_save) as ck:
        assert ck.step(1, _state(1000)) is True
        if async_save:
            assert ck.step(2, _state(2_000_000)) is True
            with pytest.raises(CheckpointWriteError):
                ck.step(3, _state(1000))  # the background failure surfaces at the next save
        else:
            with pytest.raises(CheckpointWriteError):
                ck.step(2, _state(2_000_000))
        assert [e.step for e in ck.checkpoints()] == [1]
        assert ck.step(4, _state(1000)) is True
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000000004"]


@pytest.mark.parametrize("change", ["groups", "class", "order"])
def test_an_optimizer_that_does_not_fit_is_refused_before_the_model_is_loaded(tmp_path, change):
    """The optimizer has another number of parameter groups, or is of another class, than the
    one saved: refused by name before anything is loaded (the model was loaded first, then the
    optimizer's own load_state_dict raised, leaving the model with the checkpoint's weights)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, {"model": model, "opt": opt})
    fresh = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    if change == "groups":
        other = torch.optim.SGD(
            [{"params": [fresh.weight]}, {"params": [fresh.bias]}], lr=0.1, momentum=0.9
        )
        says = r"parameter groups of \[2\] parameter\(s\) in the checkpoint, of \[1, 1\]"
    elif change == "class":
        other = torch.optim.Adam(fresh.parameters())
        says = "a torch.optim.sgd.SGD in the checkpoint, a torch.optim.adam.Adam here"
    else:  # same class and group sizes: the momentum of the bias would land on the weight
        other = torch.optim.SGD([fresh.bias, fresh.weight], lr=0.1, momentum=0.9)
        says = r"group 0 parameter 0: \[2, 3\] in the checkpoint, \[2\] here"
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointMismatchError, match=says):
        ck.restore({"model": fresh, "opt": other})
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_a_dirpath_that_is_a_file_is_named_as_such(tmp_path):
    """It read "cannot use ... as a checkpoint directory: File exists"; errno is kept."""
    f = tmp_path / "ck"
    f.write_text("not a folder")
    with pytest.raises(CheckpointWriteError, match="as a checkpoint directory: it is a file") as ei:
        Checkpointer(f)
    assert ei.value.errno == errno.EEXIST


def test_a_background_save_that_fails_is_logged_when_it_fails(small_tmpfs, caplog):
    """The loop hears of a failed background save at its next save, flush or close; the log
    says so at once (nothing was said until then: a whole save interval without a fresh
    checkpoint, in silence)."""
    import logging

    with Checkpointer(small_tmpfs / "ck") as ck:
        with caplog.at_level(logging.ERROR, logger="resilient_callbacks"):
            assert ck.save(1, _state(2_000_000)) is True  # 8 MB on a 4 MiB filesystem
            ck._saver.persister.wait_all()  # finished, not yet raised to the loop
        assert any("background save of step 1 failed" in r.message for r in caplog.records)
        with pytest.raises(CheckpointWriteError):
            ck.flush()


@pytest.mark.parametrize("async_save", [False, True])
def test_errno_is_kept_when_the_staging_directory_cannot_be_made(tmp_path, async_save):
    """guide.md: `errno` is kept. A staging directory that could not be made (the directory
    gone, a full inode table, no permission) gave errno None: the error travels to the other
    ranks as text."""
    import shutil

    root = tmp_path / "ck"
    with Checkpointer(root, async_save=async_save) as ck:
        shutil.rmtree(root)
        root.write_text("a file where the directory was")
        err = _save_failing(ck, 1, _state(4), async_save)
        assert "cannot create a staging directory" in str(err)
        assert err.errno == errno.ENOTDIR, (err.errno, str(err))
        root.unlink()
        root.mkdir()  # close() finds its directory again


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_wait_for_retention_to_free_the_space_they_need(small_tmpfs, monkeypatch, async_save):
    """A disk with room for keep_last + 1 checkpoints and deletions slower than the saves: each
    save waits for retention's deletions when the space is not there yet (saves 4 and on failed
    with ENOSPC while the space they needed was still being freed). Each deletion starts only
    once something waits for it (a save, or close()), so none is ever done before the next
    save looks for its space: no sleeps, and no load makes the deletions fast enough."""
    import threading

    from resilient_callbacks import trash

    real_delete, real_wait = trash._delete, trash.TrashBin.wait
    cond = threading.Condition()
    waits = [0, 0]  # wait() calls begun, and those not yet returned

    def wait(self, timeout=None):
        with cond:
            waits[0] += 1
            waits[1] += 1
            cond.notify_all()
        try:
            return real_wait(self, timeout)
        finally:
            with cond:
                waits[1] -= 1

    def slow(path):  # (60 s: a safety net only; it returns as soon as a wait() has begun)
        with cond:
            begun = waits[0]
            cond.wait_for(lambda: waits[0] > begun or waits[1] > 0, timeout=60.0)
        real_delete(path)

    monkeypatch.setattr(trash, "_delete", slow)
    monkeypatch.setattr(trash.TrashBin, "wait", wait)
    root = small_tmpfs / "ck"
    with Checkpointer(root, keep_last=2, async_save=async_save) as ck:  # 1.2 MB each, 4 MiB
        for step in range(1, 7):
            ck.save(step, _state(300_000, float(step)))
            ck.flush()
        assert [e.step for e in ck.checkpoints()] == [5, 6]
        assert waits[0] == 3  # saves 4, 5 and 6 each waited for a deletion


def test_saving_without_restore_beside_a_run_says_that_restore_was_not_called(tmp_path):
    """A new process that forgot restore() saved step 10 as a fresh run beside a run's step 60,
    and the only word was that the directory holds another run's checkpoints (the docs
    walkthrough); the next auto-resume then takes step 10. The warning now says what
    happened, at the user's line, and how to resume or start anew on purpose."""
    state = {"w": torch.zeros(2)}
    with Checkpointer(tmp_path, every_n_steps=10) as ck:
        for s in range(1, 61):
            ck.step(s, state)
    with (
        Checkpointer(tmp_path, every_n_steps=10) as ck,
        pytest.warns(ForeignCheckpointsWarning, match=r"restore\(\) was not called") as got,
    ):
        for s in range(1, 11):
            ck.step(s, state)
    message = str(got[0].message)
    assert "would have resumed from step 60" in message and "resume='never'" in message
    assert got[0].filename == __file__  # the user's step() line, not the library's
    with (
        Checkpointer(tmp_path, resume="never", every_n_steps=10) as ck,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        ck.step(10, state)
    assert not [w for w in caught if "restore() was not called" in str(w.message)]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_a_directory_this_user_cannot_write_points_to_read_only(tmp_path, monkeypatch, code):
    """An evaluation job opening the run's directory on a read-only mount was told only to
    check that the path is writable, not that read_only=True restores without writing."""
    from resilient_callbacks import lock

    root = tmp_path / "ck"
    with Checkpointer(root, async_save=False) as ck:
        ck.restore(_state(2))
        ck.save(1, _state(2))

    def refused(self, wait_s=0.0):
        raise OSError(code, os.strerror(code), str(root / ".lock"))

    monkeypatch.setattr(lock.DirLock, "acquire", refused)
    with pytest.raises(CheckpointWriteError, match="writable by this user") as ei:
        Checkpointer(root)
    assert "read_only=True" in str(ei.value) and ei.value.errno == code, str(ei.value)
    with Checkpointer(root, read_only=True) as ck:  # what it says to do works
        assert ck.restore(_state(2)) == 1
    with pytest.raises(CheckpointWriteError) as ei:  # nothing there to restore: no such hint
        Checkpointer(tmp_path / "new")
    assert "read_only" not in str(ei.value), str(ei.value)


def test_a_remote_without_a_scheme_that_looks_like_a_bucket_is_warned_about(tmp_path, monkeypatch):
    """remote="my-bucket/run1" (the s3:// forgotten) is a local folder next to the run: said,
    with the URL that was probably meant; a path that says it is local is taken quietly."""
    from resilient_callbacks.config import CheckpointerConfig

    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"no scheme.*'s3://my-bucket/run1'"):
        cfg = CheckpointerConfig(dirpath=str(tmp_path / "ck"), remote="my-bucket/run1")
    assert cfg.remote == "file://" + str(tmp_path / "my-bucket" / "run1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for local in ("./durable/run1", str(tmp_path / "durable"), "~/durable-rc-test"):
            CheckpointerConfig(dirpath=str(tmp_path / "ck"), remote=local)


def test_an_optional_key_a_checkpoint_lacks_keeps_its_value_and_others_are_refused(tmp_path):
    """OptionalKeys: an entry added to a state after a checkpoint of it was written restores
    (keeping its live value); a key not declared optional is still refused as missing."""
    from resilient_callbacks.state_marks import OptionalKeys

    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, {"rank": {"w": torch.arange(4.0)}})
    w = torch.zeros(4)
    state = {"rank": OptionalKeys({"w": w, "new": None}, optional=("new",))}
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(state) == 1
    assert torch.equal(w, torch.arange(4.0)) and state["rank"]["new"] is None
    state = {"rank": OptionalKeys({"w": torch.zeros(4), "new": None}, optional=("other",))}
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointMismatchError, match="new"):
        ck.restore(state)


def test_an_optional_key_of_a_dict_of_plain_values_keeps_its_value_without_a_warning(tmp_path):
    """Found 2026-12-07: an OptionalKeys holding plain values only (no tensor, no object) was
    merged as plain data, which deleted the key the checkpoint lacks and warned that it was
    "removed" (the Transformers adapter's 'order', new that day, on every resume of an older
    checkpoint); it keeps its live value, silently, as in an OptionalKeys holding tensors. A
    key not declared optional is still removed, with the warning."""
    from resilient_callbacks.state_marks import OptionalKeys

    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, {"w": torch.zeros(2), "plain": {"a": 1, "b": [2]}})
    plain = OptionalKeys({"a": 0, "b": [], "new": {"x": 1}}, optional=("new",))
    state = {"w": torch.ones(2), "plain": plain}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpointer(tmp_path / "ck") as ck:
            assert ck.restore(state) == 1
    assert state["plain"] is plain and dict(plain) == {"a": 1, "b": [2], "new": {"x": 1}}
    state = {"w": torch.ones(2), "plain": OptionalKeys({"a": 0, "new": 1}, optional=("other",))}
    with Checkpointer(tmp_path / "ck") as ck, pytest.warns(UserWarning, match="new.*removed"):
        ck.restore(state)
    assert state["plain"] == {"a": 1, "b": [2]}
