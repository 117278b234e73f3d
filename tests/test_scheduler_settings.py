"""torch LR scheduler settings changed between runs: the restore loads what torch's own
``load_state_dict`` loads (the checkpoint's settings where the state dict holds them, the new
code's functions where it does not) and refuses nothing torch accepts; settings the state
dict holds that differ from those the new code passed are named in a warning."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.optim import lr_scheduler

from resilient_callbacks import Checkpointer


def _built(kind: str, value: float):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if kind == "cosine":
        sched = lr_scheduler.CosineAnnealingLR(opt, T_max=int(value))
    elif kind == "onecycle":
        sched = lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=int(value))
    elif kind == "lambda":
        sched = lr_scheduler.LambdaLR(opt, lambda e, v=value: v**e)
    elif kind == "cyclic":  # (base_lr: its base_lrs, a setting here, not the groups')
        sched = lr_scheduler.CyclicLR(opt, base_lr=value, max_lr=1.0, step_size_up=3)
    elif kind == "multiplicative":
        sched = lr_scheduler.MultiplicativeLR(opt, lambda e, v=value: v)
    else:  # sequential: the second scheduler's milestones, nested in the state dict
        steps = lr_scheduler.MultiStepLR(opt, milestones=[int(value)])
        warm = lr_scheduler.LinearLR(opt, 0.5, total_iters=2)
        sched = lr_scheduler.SequentialLR(opt, [warm, steps], milestones=[2])
    return {"model": model, "opt": opt, "sched": sched}


def _lrs(state, n: int) -> list[float]:
    out = []
    for _ in range(n):
        state["opt"].step()
        state["sched"].step()
        out.append(state["opt"].param_groups[0]["lr"])
    return out


@pytest.mark.parametrize(
    ("kind", "before", "after", "said"),
    [
        ("cosine", 10, 100, "T_max=10 from the checkpoint (100 here)"),
        ("onecycle", 20, 200, "total_steps=20 from the checkpoint (200 here)"),
        ("sequential", 4, 6, "_schedulers[1].milestones={4: 1} from the checkpoint ({6: 1} here)"),
        ("cyclic", 0.1, 0.3, "base_lrs=[0.1] from the checkpoint ([0.3] here)"),
        ("lambda", 0.5, 0.9, None),  # its function is code, not state: the new one applies
        ("multiplicative", 0.5, 0.9, None),
    ],
)
def test_changed_scheduler_settings_resume_as_torch_loads_them_and_are_named(
    tmp_path, kind, before, after, said
):
    first = _built(kind, before)
    _lrs(first, 3)
    saved = {k: copy.deepcopy(first[k].state_dict()) for k in ("opt", "sched")}
    with Checkpointer(tmp_path) as ck:
        ck.save(3, first)
    plain = _built(kind, after)  # torch's own resume of the same state dicts
    plain["opt"].load_state_dict(saved["opt"])
    plain["sched"].load_state_dict(saved["sched"])
    ours = _built(kind, after)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(tmp_path) as ck:
            assert ck.restore(ours) == 3
    assert _lrs(ours, 4) == _lrs(plain, 4)
    named = [str(w.message) for w in caught if "scheduler" in str(w.message)]
    if said is None:
        assert named == []
    else:
        assert len(named) == 1, named
        assert f"state['sched'] ({type(ours['sched']).__name__}): {said}" in named[0], named
        assert "set them on the scheduler after restore()" in named[0], named


def test_unchanged_scheduler_settings_resume_without_a_word(tmp_path):
    first = _built("onecycle", 20)
    _lrs(first, 3)
    with Checkpointer(tmp_path) as ck:
        ck.save(3, first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpointer(tmp_path) as ck:
            assert ck.restore(_built("onecycle", 20)) == 3


@pytest.mark.parametrize("restarts", [1, 2])
def test_warm_restarts_progress_is_no_setting(tmp_path, restarts):
    """Found 2026-12-07: CosineAnnealingWarmRestarts keeps where it is in the current cycle
    (T_cur) and that cycle's length (T_i, grown by T_mult at each restart) beside its settings:
    an unchanged resume was warned about as 'T_cur=3 from the checkpoint (0 here)'. Those are
    progress; a changed T_0 is still named."""

    def built(t_0: int):
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        warm = lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=t_0, T_mult=restarts)
        sched = lr_scheduler.SequentialLR(opt, [lr_scheduler.ConstantLR(opt), warm], [1])
        return {"model": model, "opt": opt, "sched": sched}

    # 6 steps: past the first restart (T_i is 4 with T_mult=2)
    (said,) = _saved_then_restored(tmp_path, built(2), built(3), steps=6, same=built(2))
    assert "_schedulers[1].T_0=2 from the checkpoint (3 here)" in said
    assert "T_cur" not in said and "T_i=" not in said


class _Decay:
    """A LambdaLR factor that is an object: its attributes are the state dict's (a tensor)."""

    def __init__(self, rates: list[float]) -> None:
        self.rates = torch.tensor(rates)

    def __call__(self, epoch: int) -> float:
        return float(self.rates[min(epoch, len(self.rates) - 1)])


