"""The paths a run takes when things go wrong at once: a preemption or an exception after a
background save failed, a busy disk at an archive step, two Checkpointers in one process, a
close that times out, a checkpoint a restore found corrupt. Each test fails without its fix;
none asserts on time (slow writes are gated by events, clocks faked)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from resilient_callbacks import (
    Checkpointer,
    CheckpointLockedError,
    ConfigError,
    catalog,
    persisting,
    policy,
)
from resilient_callbacks.catalog import Depth
from resilient_callbacks.lock import DirLock


def _state() -> dict:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    return {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1), "extra": {"n": 0}}


def _train(state) -> None:
    m, opt = state["model"], state["optimizer"]
    opt.zero_grad()
    m(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()


def _steps(root) -> list[tuple[int, str]]:
    return [
        (e.manifest.step, e.manifest.reason)
        for e in catalog.committed(catalog.scan(str(root), Depth.NONE))
        if e.manifest is not None
    ]


@pytest.fixture
def failing_write(monkeypatch):
    """``fail(n)``: the n-th write of a checkpoint part (1-based) raises an I/O error."""
    orig = persisting.layout.write_part
    calls, failing = [0], set()

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] in failing:
            raise OSError(5, "transient I/O error")
        return orig(*a, **k)

    monkeypatch.setattr(persisting.layout, "write_part", flaky)
    return failing.add


def _slow_writes(monkeypatch, seconds: float) -> None:
    """Every write of a checkpoint part takes at least ``seconds`` more."""
    orig = persisting.layout.write_part
    monkeypatch.setattr(
        persisting.layout,
        "write_part",
        lambda *a, **k: (threading.Event().wait(seconds), orig(*a, **k))[1],
    )


@pytest.fixture
def gated_write(monkeypatch):
    """Background writes wait for the returned event (a disk as slow as the test wants)."""
    orig = persisting.layout.write_part
    gate = threading.Event()

    def slow(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(60)
        return orig(*a, **k)

    monkeypatch.setattr(persisting.layout, "write_part", slow)
    yield gate
    gate.set()


def test_preemption_after_a_failed_background_save_still_saves_and_exits_75(
    tmp_path, failing_write, caplog
):
    failing_write(2)  # the save of step 10
    state = _state()
    ck = Checkpointer(tmp_path, every_n_steps=5)
    with pytest.raises(SystemExit) as exit_:
        for s in range(1, 20):
            _train(state)
            if s == 12:
                os.kill(os.getpid(), signal.SIGTERM)
            ck.step(s, state)
    assert exit_.value.code == 75
    assert _steps(tmp_path) == [(5, "periodic"), (12, "emergency")]
    assert "an earlier background save failed" in caplog.text


def test_exception_save_after_a_failed_background_save(tmp_path, failing_write):
    failing_write(2)
    state = _state()
    with (
        pytest.raises(ValueError, match="user bug"),  # the user's error, not ours
        Checkpointer(tmp_path, every_n_steps=5, save_on_exception=True) as ck,
    ):
        for s in range(1, 20):
            _train(state)
            ck.step(s, state)
            if s == 12:
                raise ValueError("user bug")
    assert _steps(tmp_path) == [(5, "periodic"), (12, "emergency")]


def test_leaving_the_with_block_raises_the_users_exception_not_a_save_failure(
    tmp_path, failing_write, caplog
):
    failing_write(1)
    state = _state()
    with pytest.raises(ValueError) as err, Checkpointer(tmp_path, every_n_steps=1) as ck:
        ck.step(1, state)  # fails in the background
        raise ValueError("user bug")
    assert err.value.__context__ is None
    assert "closing the Checkpointer after ValueError failed" in caplog.text


def test_preemption_without_exit_saves_once(tmp_path):
    state = _state()
    with Checkpointer(tmp_path, every_n_steps=100, exit_on_preemption=False) as ck:
        saved = []
        for s in range(1, 8):
            if s == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            saved.append(ck.step(s, state))
            assert ck.preempted == (s >= 3)
    assert saved == [False, False, True, False, False, False, False]
    assert _steps(tmp_path) == [(3, "emergency")]


def test_save_on_exception_after_a_forward_pass_saves_the_steps_batchnorm_statistics(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with (
        pytest.raises(RuntimeError, match="out of memory"),
        Checkpointer(tmp_path, every_n_steps=100, save_on_exception=True) as ck,
    ):
        for s in range(1, 4):
            model(torch.randn(16, 4)).sum().backward()
            state["optimizer"].step()
            ck.step(s, state)
        at_step = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.randn(16, 4))  # step 4's forward updates the running statistics ...
        assert not torch.equal(model[1].running_mean, at_step["1.running_mean"])
        raise RuntimeError("CUDA out of memory")  # ... then it fails
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters())}) == 3
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_step[k]), k
    assert int(fresh[1].num_batches_tracked) == 3


def test_if_busy_skip_never_skips_an_archive_step(tmp_path, gated_write):
    state = _state()
    ck = Checkpointer(tmp_path, every_n_steps=3, keep_every_n_steps=10, if_busy="skip")
    saved = {s: ck.step(s, state) for s in range(1, 10)}  # step 3's write is held
    assert saved[3] and not saved[6] and not saved[9]  # periodic: skipped while busy
    threading.Timer(0.5, gated_write.set).start()  # the disk frees up while step 10 waits
    assert ck.step(10, state)  # the archive step waits for the disk instead of skipping
    ck.close()
    assert [s for s, _ in _steps(tmp_path)] == [3, 10]


def test_if_busy_skip_with_every_seconds_skips_a_due_save_once(tmp_path, gated_write, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: now[0])
    state = _state()
    ck = Checkpointer(tmp_path, every_seconds=1.0, if_busy="skip")
    results = []
    for s, t in enumerate([1001.0, 1002.0, 1002.5, 1002.6, 1003.1], start=1):
        now[0] = t
        results.append(ck.step(s, state))
    assert results == [True, False, False, False, False]
    assert ck.skipped_saves == 2  # due at 1002.0 and again at 1003.1, not at every step
    gated_write.set()
    ck.close()


def test_two_checkpointers_in_one_process_both_see_sigterm(tmp_path):
    a = Checkpointer(tmp_path / "a", every_n_steps=100, exit_on_preemption=False)
    b = Checkpointer(tmp_path / "b", every_n_steps=100, exit_on_preemption=False)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert a.step(1, _state()) and b.step(1, _state())
        assert a.preempted and b.preempted
    finally:
        b.close()
        a.close()


def test_grace_warning_counts_the_background_write(tmp_path, monkeypatch, caplog):
    """The emergency save is synchronous: its estimate is a background save's blocking time
    plus its write, not the blocking time alone."""
    _slow_writes(monkeypatch, 0.3)
    state = _state()
    with Checkpointer(tmp_path, every_n_steps=2, grace_period=0.1, exit_on_preemption=False) as ck:
        for s in range(1, 3):  # one background save (step 2), which waits for nothing
            ck.step(s, state)
        ck.flush()
        os.kill(os.getpid(), signal.SIGTERM)
        ck.step(3, state)
    assert "a save is estimated to take" in caplog.text


def test_grace_warning_counts_the_background_saves_it_waits_for(tmp_path, monkeypatch, caplog):
    """A signal while a background save is still being written: the emergency save waits for
    it first (a slow disk, a large checkpoint). The estimate left that wait out, so a save that
    could not fit the grace period was not warned about: the scheduler's kill came with no word
    of why."""
    _slow_writes(monkeypatch, 1.0)  # every write: 1 s
    state = _state()
    with Checkpointer(tmp_path, every_n_steps=2, grace_period=1.5, exit_on_preemption=False) as ck:
        for s in range(1, 3):  # step 2: a background save, measured (about 1 s)
            ck.step(s, state)
        ck.flush()
        for s in range(3, 5):  # step 4: a background save, still being written ...
            ck.step(s, state)
        os.kill(os.getpid(), signal.SIGTERM)
        ck.step(5, state)  # ... when the emergency save (1 s more) starts: 2 s > 1.5 s
        assert ck.preempted
    assert "a save is estimated to take" in caplog.text, caplog.text
    assert "1 checkpoint(s) still being written in the background" in caplog.text


def test_a_zero_grace_period_from_the_environment_is_ignored_with_a_warning(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("RESILIENT_GRACE_PERIOD_S", "0")  # terminationGracePeriodSeconds: 0
    with Checkpointer(tmp_path) as ck:
        assert ck.watcher is not None
    assert "ignoring RESILIENT_GRACE_PERIOD_S='0'" in caplog.text


def test_step_without_a_schedule_warns_once_saying_what_still_saves(tmp_path, caplog):
    with Checkpointer(tmp_path) as ck:
        for s in range(1, 5):
            assert not ck.step(s, _state())
        assert ck.step(5, _state(), final=True)
    said = (
        "no save schedule is configured (every_n_steps / every_seconds / keep_every_n_steps / "
        "adaptive / loss_jump)"
    )
    assert caplog.text.count(said) == 1, caplog.text


def test_loss_jump_alone_is_a_trigger(tmp_path, caplog):
    with Checkpointer(tmp_path, loss_jump=0.5) as ck:
        for s in range(1, 12):
            ck.step(s, _state(), {"loss": 1.0})
        assert ck.step(12, _state(), {"loss": 5.0})
    assert "no save schedule is configured" not in caplog.text


def test_close_timeout_abandons_the_save_and_keeps_the_directory_locked_until_it_stops(
    tmp_path, gated_write
):
    ck = Checkpointer(tmp_path, every_n_steps=1)
    ck.step(1, _state())
    ck.close(timeout=0.05)
    with pytest.raises(CheckpointLockedError):
        DirLock(str(tmp_path)).acquire()  # the abandoned save still runs: still locked
    gated_write.set()
    persister = ck._saver.persister
    assert persister is not None and persister.wait_all(60)
    lock = DirLock(str(tmp_path))
    lock.acquire()  # released once it stopped
    lock.release()
    assert _steps(tmp_path) == []  # abandoned: never committed


def test_retention_keeps_a_checkpoint_a_restore_found_corrupt(tmp_path):
    state = _state()
    with Checkpointer(tmp_path, keep_last=2) as ck:
        for s in (10, 20):
            ck.save(s, state)
    shard = next(p for p in (tmp_path / "step_000000020").iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size: only a checksum tells
    shard.write_bytes(bytes(data))
    with (
        pytest.warns(UserWarning, match="skipping checkpoint"),
        Checkpointer(tmp_path, keep_last=1) as ck,
    ):
        assert ck.restore(_state()) == 10
        for s in (11, 12, 13):
            ck.save(s, state)
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("step_"))
    assert names == ["step_000000013", "step_000000020"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"if_busy": "skip", "async_save": False}, "needs async_save=True"),
        ({"max_overhead": 0.01}, "adaptive=True"),
        ({"keep_every_n_steps": True}, "keep_every_n_steps=True"),
    ],
)
def test_options_that_would_do_nothing_are_refused(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        Checkpointer(tmp_path, **options)


def test_time_blocked_in_save_outside_step_is_not_useful_compute(tmp_path, monkeypatch):
    """save() between two step() calls (a framework's final or forced save) blocks the loop:
    that time is not training compute (it used to be counted, inflating goodput). The clock
    is faked: the save's write takes 1000 s of it, whatever the machine's load."""
    import time

    real, offset = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])
    orig = persisting.layout.write_part

    def write_for_1000_s(*a, **k):
        offset[0] += 1000.0
        return orig(*a, **k)

    monkeypatch.setattr(persisting.layout, "write_part", write_for_1000_s)
    state = _state()
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.step(1, state)
        ck.save(1, state)  # blocks 1000 s of the clock
        ck.step(2, state)
        useful = ck.metrics()["resilient_ckpt_useful_seconds"]
    assert useful < 500, useful


def test_overlap_snapshot_with_accelerates_optimizer_wrapper(tmp_path):
    """accelerate.prepare() returns an AcceleratedOptimizer, an Optimizer that never ran
    Optimizer.__init__: the step hooks go on the optimizer it steps (every save failed)."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert not hasattr(opt, "_optimizer_step_pre_hooks")
    with Checkpointer(
        tmp_path, every_n_steps=1, overlap_snapshot=True, save_on_exception=True
    ) as ck:
        for step in (1, 2, 3):
            acc.backward(model(torch.randn(8, 4)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            ck.step(step, {"model": model, "optimizer": opt})
        live = model.weight.detach().clone()
    fresh = torch.nn.Linear(4, 1)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": fresh, "optimizer": torch.optim.AdamW(fresh.parameters())}) == 3
    assert torch.equal(fresh.weight, live)


def test_ctrl_c_during_a_synchronous_save_leaves_no_staging_directory(tmp_path, monkeypatch):
    """A KeyboardInterrupt mid-write (a notebook's Ctrl-C, caught, and training goes on): the
    staging directory is removed at once; it used to stay until the directory's next open."""
    root = tmp_path / "ck"
    orig = persisting.layout.write_part

    def interrupted(*a, **k):
        orig(*a, **k)  # the part is on disk, the commit not yet
        raise KeyboardInterrupt

    with Checkpointer(root, async_save=False) as ck:
        ck.save(1, _state())
        monkeypatch.setattr(persisting.layout, "write_part", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ck.save(2, _state())
        assert sorted(n for n in os.listdir(root) if n.startswith(".staging")) == []
        monkeypatch.setattr(persisting.layout, "write_part", orig)
        ck.save(3, _state())
    assert [s for s, _ in _steps(root)] == [1, 3]


def test_the_environment_can_give_each_signal_its_own_grace_period(tmp_path, monkeypatch, caplog):
    """A Slurm job's SIGUSR1 comes --signal=USR1@N seconds before the end, its SIGTERM
    KillWait (30 s by default) or GraceTime before SIGKILL: one number for both made the
    library expect N seconds after a SIGTERM (no warning that the save will not fit; close()
    waiting for uploads past the kill). RESILIENT_GRACE_PERIOD_S also takes per-source
    seconds now; the sources it leaves out keep their defaults."""
    monkeypatch.setenv("RESILIENT_GRACE_PERIOD_S", "USR1=300, SIGTERM=45")
    with Checkpointer(tmp_path) as ck:
        assert ck.watcher is not None
        grace = ck.watcher.config.grace_for
        assert (grace("SIGUSR1"), grace("SIGTERM"), grace("metadata:aws")) == (300, 45, 120)
    assert "ignoring" not in caplog.text
    monkeypatch.setenv("RESILIENT_GRACE_PERIOD_S", "SIGUSR1=300,SIGBOGUS=4")
    with Checkpointer(tmp_path) as ck:
        assert ck.watcher is not None and ck.watcher.config.grace_for("SIGUSR1") == 120
    assert "ignoring RESILIENT_GRACE_PERIOD_S='SIGUSR1=300,SIGBOGUS=4'" in caplog.text


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failure_after_the_commit_says_the_checkpoint_is_committed(
    tmp_path, monkeypatch, async_save
):
    """Rank 0's retention pass after the commit of step 2 fails (an I/O error reading the
    directory). The checkpoint had been renamed into place: it is valid and a restore takes it.
    The save was reported as stopped with its "uncommitted files removed", and recorded as a
    failed save; then it raised CheckpointWriteError saying it is committed, which stopped the
    run all the same. Now nothing is raised (one behaviour in every mode: after_commit_work.py,
    tests/test_after_commit_failure.py): ``after_commit_error`` says it is committed, what
    failed after it and what that leaves undone, and the save is recorded as committed."""
    from resilient_callbacks import history
    from resilient_callbacks.directory import Directory

    orig = Directory.apply_retention

    def failing(self, protect, policy=None):
        if protect == "step_000000002":
            raise OSError(5, "Input/output error")
        return orig(self, protect, policy)

    monkeypatch.setattr(Directory, "apply_retention", failing)
    state = _state()
    root = tmp_path / "ck"
    with Checkpointer(str(root), keep_last=1, async_save=async_save) as ck:
        ck.save(1, state)
        ck.flush()
        ck.save(2, state)
        ck.flush()
        said = ck.after_commit_error
        assert said is not None, said
        assert "step 2 was committed" in said and "a restore takes it" in said, said
        assert "OSError: [Errno 5] Input/output error" in said, said
        assert "kept until the next retention pass" in said, said
        assert "uncommitted files" not in said and "not committed" not in said, said
        assert ck.last_save is not None and ck.last_save.step == 2
        assert ck.committed_saves == 2
        ck.save(3, state)  # the next save goes on, and its retention deletes what was kept
        ck.flush()
    assert _steps(root) == [(3, "forced")]
    failed = history.records(str(root), ("save_failed",))
    assert failed == [], failed
