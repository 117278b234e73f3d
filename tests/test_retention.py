"""Retention planning (a pure function) checked with hypothesis properties, plus a few examples."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_callbacks import ConfigError
from resilient_callbacks.retention import Candidate, Mode, RetentionPolicy, plan

RUNS = ["run-A", "run-B", "run-C"]
MONITOR = "loss"


def _finite(v):
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


_metric_values = st.one_of(
    st.none(),
    st.just(float("nan")),
    st.sampled_from([float("inf"), float("-inf")]),
    st.integers(-5, 5).map(float),  # small range: plenty of ties
    st.floats(-1e6, 1e6, allow_nan=False),
)


@st.composite
def candidates(draw):
    n = draw(st.integers(0, 20))
    seqs = draw(st.permutations(list(range(1, n + 1)))) if n else []
    out = []
    for i in range(n):
        metrics = {}
        kind = draw(st.integers(0, 3))
        if kind >= 1:
            metrics[MONITOR] = draw(_metric_values)
        if kind == 2:
            metrics["acc"] = draw(st.floats(0, 1))
        if kind == 3:
            metrics = {"acc": 0.5}  # the monitored metric is absent
        out.append(
            Candidate(
                name=f"ckpt_{i}",
                step=draw(st.integers(0, 60)),
                seq=seqs[i],
                run_id=draw(st.sampled_from(RUNS)),
                metrics=metrics,
                valid=draw(st.sampled_from([True, True, True, False])),  # mostly valid
                archived=draw(st.sampled_from([False, False, False, True])),
            )
        )
    return out


@st.composite
def policies(draw):
    keep_best = draw(st.integers(0, 3))
    return RetentionPolicy(
        keep_last=draw(st.one_of(st.none(), st.integers(1, 5))),
        keep_best=keep_best,
        monitor=MONITOR if keep_best else None,
        mode=draw(st.sampled_from(["min", "max", Mode.MIN, Mode.MAX])),
        keep_every_n_steps=draw(st.one_of(st.none(), st.integers(1, 12))),
    )


@st.composite
def scenarios(draw):
    cands = draw(candidates())
    policy = draw(policies())
    run_id = draw(st.sampled_from([*RUNS, None]))
    names = [c.name for c in cands]
    protected = draw(st.lists(st.sampled_from(names), unique=True, max_size=3)) if names else []
    return cands, policy, run_id, protected


def _mine(cands, run_id):
    return [c for c in cands if (run_id is None or c.run_id == run_id) and c.valid]


def _best_threshold(mine, policy):
    """(scored candidates, value of the k-th best) using the policy's mode; None if no best pool."""
    if not policy.keep_best:
        return [], None
    scored = [c for c in mine if _finite(c.metrics.get(MONITOR))]
    if not scored:
        return [], None
    sign = 1.0 if Mode(policy.mode) is Mode.MIN else -1.0
    values = sorted(sign * c.metrics[MONITOR] for c in scored)
    return scored, values[min(policy.keep_best, len(values)) - 1]


def check_keep_and_delete_partition_all_candidates(sc, p):
    cands, _policy, _run_id, _protected = sc
    names = {c.name for c in cands}
    kept, deleted = set(p.keep), set(p.delete)
    assert kept.isdisjoint(deleted)
    assert kept | deleted == names
    assert len(p.delete) == len(deleted), "a checkpoint is listed twice for deletion"
    assert all(p.keep[n] for n in kept), "every kept checkpoint has a reason"


def check_newest_valid_of_current_run_is_never_deleted(sc, p):
    cands, _policy, run_id, _protected = sc
    mine = _mine(cands, run_id)
    if mine:
        newest = max(mine, key=lambda c: c.seq)
        assert newest.name not in p.delete


def check_other_runs_corrupt_and_protected_are_never_deleted(sc, p):
    cands, _policy, run_id, protected = sc
    deleted = set(p.delete)
    for c in cands:
        if run_id is not None and c.run_id != run_id:
            assert c.name not in deleted, f"deleted {c.name} of another run"
        if not c.valid:
            assert c.name not in deleted, f"deleted corrupt {c.name}"
        if c.name in protected:
            assert c.name not in deleted, f"deleted protected {c.name}"


def check_best_by_mode_are_kept(sc, p):
    cands, policy, run_id, _protected = sc
    scored, kth = _best_threshold(_mine(cands, run_id), policy)
    if kth is None:
        return
    sign = 1.0 if Mode(policy.mode) is Mode.MIN else -1.0
    kept = set(p.keep)
    # strictly better than the k-th best: always kept
    for c in scored:
        if sign * c.metrics[MONITOR] < kth:
            assert c.name in kept, f"{c.name} ({c.metrics[MONITOR]}) is among the best but deleted"
    # at least k (or all scored) candidates at least as good as the k-th best are kept
    good_kept = [c for c in scored if sign * c.metrics[MONITOR] <= kth and c.name in kept]
    assert len(good_kept) >= min(policy.keep_best, len(scored))