def test_a_tensor_a_callable_factor_holds_is_compared_by_its_values(tmp_path):
    """Found 2026-12-07: a tensor of more than one element in a scheduler's state dict (an
    attribute of a LambdaLR's callable object) has no truth value for ==, so it compared
    unequal to itself and every unchanged resume warned 'lr_lambdas[0].rates=tensor([...])
    from the checkpoint (tensor([...]) here)'. Equal values say nothing; other values are
    named."""

    def built(rates: list[float]):
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return {"model": model, "opt": opt, "sched": lr_scheduler.LambdaLR(opt, _Decay(rates))}

    first, same = built([1.0, 0.5, float("nan")]), built([1.0, 0.5, float("nan")])
    (said,) = _saved_then_restored(tmp_path, first, built([1.0, 0.25, float("nan")]), 1, same)
    assert "lr_lambdas[0].rates=tensor([1.0000, 0.5000,    nan]) from the checkpoint" in said


def _saved_then_restored(tmp_path, first, again, steps: int = 3, same=None):
    """Save ``first`` after ``steps`` steps; restore into ``same`` (if given: nothing may be
    said), then into ``again``; the scheduler warnings the latter said."""
    _lrs(first, steps)
    with Checkpointer(tmp_path) as ck:
        ck.save(steps, first)
    if same is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with Checkpointer(tmp_path) as ck:
                assert ck.restore(same) == steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(tmp_path) as ck:
            assert ck.restore(again) == steps
    return [str(w.message) for w in caught if "scheduler" in str(w.message)]


def _with(sched_of):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return {"model": model, "opt": opt, "sched": sched_of(opt)}


