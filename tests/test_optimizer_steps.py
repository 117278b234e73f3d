"""The process's registry of optimizer steps (optimizer_steps.py): one hook per optimizer,
shared by its followers, counts that only grow, weak references, lost hooks registered again."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from resilient_callbacks import optimizer_steps
from resilient_callbacks.optimizer_steps import Follower


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def _step(opt: torch.optim.Optimizer) -> None:
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    opt.step()


def test_two_followers_share_one_hook_removed_when_the_last_lets_go():
    opt = _opt()
    a, b = Follower(), Follower()
    ea, fresh_a = a.follow(opt)
    eb, fresh_b = b.follow(opt)
    assert ea is eb and fresh_a and fresh_b
    assert len(opt._optimizer_step_pre_hooks) == 1
    assert a.follow(opt) == (ea, False)
    _step(opt)
    _step(opt)
    assert (ea.calls, ea.updates) == (2, 2)
    a.release()
    assert len(opt._optimizer_step_pre_hooks) == 1
    b.release()
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_a_step_closure_counts_its_update_once_the_closure_returned():
    opt = _opt()
    f = Follower()
    entry, _ = f.follow(opt)

    def failing():
        assert (entry.calls, entry.updates) == (1, 0)  # the step began, its update not
        raise RuntimeError("in the backward pass")

    with pytest.raises(RuntimeError):
        opt.step(failing)
    assert (entry.calls, entry.updates) == (1, 0)
    opt.step(lambda: torch.tensor(0.0))
    assert (entry.calls, entry.updates) == (2, 1)
    f.release()


def test_the_registry_does_not_keep_an_optimizer_alive():
    f = Follower()
    opt = _opt()
    before = optimizer_steps.entries()
    f.follow(opt)
    assert optimizer_steps.entries() == before + 1
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    assert optimizer_steps.entries() == before
    f.release()


def test_a_hook_removed_behind_the_registrys_back_is_registered_again():
    opt = _opt()
    f = Follower()
    entry, _ = f.follow(opt)
    opt._optimizer_step_pre_hooks.clear()  # (torch's hooks dict, emptied by the user)
    _step(opt)
    assert entry.calls == 0  # not seen
    again, fresh = f.follow(opt)
    assert again is entry and fresh  # its steps before were not counted: said
    _step(opt)
    assert entry.calls == 1
    assert len(opt._optimizer_step_pre_hooks) == 1
    f.release()
    assert len(opt._optimizer_step_pre_hooks) == 0


class Forwarding(torch.optim.Optimizer):
    """An optimizer-like object that steps others and hands its step hooks to them (as the
    Lightning callback's ``OptimizerStates`` hands its post-hooks): its own hooks' dict never
    holds ours."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self._optimizer_step_pre_hooks: dict = {}

    @property
    def param_groups(self):  # type: ignore[override]
        return self.inner.param_groups

    def register_step_pre_hook(self, hook):
        return self.inner.register_step_pre_hook(hook)


def test_a_hook_handed_on_elsewhere_is_registered_once():
    """A hook registered through an object that forwards it (or drops it) cannot be found in
    the object's own hooks: it was taken as lost and registered again at every look, one
    more hook on the inner optimizer at every step()."""
    inner = _opt()
    outer = Forwarding(inner)
    f = Follower()
    entry, _ = f.follow(outer)
    for _ in range(3):
        assert f.follow(outer) == (entry, False)
    assert len(inner._optimizer_step_pre_hooks) == 1
    _step(inner)
    assert entry.calls == 1
    f.release()
    assert len(inner._optimizer_step_pre_hooks) == 0


def test_an_optimizer_collected_while_the_registry_is_locked_does_not_deadlock():
    """An optimizer can be collected at any allocation, one inside the registry's own locked
    section included: its weak reference's callback takes the registry's lock again, on the
    same thread (a plain lock hung there for ever)."""
    f = Follower()
    opt = _opt()
    f.follow(opt)
    done = threading.Event()

    def collect_inside(box):
        with optimizer_steps._LOCK:
            box.clear()  # (the last reference: collected here, the callback runs now)
        done.set()

    box = [opt]
    del opt
    worker = threading.Thread(target=collect_inside, args=(box,), daemon=True)
    worker.start()
    assert done.wait(timeout=30), "the registry's lock was taken twice by one thread"
    f.release()


def test_a_follower_lets_go_of_the_optimizers_collected():
    """An optimizer re-created every epoch: the follower kept an entry (its hook, its handle)
    for every one collected, until close."""
    f = Follower()
    for _ in range(5):
        opt = _opt()
        f.follow(opt)
        del opt
        gc.collect()
    assert len(f._entries) == 1  # the last one's, let go at the next new one
    f.release()


def test_a_hook_registered_again_by_one_follower_is_said_to_the_others():
    """Two followers of one optimizer (two Checkpointers' step watches), its hook removed
    behind their backs and an update unseen: the first to look registers it again and is
    told its steps before were not counted; the second was told nothing (the hook was there
    again when it looked) and took the update for none."""
    opt = _opt()
    a, b = Follower(), Follower()
    entry, _ = a.follow(opt)
    b.follow(opt)
    opt._optimizer_step_pre_hooks.clear()
    _step(opt)  # (not counted)
    assert a.follow(opt) == (entry, True)
    assert b.follow(opt) == (entry, True)  # its steps before were not counted either
    assert b.follow(opt) == (entry, False)
    assert a.follow(opt) == (entry, False)
    assert len(opt._optimizer_step_pre_hooks) == 1
    a.release()
    b.release()
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_two_step_watches_both_see_an_update_after_the_hook_was_lost():
    """Two Checkpointers' step watches over one loop (windows of 3 micro-batches, gradients
    kept as zeros): the optimizer's hooks cleared after an update, then an update after a
    single micro-batch. The first watch registers the hook again and takes the call for no
    micro-batch; the second, told nothing, took it for one (a save due there waited)."""
    from resilient_callbacks.windows import StepWatch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optimizer": opt}
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    watches = [StepWatch(), StepWatch()]
    found: dict[int, list[bool]] = {}
    try:
        for i in range(1, 9):
            model(x[i : i + 1]).pow(2).mean().backward()
            if i % 3 == 0 or i == 7:
                opt.step()
                opt.zero_grad(set_to_none=False)
            found[i] = [w.inside(state, 1) is not None for w in watches]
            if i == 6:
                opt._optimizer_step_pre_hooks.clear()
    finally:
        for w in watches:
            w.release()
    assert found[7] == [False, False]
    assert found[4] == found[5] == [True, True] and found[6] == [False, False]