def check_archive_steps_are_kept(sc, p):
    """Archives of the policy now, and those of the policy a checkpoint was written with."""
    cands, policy, run_id, _protected = sc
    for c in _mine(cands, run_id):
        if c.archived or (policy.keep_every_n_steps and c.step % policy.keep_every_n_steps == 0):
            assert c.name not in p.delete, f"archive step {c.step} deleted"


def check_keep_last_bounds_the_recent_pool_and_deletes_the_rest(sc, p):
    cands, policy, run_id, protected = sc
    mine = _mine(cands, run_id)
    scored, kth = _best_threshold(mine, policy)
    sign = 1.0 if Mode(policy.mode) is Mode.MIN else -1.0
    best_like = {c.name for c in scored if kth is not None and sign * c.metrics[MONITOR] <= kth}

    def special(c):
        return (
            c.name in best_like
            or c.name in protected
            or (policy.keep_every_n_steps and c.step % policy.keep_every_n_steps == 0)
            or c.archived
        )

    plain_kept = [c for c in mine if c.name in p.keep and not special(c)]
    if policy.keep_last is None:
        assert all(c.name in p.keep for c in mine)
    else:
        assert len(plain_kept) <= policy.keep_last
        # the keep_last newest are kept; anything older and not special is deleted
        by_age = sorted(mine, key=lambda c: c.seq)
        recent = {c.name for c in by_age[-policy.keep_last :]}
        for c in mine:
            if c.name in recent:
                assert c.name in p.keep
            elif not special(c):
                assert c.name in p.delete, f"{c.name} is kept for no reason"


def check_replanning_on_survivors_deletes_nothing_more(sc, p):
    cands, policy, run_id, protected = sc
    survivors = [c for c in cands if c.name in p.keep]
    p2 = plan(survivors, policy, run_id, protected=protected)
    assert p2.delete == []
    assert set(p2.keep) == {c.name for c in survivors}


def check_plan_does_not_depend_on_input_order(sc, p1):
    cands, policy, run_id, protected = sc
    p2 = plan(list(reversed(cands)), policy, run_id, protected=protected)
    assert set(p1.keep) == set(p2.keep) and p1.delete == p2.delete


def check_delete_list_is_oldest_first(sc, p):
    cands, _policy, _run_id, _protected = sc
    seq = {c.name: c.seq for c in cands}
    assert [seq[n] for n in p.delete] == sorted(seq[n] for n in p.delete)


CHECKS = [
    check_keep_and_delete_partition_all_candidates,
    check_newest_valid_of_current_run_is_never_deleted,
    check_other_runs_corrupt_and_protected_are_never_deleted,
    check_best_by_mode_are_kept,
    check_archive_steps_are_kept,
    check_keep_last_bounds_the_recent_pool_and_deletes_the_rest,
    check_replanning_on_survivors_deletes_nothing_more,
    check_plan_does_not_depend_on_input_order,
    check_delete_list_is_oldest_first,
]


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_retention_properties(sc):
    """All invariants, on the same random scenarios (one generation, many checks)."""
    cands, policy, run_id, protected = sc
    p = plan(cands, policy, run_id, protected=protected)
    for check in CHECKS:
        check(sc, p)


# --------------------------------------------------------------------------- examples


def _c(i, step=None, run="r", loss=None, valid=True):
    return Candidate(
        f"c{i}", i if step is None else step, i, run, {} if loss is None else {MONITOR: loss}, valid
    )


def test_example_keep_last_and_best_min():
    cands = [_c(1, loss=5.0), _c(2, loss=1.0), _c(3, loss=3.0), _c(4, loss=4.0), _c(5, loss=2.0)]
    p = plan(cands, RetentionPolicy(keep_last=2, keep_best=1, monitor=MONITOR, mode="min"), "r")
    assert sorted(p.keep) == ["c2", "c4", "c5"]
    assert p.delete == ["c1", "c3"]


def test_example_keep_best_keeps_the_earliest_of_tied_scores():
    """A later checkpoint is better only if strictly so (the Trainer's best_global_step,
    Lightning's save_top_k): the newest of the ties was kept, and the first deleted."""
    cands = [_c(1, loss=3.0), _c(2, loss=1.0), _c(3, loss=2.0), _c(4, loss=1.0), _c(5, loss=1.0)]
    for mode, sign in (("min", 1.0), ("max", -1.0)):
        scaled = [_c(c.seq, loss=sign * c.metrics[MONITOR]) for c in cands]
        p = plan(scaled, RetentionPolicy(keep_last=1, keep_best=1, monitor=MONITOR, mode=mode), "r")
        assert sorted(p.keep) == ["c2", "c5"], mode
        assert p.delete == ["c1", "c3", "c4"], mode


