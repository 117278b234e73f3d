"""The adaptive schedule wired into the Checkpointer: it measures step time and save cost,
learns MTBF from the directory's restart history, and saves at the interval it explains."""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import time

import pytest
import torch

from resilient_callbacks import Checkpointer, ConfigError, history
from resilient_callbacks.adaptive import daly_interval


def _loop(ck: Checkpointer, state: dict, start: int, n: int, step_s: float) -> list[int]:
    saved = []
    for s in range(start + 1, start + n + 1):
        time.sleep(step_s)  # "training"
        with torch.no_grad():
            state["w"].add_(1.0)
        if ck.step(s, state):
            saved.append(s)
    return saved


def test_adaptive_saves_at_the_interval_it_explains(tmp_path):
    state = {"w": torch.zeros(1000)}
    # Daly's interval never exceeds about the MTBF: with 0.0001 h (0.36 s) it is at most ~70 steps
    # of 5 ms however slow a save is on a loaded machine (a 1-10 ms save gives ~20-50 steps). The
    # loop runs until four saves, so the number of saves does not depend on the machine's speed.
    with Checkpointer(
        tmp_path / "ck", adaptive=True, mtbf_hours=0.0001, max_overhead=None, async_save=False
    ) as ck:
        ck.restore(state)
        saved: list[int] = []
        done = 0
        while len(saved) < 4 and done < 2000:
            saved += _loop(ck, state, done, 40, 0.005)
            done += 40
        assert ck.schedule is not None
        info = ck.schedule.explain()
        steps = ck.schedule.interval_steps()
    assert saved, "the adaptive schedule never saved"
    assert saved[0] <= 25  # first save right after the warm-up, to measure the cost
    gaps = [b - a for a, b in itertools.pairwise(saved)]
    assert gaps and max(gaps) <= 3 * steps and min(gaps) >= max(1, steps // 3), (gaps, steps)
    text = json.dumps(info)
    for key in ("mtbf", "step", "cost"):
        assert key in text, info
    manifest = json.loads((tmp_path / "ck" / f"step_{saved[-1]:09d}" / "manifest.json").read_text())
    assert "schedule" in manifest["extra"]


def test_restarts_are_recorded_and_learned(tmp_path):
    root = tmp_path / "ck"
    state = {"w": torch.zeros(10)}
    with Checkpointer(root, every_n_steps=5) as ck:
        ck.restore(state)
        _loop(ck, state, 0, 10, 0.0)
    for _ in range(2):  # resumes, each ending with the training loop raising
        ck = Checkpointer(root, every_n_steps=5, adaptive=True)
        assert ck.restore(state) == 10
        ck.abort(RuntimeError("the training loop failed"))
    events = history.read(str(root))
    assert [e.event for e in events] == ["start", "restart", "restart"]
    with Checkpointer(root, adaptive=True) as ck:
        ck.restore(state)
        assert ck.schedule is not None
        # the first restart followed a clean close: no failure; the two after a failed one are
        assert ck.schedule.failures_observed == 2
        assert ck.schedule.mtbf_source() == "learned"


def test_loss_jump_triggers_an_extra_save(tmp_path, caplog):
    state = {"w": torch.zeros(4)}
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(tmp_path / "ck", every_n_steps=1000, loss_jump=0.5, async_save=False) as ck:
        saved = [s for s in range(1, 30) if ck.step(s, state, metrics={"loss": 1.0})]
        assert saved == []
        assert ck.step(30, state, metrics={"loss": 5.0}) is True
        assert ck.step(31, state, metrics={"loss": 5.1}) is False  # once per excursion
    assert any("saved step 30 (loss jump" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mtbf_hours": 4}, "adaptive=True"),
        ({"loss_jump": -1}, "loss_jump"),
        ({"preemption_exit_code": 300}, "exit status"),
        ({"preemption": False, "metadata_notices": "aws"}, "preemption=True"),
        ({"adaptive": True, "max_overhead": 2.0}, "max_overhead"),
    ],
)
def test_invalid_policy_options(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        Checkpointer(tmp_path / "ck", **kw)


def test_live_interval_matches_daly_within_10_percent(tmp_path):
    """With a measured save cost and a configured MTBF, the interval chosen is Daly's optimum."""
    state = {"w": torch.zeros(2_000_000)}  # 8 MB: a save costs a few ms, measured for real
    mtbf_hours = 0.002
    with Checkpointer(
        tmp_path / "ck",
        adaptive=True,
        mtbf_hours=mtbf_hours,
        max_overhead=None,
        async_save=False,
        preemption=False,
    ) as ck:
        ck.restore(state)
        _loop(ck, state, 0, 120, 0.002)
        assert ck.schedule is not None
        # what the training loop really waited; the process's first save (set-up) is
        # replaced by its next one (test_adaptive.py)
        saves = list(ck._save_seconds)
        cost = statistics.median(saves[1:] or saves)
        want = daly_interval(cost, mtbf_hours * 3600)
        got = ck.schedule.interval_seconds()
    assert abs(got - want) <= 0.10 * want, (got, want, ck.schedule.explain())


def _until_the_first_save(ck: Checkpointer, state: dict) -> int:
    """Step until the first (warm-up) save has committed; the last step."""
    step = 0
    while not ck.last_save:
        step += 1
        ck.step(step, state)
    return step


@pytest.mark.parametrize("background", [False, True])
def test_the_manifest_counts_the_save_that_wrote_it(tmp_path, background):
    """A resume from the first (warm-up) checkpoint does not warm up again: the schedule state
    in its manifest counts that save (a synchronous save was counted only after its commit)."""
    from resilient_callbacks.manifest import read_manifest

    state = {"w": torch.zeros(8)}
    with Checkpointer(tmp_path, adaptive=True, async_save=background, preemption=False) as ck:
        _until_the_first_save(ck, state)
        ck.flush()
        path = ck.last_save.path
    assert read_manifest(path).extra["schedule"]["n_saves"] == 1


def _slow_commit(monkeypatch, seconds: float) -> None:
    """Every commit (manifest, fsyncs, rename) takes ``seconds`` longer, as on a slow NFS."""
    from resilient_callbacks import session

    commit = session.CommitSession.commit

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(session.CommitSession, "commit", slow)


def test_a_synchronous_saves_cost_counts_its_commit(tmp_path, monkeypatch):
    """The schedule measured a synchronous save's cost before its commit (so that the manifest
    counts the save), and kept that: a slow commit was left out and saves came too often. The
    cost it uses is now what the loop waited, commit included."""
    _slow_commit(monkeypatch, 0.3)
    state = {"w": torch.zeros(8)}
    with Checkpointer(tmp_path, adaptive=True, async_save=False, preemption=False) as ck:
        _until_the_first_save(ck, state)
        assert ck.schedule is not None
        cost = ck.schedule.blocking_cost_s()
        assert cost is not None and cost >= 0.3, ck.schedule.explain()
        assert ck._save_seconds[-1] >= 0.3


def test_the_first_decision_after_warm_up_has_the_persist_floor(tmp_path, monkeypatch):
    """The persist floor (never save faster than a save persists) came from the persist times
    the next save carried in: between the warm-up save and the next one there was none, and a
    short first interval made the second save wait for the first. Now the floor applies as
    soon as the first background save is durable. The MTBF (3.6 ms) keeps Daly's interval
    below 3 MTBFs (~11 ms) whatever the save costs, so the persist floor (>= 0.5 s) is what
    binds on however slow a machine (with 0.18 s, a snapshot of 0.7 s would have bound)."""
    _slow_commit(monkeypatch, 0.5)
    state = {"w": torch.zeros(8)}
    with Checkpointer(
        tmp_path, adaptive=True, mtbf_hours=1e-6, max_overhead=None, preemption=False
    ) as ck:
        step = 0
        while ck.last_saved_step is None:
            step += 1
            ck.step(step, state)
        ck.flush()  # the warm-up save is durable: its persist time is known
        assert not ck.step(step + 1, state)  # the decision after it (warm-up over)
        assert ck.schedule is not None
        info = ck.schedule.explain()
        assert info["daly_interval_s"] < 0.012, info
        assert info["clamp"] == "persist" and info["bounds_s"]["persist"] >= 0.5, info
        per_step = info["step_time_s"]
        assert ck.schedule.interval_steps() * per_step >= 0.5 * (1 - 1e-9), info


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_an_emergency_save_is_not_a_save_cost_of_a_background_schedule(tmp_path, background):
    """With background saves the schedule's cost is the snapshot the loop waits for, but an
    emergency save (preemption, save_on_exception) is synchronous: its whole write entered
    the median, and its checkpoint, the one the next life resumes from, carried it on. Runs
    preempted more often than they save periodically then measured the write, not the
    snapshot, and saved too rarely. It is left out now; with async_save=False an emergency
    save is a save like the others and still counts."""
    from resilient_callbacks.manifest import read_manifest

    state = {"w": torch.zeros(8)}
    with Checkpointer(
        tmp_path, adaptive=True, async_save=background, exit_on_preemption=False
    ) as ck:
        step = _until_the_first_save(ck, state)
        ck.flush()
        assert ck.schedule is not None
        before = list(ck.schedule.state_dict()["costs"])
        assert ck.watcher is not None
        ck.watcher.trigger("manual")
        assert ck.step(step + 1, state) and ck.preempted
        assert ck.last_save is not None and ck.last_save.reason == "emergency"
        saved = read_manifest(ck.last_save.path).extra["schedule"]
        now = ck.schedule.state_dict()
        emergency_cost = ck._save_seconds[-1]
    if background:
        assert now["costs"] == before and now["n_saves"] == 1, now
        assert saved["costs"] == before and saved["n_saves"] == 1, saved
    else:  # (it replaces the process's first save, a set-up cost: test_adaptive.py)
        assert now["costs"] == [emergency_cost] and now["n_saves"] == 2, now
        assert saved["n_saves"] == 2, saved


DAY = 86400.0


def _shift_history(root, seconds: float) -> None:
    """Move every record so far ``seconds`` into the past: those lives ran back then."""
    path = root / "history.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        r["time"] -= seconds
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_the_time_a_run_was_down_is_no_exposure_to_failures(tmp_path):
    """The learned MTBF divided the wall time since the run's first start by the failures, so
    the days a requeued job waited in the queue, or a finished run sat before it was
    extended, counted as failure-free running: one failure in minutes of training, 40 days
    after the start, gave an MTBF of 20 days and saves ~10x too rare. Only the time the run's
    processes ran counts now, in the schedule, the metrics and the report."""
    from resilient_callbacks.report import analyse

    root, state = tmp_path / "ck", {"w": torch.zeros(10)}
    with Checkpointer(root, every_n_steps=5, preemption=False) as ck:  # ran, closed cleanly
        ck.restore(state)
        _loop(ck, state, 0, 10, 0.0)
    _shift_history(root, 30 * DAY)  # ... 30 days ago; resumed 20 days later, and failed:
    ck = Checkpointer(root, every_n_steps=5, preemption=False)
    assert ck.restore(state) == 10
    _loop(ck, state, 10, 5, 0.0)
    ck.abort(RuntimeError("the training loop failed"))
    _shift_history(root, 10 * DAY)  # ... 10 days ago
    prior = 24 * 3600.0
    with Checkpointer(root, every_n_steps=5, adaptive=True, preemption=False) as ck:
        ck.restore(state)
        assert ck.schedule is not None
        info = ck.schedule.explain()
        mtbf_metric = ck.metrics()["resilient_ckpt_mtbf_seconds"]
    assert info["failures_observed"] == 1
    assert info["exposure_s"] < 3600, info  # seconds of training, not 40 days
    assert info["mtbf_s"] == pytest.approx((prior + info["exposure_s"]) / 2)
    assert mtbf_metric < prior
    with Checkpointer(root, every_n_steps=5, preemption=False) as ck:  # not adaptive: metrics
        ck.restore(state)
        assert ck.metrics()["resilient_ckpt_mtbf_seconds"] < prior
    summary = analyse(str(root))["summary"]
    assert summary["failures"] == 1 and summary["wall_s"] > 40 * DAY
    assert summary["exposure_s"] < 3600 and summary["mtbf_observed_s"] < 3600, summary


def test_a_second_restore_in_the_same_process_is_no_restart(tmp_path):
    """restore() again in a running process (a roll-back to the newest checkpoint after a
    divergence, or after a fresh start that has saved since) recorded a 'restart' with no
    'end' before it: a failure, though no process died. It is a 'restore' record now; the
    next process's resume counts as before."""
    root, state = tmp_path / "ck", {"w": torch.zeros(4)}
    with Checkpointer(root, every_n_steps=2, adaptive=True) as ck:
        assert ck.restore(state) == 0  # a fresh start
        _loop(ck, state, 0, 4, 0.0)
        ck.flush()
        assert ck.restore(state) == 4  # again: the checkpoint this process saved
        _loop(ck, state, 4, 4, 0.0)
        ck.flush()
        assert ck.restore(state) == 8  # and again
        assert ck.schedule is not None and ck.schedule.failures_observed == 0
        assert ck.metrics()["resilient_ckpt_restarts_total"] == 0
    kinds = [r["event"] for r in history.records(str(root), ("start", "restart", "restore"))]
    assert kinds == ["start", "restore", "restore"]
    ck = Checkpointer(root, every_n_steps=2, adaptive=True)  # the next process: a restart
    assert ck.restore(state) == 8
    ck.abort(RuntimeError("the training loop failed"))
    with Checkpointer(root, adaptive=True) as ck:
        ck.restore(state)
        assert ck.schedule is not None and ck.schedule.failures_observed == 1


def test_a_run_started_from_another_directorys_checkpoint_has_no_failures_of_its_own(tmp_path):
    """A run started in a directory from a checkpoint elsewhere (resume=<path>: fine-tuning
    from a pre-trained run) is a new run, and the metrics counted no failure for it; but the
    schedule learned its MTBF from every run's restarts in the directory, the failures of an
    earlier, unrelated run included, and saved more often for them."""
    old, other, state = tmp_path / "old", tmp_path / "other", {"w": torch.zeros(4)}
    with Checkpointer(old, every_n_steps=5, preemption=False) as ck:
        ck.restore(state)
        _loop(ck, state, 0, 10, 0.0)
    for _ in range(3):  # the earlier run failed three times
        ck = Checkpointer(old, every_n_steps=5, preemption=False)
        ck.restore(state)
        ck.abort(RuntimeError("the training loop failed"))
    with Checkpointer(other, every_n_steps=5, preemption=False) as ck:
        ck.restore(state)
        _loop(ck, state, 0, 5, 0.0)
        ck.flush()
        assert ck.last_save is not None
        elsewhere = ck.last_save.path
    with Checkpointer(old, adaptive=True, preemption=False, resume=elsewhere) as ck:
        assert ck.restore(state) == 5
        assert ck.schedule is not None
        assert ck.metrics()["resilient_ckpt_restarts_total"] == 0
        assert ck.schedule.failures_observed == 0, ck.schedule.explain()
        assert ck.schedule.mtbf_source() == "prior"


class _Slow:
    """A state entry whose restore takes ``seconds`` of the Checkpointer's step clock."""

    def __init__(self, clock: list[float], seconds: float) -> None:
        self.clock, self.seconds, self.v = clock, seconds, 0

    def state_dict(self) -> dict:
        return {"v": self.v}

    def load_state_dict(self, sd: dict) -> None:
        self.clock[0] += self.seconds
        self.v = sd["v"]


def test_a_roll_back_restore_is_not_a_training_step(tmp_path):
    """restore() again in a running process (a roll-back) left the step clock running: the
    step after it measured the restore, and the training done since the last step() that the
    roll-back discarded, as one training step (here 100 s for steps of 1 s), in the schedule's
    step times and the useful compute of the metrics."""
    clock = [0.0]
    state = {"w": torch.zeros(4), "slow": _Slow(clock, 100.0)}
    with Checkpointer(tmp_path / "ck", every_n_steps=2, adaptive=True, async_save=False) as ck:
        ck._trigger.now = lambda: clock[0]
        ck.restore(state)
        for s in range(1, 5):
            clock[0] += 1.0
            ck.step(s, state)
        assert ck.restore(state) == 4  # the roll-back: 100 s on the step clock
        clock[0] += 1.0
        ck.step(5, state)
        assert list(ck._trigger.step_seconds) == [1.0] * 4, list(ck._trigger.step_seconds)
        assert ck._trigger.compute_s == 4.0


def _calls_between_saves(root, stride: int) -> list[int]:
    """Which step() calls (1-based) saved, for a caller whose step number advances by
    ``stride`` per call and whose calls are 1 s of compute apart; save costs injected."""
    clock, calls = [0.0], []
    state = {"w": torch.zeros(4)}
    with Checkpointer(root, adaptive=True, mtbf_hours=1.2, async_save=False) as ck:
        ck._trigger.now = lambda: clock[0]
        sched = ck.schedule
        assert sched is not None
        save, amend, persist = sched.observe_save, sched.amend_last_cost, sched.observe_persist
        sched.observe_save = lambda _b, p=None: save(0.005, None if p is None else 0.01)
        sched.amend_last_cost = lambda _b: amend(0.005)
        sched.observe_persist = lambda _p: persist(0.01)
        for call in range(1, 121):
            clock[0] += 1.0
            if ck.step(call * stride, state):
                calls.append(call)
        assert list(ck._trigger.step_seconds)[-1] == 1.0 / stride
    return calls


def test_the_adaptive_interval_is_in_time_whatever_the_step_numbers_advance_by(tmp_path):
    """Step times were measured per step() call but the interval is counted in step numbers:
    a caller whose step advances by 2 per call (Lightning's ``global_step`` with two manual
    optimizers) saved twice as often as the policy chose (by 4096 for a token count)."""
    by_one = _calls_between_saves(tmp_path / "one", 1)
    by_two = _calls_between_saves(tmp_path / "two", 2)
    # the warm-up is in step numbers (20: 20 calls, or 10); after it, Daly's sqrt(2 x 0.005 x
    # 4320) = 6.6 s of compute between saves: 7 calls either way (13 numbers of 0.5 s, or 7 of 1 s)
    assert by_one[0] == 20 and by_two[0] == 10, (by_one, by_two)
    assert {b - a for a, b in itertools.pairwise(by_one[1:])} == {7}, by_one
    assert {b - a for a, b in itertools.pairwise(by_two[1:])} == {7}, by_two


def test_a_step_that_is_no_int_is_refused_by_name_under_the_adaptive_policy(tmp_path):
    """The step-number spans of the step times took a step passed as a tensor into the
    schedule: step() failed with a ConfigError about ``seconds=tensor(...)`` instead of
    saying what was wrong (the step)."""
    with (
        Checkpointer(tmp_path, adaptive=True) as ck,
        pytest.raises(TypeError, match="step must be an int"),
    ):
        for s in range(1, 40):
            ck.step(torch.tensor(s), {"w": torch.zeros(2)})
