"""save_on_exception: an exception in training saves the last consistent state (the step the
loop last reported), then propagates unchanged; resuming from it is exact."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from features_train import SAM
from resilient_callbacks import Checkpointer, ResumableDataLoader


class Boom(RuntimeError):
    pass


def train(ck_dir, total, fail_at=None, fail_where="forward", async_save=True):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    loader = ResumableDataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, seed=3)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.7)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "data": loader,
        "extra": {"seen": 0},
    }
    losses = {}
    with Checkpointer(
        ck_dir, every_n_steps=100, save_on_exception=True, async_save=async_save
    ) as ck:
        step = ck.restore(state)
        while step < total:
            for xb, yb in loader:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                if step == fail_at and fail_where == "forward":
                    raise Boom("after the forward pass")
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step == fail_at and fail_where == "after_optimizer":
                    raise Boom("after the optimizer step")
                sched.step()
                step += 1
                state["extra"]["seen"] += len(xb)
                losses[step] = loss.item()
                ck.step(step, state)
                if step >= total:
                    break
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("async_save", [True, False])
def test_exception_saves_last_step_and_resume_is_exact(tmp_path, async_save):
    ref_losses, ref_params = train(tmp_path / "ref", 30)
    ck = tmp_path / "ck"
    with pytest.raises(Boom, match="after the forward pass") as ei:
        train(ck, 30, fail_at=13, async_save=async_save)
    assert type(ei.value) is Boom  # propagated unchanged
    names = sorted(p.name for p in ck.iterdir() if p.name.startswith("step_"))
    assert names == ["step_000000013"]
    losses, params = train(ck, 30)
    assert min(losses) == 14  # resumed after step 13
    assert all(losses[s] == ref_losses[s] for s in losses)
    assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)


def test_exception_after_an_unseen_optimizer_step_saves_nothing(tmp_path, caplog):
    ck = tmp_path / "ck"
    with pytest.raises(Boom):
        train(ck, 30, fail_at=13, fail_where="after_optimizer")
    assert not [p for p in ck.iterdir() if p.name.startswith("step_")]
    assert any("matches no step" in r.getMessage() for r in caplog.records)


def test_a_generator_in_the_state_is_saved_as_of_the_last_step(tmp_path):
    """The exception's save holds the generator's state at the last reported step, not the
    state it reached after draws the failed step made."""
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Linear(2, 2)
    state = {"model": model, "extra": {"noise": g}}
    at_step_1 = None
    with (
        pytest.raises(Boom),
        Checkpointer(tmp_path / "ck", every_n_steps=100, save_on_exception=True) as ck,
    ):
        torch.rand(4, generator=g)
        ck.step(1, state)
        at_step_1 = g.get_state()
        torch.rand(4, generator=g)  # the failing step drew from it before failing
        raise Boom("in step 2")
    g.manual_seed(0)
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(state) == 1
    assert torch.equal(g.get_state(), at_step_1)


def test_an_optimizer_step_that_raised_part_way_saves_nothing(tmp_path, caplog):
    """The step updated one parameter, then raised (an out-of-memory error inside a foreach or
    multi-group step): the state is no step's. The stepped flag was set by a post-step hook,
    which a step that raises never reaches, so "step 2 (unchanged since)" was saved with one
    parameter of step 3 in it; the flag is set as the step starts now, and nothing is saved."""

    class HalfwaySGD(torch.optim.SGD):
        fail = False

        @torch.no_grad()
        def step(self, closure=None):
            first, *rest = [p for g in self.param_groups for p in g["params"]]
            first.add_(100.0)
            if self.fail:
                raise Boom("out of memory inside optimizer.step")
            for p in rest:
                p.add_(100.0)

    model = torch.nn.Linear(4, 4)
    opt = HalfwaySGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    ck_dir = tmp_path / "ck"
    with (
        pytest.raises(Boom),
        Checkpointer(ck_dir, every_n_steps=1000, save_on_exception=True) as ck,
    ):
        for step in range(1, 4):
            opt.fail = step == 3
            opt.step()
            ck.step(step, state)
    assert not [p for p in ck_dir.iterdir() if p.name.startswith("step_")]
    assert any("matches no step" in r.getMessage() for r in caplog.records)


class UnprintableError(RuntimeError):
    """An exception whose str() raises (its __str__ reads an attribute it was never given)."""

    def __str__(self) -> str:
        return self.detail  # type: ignore[attr-defined]


def test_an_exception_whose_str_fails_still_gets_its_save_and_close(tmp_path):
    """abort() read str(exc) for the close's message before the emergency save: an exception
    whose __str__ raised (AttributeError here) replaced the training's exception, the emergency
    save was skipped and the Checkpointer stayed open (its directory locked)."""
    with (
        pytest.raises(UnprintableError),
        Checkpointer(tmp_path, every_n_steps=100, save_on_exception=True, async_save=False) as ck,
    ):
        ck.step(1, {"w": torch.ones(2)})
        raise UnprintableError()
    assert ck.closed
    assert ck.last_saved_step == 1


def _lbfgs_run(ck_dir, total, fail_at=None):
    """LBFGS, whose step(closure) runs the forward and backward inside the step; the closure
    raises at step ``fail_at`` (a NaN check), before the step changed anything."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=3)
    state = {"model": model, "optimizer": opt}
    with Checkpointer(ck_dir, every_n_steps=100, save_on_exception=True) as ck:
        step = ck.restore(state)
        while step < total:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)

            def closure(x=x, y=y, failing=step == fail_at):
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                if failing:
                    raise Boom("loss check failed in the closure")
                loss.backward()
                return loss

            opt.step(closure)
            step += 1
            ck.step(step, state)
    return [p.detach().clone() for p in model.parameters()]