def test_example_keep_best_two_keeps_the_earliest_of_ties_at_every_rank():
    """keep_best >= 2: the K first by value, then by commit order (docs/guide.md), whatever
    order the candidates come in. Lightning's save_top_k=2 would keep c2 and c3 here (a better
    value evicts the earliest of the tied worst); keep_best=2 keeps c1 and c3, as a tie with
    the worst kept is never let in (c4)."""
    cands = [_c(1, loss=1.0), _c(2, loss=1.0), _c(3, loss=0.5), _c(4, loss=1.0), _c(5, loss=9.0)]
    policy = RetentionPolicy(keep_last=1, keep_best=2, monitor=MONITOR, mode="min")
    for order in (cands, cands[::-1], cands[2:] + cands[:2]):
        p = plan(order, policy, "r")
        assert sorted(p.keep) == ["c1", "c3", "c5"]
        assert p.keep["c1"] == [f"best {MONITOR}=1"] and p.delete == ["c2", "c4"]


def test_example_keep_best_max_ignores_nan_and_none():
    cands = [
        _c(1, loss=float("nan")),
        _c(2, loss=None),
        _c(3, loss=2.0),
        _c(4, loss=float("inf")),
        _c(5, loss=1.0),
        _c(6, loss=0.5),
    ]
    p = plan(cands, RetentionPolicy(keep_last=1, keep_best=1, monitor=MONITOR, mode="max"), "r")
    assert sorted(p.keep) == ["c3", "c6"]


def test_example_everything_corrupt_or_foreign_is_kept():
    cands = [_c(1, run="old"), _c(2, valid=False), _c(3), _c(4)]
    p = plan(cands, RetentionPolicy(keep_last=1), "r")
    assert sorted(p.keep) == ["c1", "c2", "c4"] and p.delete == ["c3"]


def test_example_run_id_none_counts_everything():
    cands = [_c(1, run="old"), _c(2, run="new"), _c(3, run="new")]
    p = plan(cands, RetentionPolicy(keep_last=1), None)
    assert p.delete == ["c1", "c2"]


def test_example_archive():
    cands = [_c(i, step=10 * i) for i in range(1, 8)]
    p = plan(cands, RetentionPolicy(keep_last=1, keep_every_n_steps=30), "r")
    assert sorted(p.keep) == ["c3", "c6", "c7"]


def test_empty():
    p = plan([], RetentionPolicy(keep_last=1), "r")
    assert p.keep == {} and p.delete == []


@pytest.mark.parametrize(
    "kw",
    [
        {"keep_last": 0},
        {"keep_last": -1},
        {"keep_best": 1},
        {"monitor": "loss"},
        {"keep_best": 1, "monitor": "loss", "mode": "avg"},
        {"keep_every_n_steps": 0},
        {"keep_best": -1},
    ],
)
def test_policy_validation(kw):
    with pytest.raises(ConfigError):
        RetentionPolicy(**kw)


def test_a_checkpoint_a_later_run_opens_keeps_its_best_and_archives(tmp_path):
    """A run with keep_last=1, keep_best=1 and archives every 25 steps; then an evaluation
    opens the directory with keep_last=1 and only restores: the restore's catch-up retention
    used its options and deleted the best and the archives (probe). Then a run with other
    options saves: the archives are still kept (kept forever), the best is its own call."""
    import torch

    from resilient_callbacks import Checkpointer

    d = tmp_path / "ck"
    state = {"w": torch.zeros(4)}
    kw = {"keep_best": 1, "monitor": "val", "keep_every_n_steps": 25}
    with Checkpointer(d, every_n_steps=5, keep_last=1, async_save=False, **kw) as ck:
        for step in range(1, 61):
            state["w"] += 1
            ck.step(step, state, metrics={"val": abs(step - 15)})

    def steps() -> list[int]:
        return sorted(int(n.split("_")[1]) for n in os.listdir(d) if n.startswith("step_"))

    assert steps() == [15, 25, 50, 60]
    with Checkpointer(d, keep_last=1) as ck:
        assert ck.restore(state) == 60
    assert steps() == [15, 25, 50, 60]
    with Checkpointer(d, every_n_steps=5, keep_last=1, async_save=False) as ck:
        start = ck.restore(state)
        for step in range(start + 1, start + 11):
            ck.step(step, state)
    assert steps() == [25, 50, 70]
    # the way to delete archives: gc --drop-archives
    from resilient_callbacks.cli import main

    assert main(["gc", str(d), "--drop-archives"]) == 0
    assert steps() == [70]