@pytest.mark.parametrize(
    ("make", "before", "after", "said"),
    [
        (lambda o, v: lr_scheduler.StepLR(o, step_size=v), 2, 5, "step_size=2 "),
        (lambda o, v: lr_scheduler.StepLR(o, 3, gamma=v), 0.5, 0.25, "gamma=0.5 "),
        (lambda o, v: lr_scheduler.MultiStepLR(o, [v]), 2, 4, "milestones={2: 1} "),
        (lambda o, v: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=v), 2, 3, "T_0=2 "),
        (lambda o, v: lr_scheduler.ReduceLROnPlateau(o, min_lr=v), 0.1, 0.2, "min_lrs=[0.1] "),
    ],
)
def test_settings_named_are_those_the_scheduler_is_built_with(tmp_path, make, before, after, said):
    first = _with(lambda o: make(o, before))
    if isinstance(first["sched"], lr_scheduler.ReduceLROnPlateau):
        first["sched"].step(1.0)
    with Checkpointer(tmp_path) as ck:
        ck.save(3, first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(tmp_path) as ck:
            assert ck.restore(_with(lambda o: make(o, after))) == 3
    (named,) = [str(w.message) for w in caught if "scheduler" in str(w.message)]
    assert said in named, named


class _Warmup(lr_scheduler.LRScheduler):
    """A user's scheduler: its progress (``seen``, ``_ramp``) kept in its ``__dict__``."""

    def __init__(self, optimizer, warmup: int) -> None:
        self.warmup = warmup
        self.seen = 0
        self._ramp = [0.0]
        super().__init__(optimizer)

    def get_lr(self):
        self.seen += 1
        self._ramp.append(min(1.0, self.last_epoch / self.warmup))
        return [b * self._ramp[-1] for b in self.base_lrs]


def test_a_users_scheduler_progress_is_no_setting(tmp_path):
    """Found 2026-12-07: every key of a state dict that torch's own schedulers do not know as
    progress was a setting, so a user's LRScheduler subclass keeping a counter warned on
    every unchanged resume ('seen=4 from the checkpoint (1 here)'). Settings are the keys
    that name a parameter of its __init__: a changed ``warmup`` is still named."""
    said = _saved_then_restored(
        tmp_path, _with(lambda o: _Warmup(o, 4)), _with(lambda o: _Warmup(o, 4))
    )
    assert said == []
    said = _saved_then_restored(
        tmp_path / "b", _with(lambda o: _Warmup(o, 4)), _with(lambda o: _Warmup(o, 8))
    )
    assert len(said) == 1 and "(_Warmup): warmup=4 from the checkpoint (8 here)" in said[0], said


def test_a_key_an_older_torch_did_not_save_is_no_setting(tmp_path):
    """Found 2026-12-07: OneCycleLR's ``_anneal_func_type`` (added by a newer torch) is not in
    an older torch's checkpoint; torch keeps the live value, yet the restore warned
    '_anneal_func_type not in the checkpoint, yours kept'. Nothing is replaced: no word."""
    first = _built("onecycle", 20)
    _lrs(first, 3)
    del first["sched"].__dict__["_anneal_func_type"]  # the state dict an older torch saved
    with Checkpointer(tmp_path) as ck:
        ck.save(3, first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpointer(tmp_path) as ck:
            assert ck.restore(_built("onecycle", 20)) == 3


@pytest.mark.parametrize("old_is_object", [True, False])
def test_a_factor_switched_between_function_and_object_is_no_setting(tmp_path, old_is_object):
    """Found 2026-12-07: a LambdaLR factor changed from a function to a callable object (or
    back) warned 'lr_lambdas=[None] from the checkpoint ([{...}] here)', though torch's load
    leaves the new factor in place; the learning rates are those of torch's own resume."""

    def built(obj: bool):
        factor = _Decay([1.0, 0.5, 0.25]) if obj else (lambda e: 0.9**e)
        return _with(lambda o: lr_scheduler.LambdaLR(o, factor))

    first = built(old_is_object)
    saved = _lrs(first, 3) and copy.deepcopy(first["sched"].state_dict())
    plain = built(not old_is_object)
    plain["sched"].load_state_dict(saved)
    ours = built(not old_is_object)
    with Checkpointer(tmp_path) as ck:
        ck.save(3, first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpointer(tmp_path) as ck:
            assert ck.restore(ours) == 3
    ours["opt"].load_state_dict(first["opt"].state_dict())
    plain["opt"].load_state_dict(first["opt"].state_dict())
    assert _lrs(ours, 3) == _lrs(plain, 3)


def test_long_values_that_differ_at_their_end_read_apart(tmp_path):
    """Found 2026-12-07: values were cut at 60 characters, so two milestone lists differing
    only at their end were named as 'milestones={10: 1, ...} from the checkpoint ({10: 1,
    ...} here)', the same twice. Each is shown around where they differ."""
    miles = list(range(10, 300, 10))
    said = _saved_then_restored(
        tmp_path,
        _with(lambda o: lr_scheduler.MultiStepLR(o, miles)),
        _with(lambda o: lr_scheduler.MultiStepLR(o, [*miles[:-1], 295])),
    )
    (named,) = said
    assert "290: 1} from the checkpoint" in named and "295: 1} here)" in named, named


def _set_cosine(state, value):
    state["sched"].T_max = int(value)


def _set_onecycle(state, value):
    # (the guide's way for OneCycleLR: a new one with the new settings, at the restored step)
    new = lr_scheduler.OneCycleLR(state["opt"], max_lr=1.0, total_steps=int(value))
    new.last_epoch = state["sched"].last_epoch
    state["sched"] = new


def _set_cyclic(state, value):
    state["sched"].base_lrs = [value]


@pytest.mark.parametrize(
    ("kind", "before", "after", "set_new"),
    [
        ("cosine", 10, 100, _set_cosine),
        ("onecycle", 20, 200, _set_onecycle),
        ("cyclic", 0.1, 0.3, _set_cyclic),
    ],
)
def test_a_roll_back_keeps_the_settings_set_after_the_resume(
    tmp_path, caplog, kind, before, after, set_new
):
    """A run resumed with new settings, set after restore() as the warning says; a NaN later
    the loop rolls back (restore() again, to the same checkpoint). The roll-back loaded the
    checkpoint's settings over the run's again (T_max 10, the old OneCycleLR phases) and said
    the resume's warning a second time: the run went on with settings its user had replaced.
    They stay the run's now (where it is comes from the checkpoint), and a log line says so."""
    first = _built(kind, before)
    _lrs(first, 3)
    with Checkpointer(tmp_path) as ck:
        ck.save(3, first)
    ref = _built(kind, after)  # the resumed run as its user meant it, never rolled back
    with (
        pytest.warns(UserWarning, match="scheduler settings"),
        Checkpointer(tmp_path, read_only=True) as ck,
    ):
        assert ck.restore(ref) == 3
    set_new(ref, after)
    expected = _lrs(ref, 4)
    state = _built(kind, after)
    with Checkpointer(tmp_path) as ck:
        with pytest.warns(UserWarning, match="scheduler settings"):
            assert ck.restore(state) == 3
        set_new(state, after)
        _lrs(state, 2)  # ... and the loss is NaN: back to the checkpoint
        caplog.set_level("INFO", "resilient_callbacks")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ck.restore(state) == 3
        assert _lrs(state, 4) == expected
    said = [r.getMessage() for r in caplog.records if "roll-back" in r.getMessage()]
    here = f"[{after}]" if kind == "cyclic" else after
    assert len(said) == 1 and f"from the checkpoint ({here} here)" in said[0], said