def test_an_exception_in_a_step_closure_saves_the_last_step(tmp_path, caplog):
    """The closure of a ``step(closure)`` raised before the optimizer updated anything: the
    state is the last step's and is saved. The step's pre-hook had counted the step as begun
    before the closure ran, so nothing was saved ("came after an optimizer step that step()
    never saw") and the run started over."""
    reference = _lbfgs_run(tmp_path / "ref", 8)
    ck_dir = tmp_path / "ck"
    with pytest.raises(Boom):
        _lbfgs_run(ck_dir, 8, fail_at=5)
    assert sorted(p.name for p in ck_dir.iterdir() if p.name.startswith("step_")) == [
        "step_000000005"
    ]
    assert not any("matches no step" in r.getMessage() for r in caplog.records)
    again = _lbfgs_run(ck_dir, 8)
    assert all(torch.equal(a, b) for a, b in zip(again, reference, strict=True))


# SAM: a sharpness-aware two-pass wrapper as users copy it: first_step() moves the weights to a
# nearby point in place, second_step() puts them back and steps the optimizer it holds
# (.base_optimizer), whose state (momentum) its own state_dict does not hold


def _sam_run(ck_dir, total, fail_at=None, fail_where=None, with_base=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    state = {"model": model, "sam": opt}
    if with_base:
        state["base"] = opt.base_optimizer
    with Checkpointer(ck_dir, every_n_steps=100, save_on_exception=True) as ck:
        step = ck.restore(state)
        while step < total:
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            failing = step == fail_at
            if failing and fail_where == "before":
                raise Boom("before the first pass")
            model(x).pow(2).mean().backward()
            opt.first_step()
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if failing and fail_where == "between":
                raise Boom("out of memory in the second pass")
            opt.second_step()
            opt.zero_grad()
            if failing and fail_where == "after":
                raise Boom("after the step")
            step += 1
            ck.step(step, state)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fail_where", ["before", "between", "after"])
def test_a_two_pass_optimizers_step_is_seen_by_save_on_exception(tmp_path, caplog, fail_where):
    """SAM's first_step() writes the weights in place, with no step hook of an optimizer in
    the state running: the perturbed weights (an exception between the passes) were saved as
    the last step's; so were the next step's after a second_step() whose base optimizer the
    state does not hold ("after"). Now the parameters' version counters show the change and
    nothing is saved; an exception before the first pass saves the last step, and the resume
    (base optimizer in the state) is exact."""
    reference = _sam_run(tmp_path / "ref", 6)
    ck_dir = tmp_path / "ck"
    with pytest.raises(Boom):
        _sam_run(ck_dir, 6, fail_at=3, fail_where=fail_where, with_base=fail_where != "after")
    saved = sorted(p.name for p in ck_dir.iterdir() if p.name.startswith("step_"))
    if fail_where == "before":
        assert saved == ["step_000000003"]
        again = _sam_run(ck_dir, 6)
        assert all(torch.equal(a, b) for a, b in zip(again, reference, strict=True))
    else:
        assert saved == []
        (said,) = [r.getMessage() for r in caplog.records if "matches no step" in r.getMessage()]
        # the first parameter SAM's first_step() (or the base's step) wrote, and what to do
        assert "after state['model'].0.weight was written in place since step 3" in said, said
        assert "make it before ckpt.step()" in said, said


def test_a_wrapped_base_optimizer_left_out_of_the_state_is_warned_about_at_the_first_save(
    tmp_path,
):
    """SAM's state_dict() holds its own state (the weights before the first pass), not its
    base optimizer's momentum: with only the wrapper in the state, the resume started the
    momentum from zero, silently. The first save says to put the base optimizer in too; with
    it there, nothing is said."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.first_step()
    opt.second_step()
    warned = pytest.warns(UserWarning, match=r"state\['sam'\]\.base_optimizer is an optimizer")
    with Checkpointer(tmp_path / "ck", async_save=False) as ck, warned:
        ck.save(1, {"model": model, "sam": opt})
    with Checkpointer(tmp_path / "ck2", async_save=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(1, {"model": model, "sam": opt, "base": opt.base_optimizer})


class PlainSAM:
    """A two-pass wrapper that is no torch optimizer: its state_dict() is its own (rho)."""

    def __init__(self, base, rho=0.05):
        self.base_optimizer, self.rho = base, rho

    def state_dict(self):
        return {"rho": self.rho}

    def load_state_dict(self, sd):
        self.rho = sd["rho"]


def test_a_base_optimizer_of_a_wrapper_of_any_class_left_out_is_warned_about(tmp_path):
    """The warning looked only into torch optimizers of the state: a wrapper of its own class
    holding the base optimizer (in ``.base_optimizer``) resumed its momentum from zero,
    unsaid."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    sam = PlainSAM(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    model(torch.randn(8, 4)).pow(2).mean().backward()
    sam.base_optimizer.step()
    warned = pytest.warns(UserWarning, match=r"state\['sam'\]\.base_optimizer is an optimizer")
    with Checkpointer(tmp_path / "ck", async_save=False) as ck, warned:
        ck.save(1, {"model": model, "sam": sam})
    with Checkpointer(tmp_path / "ck2", async_save=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(1, {"model": model, "sam": sam, "base": sam.base_optimizer})


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # (SAM's)
@pytest.mark.parametrize("layout", ["wrapper-first", "base-first", "base-only"])
def test_a_wrapper_and_its_base_share_their_groups_again_after_a_restore(tmp_path, layout):
    """SAM shares its parameter groups with its base optimizer, and an LR scheduler made for
    SAM changes the learning rate there; load_state_dict gives each optimizer new groups, so
    with the base restored after SAM the base kept stepping at the saved rate, whatever the
    scheduler did (the resumed run diverged at the scheduler's next step). The restore shares
    the groups again, whichever order the state has. "base-only": the state holds the base
    optimizer and the scheduler made for SAM, not SAM itself (its own state is only the
    weights between the passes); the scheduler's optimizer is relinked too (it was not: the
    scheduler changed SAM's old groups, which the loaded base no longer stepped with)."""

    def build():
        model = torch.nn.Linear(4, 1)
        sam = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(sam, step_size=1, gamma=0.5)
        if layout == "wrapper-first":
            return sam, {"model": model, "sam": sam, "base": sam.base_optimizer, "sched": sched}
        if layout == "base-first":
            return sam, {"model": model, "base": sam.base_optimizer, "sam": sam, "sched": sched}
        return sam, {"model": model, "base": sam.base_optimizer, "sched": sched}

    _, state = build()
    state["base"].step()
    state["sched"].step()
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, state)
    sam, fresh = build()
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        assert ck.restore(fresh) == 1
    assert sam.param_groups is fresh["base"].param_groups
    fresh["base"].step()
    fresh["sched"].step()
    assert fresh["base"].param_groups[0]["lr"] == 0.05 / 4


class SAMStep(torch.optim.Optimizer):
    """A two-pass optimizer whose step(closure) moves the weights (through ``p.data``: no
    version counter shows it) before it calls the closure for the second pass."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["old_p"] = p.detach().clone()
                p.data.add_(p.grad, alpha=group["rho"])
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()


def test_an_exception_in_the_closure_of_a_step_that_moved_the_weights_first_saves_nothing(
    tmp_path, caplog
):
    """Only torch's own optimizers evaluate a closure before they update anything: a SAM-style
    step(closure) moved the weights first (through p.data), its closure raised (the second
    pass), and the moved weights were saved as the last step's (the step counted as begun only
    once the closure returned). Another class's step(closure) counts as begun as it is
    called: nothing is saved."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = SAMStep(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    state = {"model": model, "sam": opt, "base": opt.base_optimizer}
    ck_dir = tmp_path / "ck"
    with (
        pytest.raises(Boom),
        Checkpointer(ck_dir, every_n_steps=100, save_on_exception=True) as ck,
    ):
        for step in range(1, 5):
            x = torch.randn(8, 4)
            model(x).pow(2).mean().backward()

            def closure(x=x, failing=step == 4):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                if failing:
                    raise Boom("NaN in the second pass")
                loss.backward()
                return loss

            opt.step(closure)
            opt.zero_grad()
            ck.step(step, state)
    assert not any(p.name.startswith("step_") for p in ck_dir.iterdir())
    assert any("step() never saw" in r.getMessage() for r in caplog.records)
