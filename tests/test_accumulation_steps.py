"""A plain loop that calls ``ckpt.step()`` once per micro-batch of a gradient accumulation
window: a save due inside a window (periodic, or ``save_on_exception``'s) is made at the first
``step()`` after the window's optimizer step, so a run stopped there and resumed trains on
exactly as one never stopped."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer

WINDOW = 3  # micro-batches per optimizer step


class Boom(RuntimeError):
    pass


def _setup(make_model):
    """The seeded data, model (``make_model()``), SGD with momentum and the state of a run."""
    torch.manual_seed(0)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return x, model, opt, {"model": model, "optimizer": opt}


def train(ck_dir, total, every=100, fail_at=None, save_on_exception=False, preempt_at=None):
    """Micro-steps 1..total, an optimizer step after every WINDOW-th; ``step(i)`` after each.
    ``preempt_at``: a real SIGTERM before that ``step()``; the loop stops once it saved."""
    x, model, opt, state = _setup(lambda: torch.nn.Linear(4, 1))
    with Checkpointer(
        ck_dir,
        every_n_steps=every,
        save_on_exception=save_on_exception,
        async_save=False,
        exit_on_preemption=False,
    ) as ck:
        first = ck.restore(state)
        for i in range(first + 1, total + 1):
            if i == fail_at:
                raise Boom("in the forward pass")
            (model(x[i % 16 : i % 16 + 1]).pow(2).mean() / WINDOW).backward()
            if i % WINDOW == 0:
                opt.step()
                opt.zero_grad()
            if i == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)
            ck.step(i, state)
            if ck.preempted:
                break
    return first, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["periodic", "exception"])
def test_a_step_per_micro_batch_saves_at_the_windows_end_and_resumes_exactly(tmp_path, how, caplog):
    """A save at micro-step 4 (periodic, or at an exception in micro-step 8) held the weights of
    step 3 with no gradient of micro-step 4; the resumed run's next optimizer step lacked it."""
    _, ref = train(tmp_path / "ref", 12)
    ck = tmp_path / "ck"
    kwargs = {"every": 4} if how == "periodic" else {"save_on_exception": True}
    with caplog.at_level(logging.INFO, logger="resilient_callbacks"), pytest.raises(Boom):
        train(ck, 12, fail_at=8, **kwargs)
    first, params = train(ck, 12)
    assert all(torch.equal(params[k], ref[k]) for k in ref)
    assert first == 6  # the end of the window the save was due in
    assert "inside gradient accumulation windows" in caplog.text


def test_a_preemption_inside_a_window_saves_at_its_end(tmp_path):
    """The preemption's emergency save at micro-step 4 held the weights of step 3 without
    micro-step 4's gradient."""
    _, ref = train(tmp_path / "ref", 12)
    train(tmp_path / "ck", 12, preempt_at=4)
    first, params = train(tmp_path / "ck", 12)
    assert first == 6
    assert all(torch.equal(params[k], ref[k]) for k in ref)


def test_a_preemption_in_steps_without_backward_passes_is_saved(tmp_path):
    """``step()`` per iteration of a phase with no update and no backward pass (an evaluation,
    a rollout), the last update's gradients left in ``.grad`` (``zero_grad(set_to_none=False)``
    before it): every such step() looked like a micro-batch of a window that never ended, and a
    preemption's save was held until the process was killed -- never made."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with Checkpointer(
        tmp_path / "ck", every_n_steps=1000, async_save=False, exit_on_preemption=False
    ) as ck:
        ck.restore(state)
        for i in range(1, 7):
            opt.zero_grad(set_to_none=False)
            model(x).pow(2).mean().backward()
            opt.step()
            ck.step(i, state)
        for i in range(7, 20):  # no update, no backward pass
            with torch.no_grad():
                model(x)
            if i == 10:
                os.kill(os.getpid(), signal.SIGTERM)
            ck.step(i, state)
            if ck.preempted:
                break
        assert ck.preempted
    assert os.path.isdir(tmp_path / "ck" / "step_000000010")


def train_then_probe(ck_dir, preempt_at, total=60, grace_period=None, first=None):
    """Windows of WINDOW micro-steps up to micro-step 6, then backward passes with no update
    (gradient-norm probing): a window that never ends. A real SIGTERM before ``step(preempt_at)``;
    returns the Checkpointer's ``preempted``, the step() it stopped at, the weights."""
    x, model, opt, state = _setup(lambda: torch.nn.Linear(4, 1))
    with Checkpointer(
        ck_dir,
        every_n_steps=1000,
        async_save=False,
        exit_on_preemption=False,
        grace_period=grace_period,
    ) as ck:
        start = ck.restore(state)
        i = start
        for i in range(start + 1, total + 1):
            (model(x[i % 16 : i % 16 + 1]).pow(2).mean() / WINDOW).backward()
            if i <= 6 and i % WINDOW == 0:
                opt.step()
                opt.zero_grad()
            if i == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)
            ck.step(i, state)
            if ck.preempted:
                break
        return ck.preempted, i, {k: v.clone() for k, v in model.state_dict().items()}


def _run_child(code: str):
    """``code`` run in a child process forked from the session's zygote
    (``spawn_ranks.run_python``: torch imported once, not seconds of CPU per child), with this
    process's number of torch threads (the zygote's is 1): the same arithmetic, bit for bit, as
    the runs in this process it is compared with (with 1 thread BatchNorm's statistics differed
    in their last bits)."""
    threads = f"import torch; torch.set_num_threads({torch.get_num_threads()}); "
    return spawn_ranks.run_python([sys.executable, "-c", threads + code], timeout=300)


def probe_in_a_child(ck_dir, grace_period):
    """:func:`train_then_probe` preempted at micro-step 8, in a child process (the signal held
    there until the process ends is re-raised at close: it would end the test run; see
    :func:`_run_child`): (its exit code, its stdout, its log)."""
    code = (
        "import json, logging, sys; import test_accumulation_steps as t; "
        "logging.basicConfig(level=logging.WARNING, stream=sys.stderr); "
        f"p, i, _ = t.train_then_probe({str(ck_dir)!r}, 8, grace_period={grace_period!r}); "
        "print(json.dumps([p, i]))"
    )
    r = _run_child(code)
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("grace_period", [None, 1e-6])
def test_a_preemption_in_a_window_that_never_ends_saves_the_step_before_it(tmp_path, grace_period):
    """Backward passes with no update after micro-step 6: the preemption at micro-step 8 was
    held until the process was killed, nothing saved. It is held at most about twice the
    longest window seen (3 calls) and half the grace period, then the step before the window
    (6, whose weights the window never changed) is saved, with a warning."""
    _, _, ref = train_then_probe(tmp_path / "ref", preempt_at=None, total=6)
    rc, out, log = probe_in_a_child(tmp_path / "ck", grace_period)
    assert rc == 0, log
    # stopped in the window (7..) at 2 * 3 calls, or at the call after half the grace period
    assert json.loads(out) == [True, 9 if grace_period else 12]
    assert "saving step 6, the last step before the window" in log
    assert [n for n in os.listdir(tmp_path / "ck") if n.startswith("step_")] == ["step_000000006"]
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert ck.restore({"model": model, "optimizer": opt}) == 6
    ck.close()
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)


def test_a_final_step_inside_a_last_partial_window_is_saved_with_a_warning(tmp_path):
    """A loop of 7 micro-batches, an optimizer step after every 3rd: its final step() comes
    after the last partial window's backward pass, with no optimizer step. The final save
    raised UnsupportedStateError at the end of the run, its last save lost (and a job requeued
    on the error trained its tail again). It is made as it is, with a warning: the trained
    weights, without the partial window's gradients, which the run never applied."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    with Checkpointer(tmp_path / "ck", every_n_steps=1000, async_save=False) as ck:
        ck.restore(state)
        for i in range(1, 8):
            model(x).pow(2).mean().backward()
            if i % WINDOW == 0:
                opt.step()
                opt.zero_grad()
            with (
                pytest.warns(UserWarning, match="final save of step 7 inside a gradient")
                if (i == 7)
                else contextlib.nullcontext()
            ):
                assert ck.step(i, state, final=i == 7) == (i == 7)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    model = torch.nn.Linear(4, 1)
    assert ck.restore({"model": model, "optimizer": torch.optim.SGD(model.parameters())}) == 7
    ck.close()
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)


class CountingState(dict):
    """A state dict that counts the walks over it (``items()``)."""

    walks = 0

    def items(self):  # type: ignore[override]
        self.walks += 1
        return super().items()


def test_a_step_after_an_update_reads_the_hooks_not_the_state():
    """Every step() walked the state (its leaves, GradScalers, optimizers) to read hook flags
    already registered: the cost per step of the default mode rose by half (0.12 -> 0.17 ms at
    2000 tensors). After the first call, a step() that follows an optimizer step reads only
    the hooks' flags; one without an update still walks it (a micro-batch is told so)."""
    from resilient_callbacks.windows import StepWatch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = CountingState(model=model, optimizer=opt)
    watch = StepWatch()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    try:
        for i in range(1, 6):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            assert watch.inside(state, 1) is None
            assert state.walks == 1, f"step {i} walked the state"
        model(x).pow(2).mean().backward()  # a micro-batch, no update: the state is looked at
        watch.inside(state, 1)
        assert state.walks == 2
    finally:
        watch.release()


def test_several_ranks_count_no_windows():
    """With several ranks a save is not held in a window, but the windows were counted: past
    the first, the loop "had windows", and every step() of every micro-batch recorded the step
    before a window (a walk of the parameters, a copy of every buffer, the RNGs) for a hold
    that never comes, and recorded it mid-window."""
    from resilient_callbacks.windows import StepWatch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    watch = StepWatch()
    try:
        for i in range(1, 10):
            model(x).pow(2).mean().backward()
            if i % WINDOW == 0:
                opt.step()
                opt.zero_grad()
            assert watch.inside(state, world_size=2) is None
        assert watch.longest <= 1
    finally:
        watch.release()


def test_the_step_before_a_window_keeps_the_states_tensors_by_reference(tmp_path):
    """In a loop with windows and a preemption watcher, the step before each window is
    recorded (for a preemption held too long in one): a tensor of the state (an EMA's
    weights, kept as tensors) was cloned at every window's end, a second copy of it in memory
    and its copy's time at each, by default. It is kept by reference with its version
    counter; written in place since, the point is not used."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {"model": model, "optimizer": opt, "ema": ema}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with Checkpointer(tmp_path / "ck", every_n_steps=1000, async_save=False) as ck:
        ck.restore(state)
        for i in range(1, 8):
            model(x).pow(2).mean().backward()
            if i % WINDOW == 0:
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    for k, v in model.state_dict().items():
                        ema[k].mul_(0.9).add_(v, alpha=0.1)
            ck.step(i, state)
        em = ck._emergency
        point = em._consistent_point
        assert point is not None and point[0] == 6
        assert point[1]["ema"]["weight"] is ema["weight"]
        assert em._usable(point, "test")
        ema["weight"].add_(1.0)  # written since: the point is not the state of step 6
        assert not em._usable(point, "test")


def train_bn_then_probe(ck_dir, preempt_at, total=16, out=None):
    """:func:`train_then_probe` with a BatchNorm model (running statistics change at every
    forward pass) and ``exit_on_preemption=False``: the loop goes on to ``total`` after the
    save. ``out``: a file the final state_dict is written to; it is returned too."""
    x, model, opt, state = _setup(
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    )
    with Checkpointer(ck_dir, every_n_steps=1000, async_save=False, exit_on_preemption=False) as ck:
        for i in range(ck.restore(state) + 1, total + 1):
            (model(x[i % 8 : i % 8 + 4]).pow(2).mean() / WINDOW).backward()
            if i <= 6 and i % WINDOW == 0:
                opt.step()
                opt.zero_grad()
            if i == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)
            ck.step(i, state)
        preempted = ck.preempted
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if out is not None:
        torch.save({"preempted": preempted, "state": sd}, out)
    return sd


def test_a_save_of_the_step_before_a_window_leaves_the_live_buffers_alone(tmp_path):
    """The save of step 6 for a preemption held in a window that never ends set the modules'
    buffers (BatchNorm's running statistics) back to step 6's for the save and left them so:
    with exit_on_preemption=False the run went on from the old statistics, not as a run with
    no preemption would have. The save holds step 6's; the live run's are put back after it."""
    ref = train_bn_then_probe(tmp_path / "ref", preempt_at=None)
    at6 = train_bn_then_probe(tmp_path / "ref6", preempt_at=None, total=6)
    out = tmp_path / "out.pt"
    code = (
        "import logging, sys; import test_accumulation_steps as t; "
        "logging.basicConfig(level=logging.WARNING, stream=sys.stderr); "
        f"t.train_bn_then_probe({str(tmp_path / 'ck')!r}, 8, out={str(out)!r})"
    )
    r = _run_child(code)
    assert r.returncode == 0, r.stderr
    assert "saving step 6, the last step before the window" in r.stderr
    got = torch.load(out)
    assert got["preempted"]
    assert all(torch.equal(got["state"][k], ref[k]) for k in ref)
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert ck.restore({"model": model, "optimizer": opt}) == 6
    ck.close()
    assert all(torch.equal(model.state_dict()[k], at6[k]) for k in at6)


class _Refusing(logging.Handler):
    """A log handler that raises on a record containing ``text`` (as a handler that makes a
    warning fail a run would): an exception between the save's buffers set back and the save."""

    def __init__(self, text):
        super().__init__()
        self.text = text

    def emit(self, record):
        if self.text in record.getMessage():
            raise Boom(f"the handler refused: {self.text}")


def train_bn_until_the_preemption_raises(ck_dir, text, out):
    """:func:`train_bn_then_probe` preempted at micro-step 8, a ``_Refusing(text)`` handler
    on the library's logger: the modules' state_dict just before the step() that raised and
    just after it, written to ``out`` (before close(), which re-raises the held signal)."""
    x, model, opt, state = _setup(
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    )
    logging.getLogger("resilient_callbacks").addHandler(_Refusing(text))
    with Checkpointer(ck_dir, every_n_steps=1000, async_save=False, exit_on_preemption=False) as ck:
        for i in range(1, 17):
            (model(x[i % 8 : i % 8 + 4]).pow(2).mean() / WINDOW).backward()
            if i <= 6 and i % WINDOW == 0:
                opt.step()
                opt.zero_grad()
            if i == 8:
                os.kill(os.getpid(), signal.SIGTERM)
            live = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                ck.step(i, state)
            except Boom as e:
                after = {k: v.clone() for k, v in model.state_dict().items()}
                torch.save({"step": i, "error": str(e), "live": live, "after": after}, out)
                break


@pytest.mark.parametrize(
    "text", ["the last step before the window", "before stopping"], ids=["window", "notice"]
)
def test_an_error_before_the_save_of_the_step_before_a_window_puts_the_live_buffers_back(
    tmp_path, text
):
    """The preemption held in a window saves step 6: the modules' buffers are set back to step
    6's for the save, and were put back only around the save itself: an exception raised
    before it (here a log handler's, on the save's warning or on its notice; with several
    ranks, the collective that says which ranks got which signal) left the live modules with
    step 6's running statistics. Now they are the run's own after any of them."""
    out = tmp_path / "out.pt"
    code = (
        "import test_accumulation_steps as t; "
        f"t.train_bn_until_the_preemption_raises({str(tmp_path / 'ck')!r}, {text!r}, "
        f"{str(out)!r})"
    )
    r = _run_child(code)
    assert out.exists(), r.stderr
    got = torch.load(out)
    assert got["step"] >= 8 and text in got["error"]
    stats = [k for k in got["live"] if k.startswith("1.running_")]
    assert stats  # the BatchNorm's running statistics
    at6 = train_bn_then_probe(tmp_path / "ref6", preempt_at=None, total=6)
    assert not all(torch.equal(got["live"][k], at6[k]) for k in stats)  # they changed since
    assert all(torch.equal(got["after"][k], got["live"][k]) for k in got["live"])


def test_an_update_after_the_optimizers_hooks_were_removed_is_not_taken_for_a_micro_batch(
    tmp_path,
):
    """The step hook on the optimizer was removed (its hooks cleared) after an update it saw;
    the next ``step()``, after another update (a window of one micro-batch, gradients kept as
    zeros), was taken for a micro-batch: the save due there waited one call. The hook lost is
    noticed and registered again, and the call is not counted inside a window."""
    x, model, opt, state = _setup(lambda: torch.nn.Linear(4, 1))
    saved = {}
    with Checkpointer(tmp_path / "ck", every_n_steps=7, async_save=False) as ck:
        ck.restore(state)
        for i in range(1, 9):
            (model(x[i : i + 1]).pow(2).mean() / WINDOW).backward()
            if i % WINDOW == 0 or i == 7:
                opt.step()
                opt.zero_grad(set_to_none=False)
            saved[i] = ck.step(i, state)
            if i == 6:
                opt._optimizer_step_pre_hooks.clear()
    assert [i for i, s in saved.items() if s] == [7]
    assert len(opt._optimizer_step_pre_hooks) == 0  # (ours removed at close, once more)


@pytest.mark.parametrize("other", ["another-checkpointer", "removed-from-the-state"])
def test_the_step_of_an_optimizer_not_in_the_state_ends_no_window(tmp_path, other):
    """Two models in one process (a GAN's generator and discriminator): the Checkpointer's
    state holds the generator and its optimizer, which accumulates over WINDOW micro-batches,
    while the discriminator's optimizer steps at every micro-batch. ``another-checkpointer``:
    that optimizer is in a second Checkpointer's state (followed by that one's StepWatch alone:
    held at the generator's step before too). ``removed-from-the-state``: it was in the state
    at the first two step() calls, then taken out: each of its steps still ended the state's
    window, and the save due at micro-step 4 was made there, without micro-step 4's gradient
    (the one due at 8 likewise). Both are held to the generator's step (6, 9)."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    g, d = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    g_opt = torch.optim.SGD(g.parameters(), lr=0.1)
    d_opt = torch.optim.SGD(d.parameters(), lr=0.1)
    state: dict = {"model": g, "optimizer": g_opt}
    if other == "removed-from-the-state":
        state["d_optimizer"] = d_opt
    saved = {}
    with contextlib.ExitStack() as stack:
        ck = stack.enter_context(Checkpointer(tmp_path / "g", every_n_steps=4, async_save=False))
        d_ck = None
        if other == "another-checkpointer":
            d_kw = {"every_n_steps": 1000, "async_save": False}
            d_ck = stack.enter_context(Checkpointer(tmp_path / "d", **d_kw))
        for i in range(1, 10):
            (g(x[i : i + 1]).pow(2).mean() / WINDOW).backward()
            if i % WINDOW == 0:
                g_opt.step()
                g_opt.zero_grad()
            d(x[i : i + 1]).pow(2).mean().backward()
            d_opt.step()
            d_opt.zero_grad()
            saved[i] = ck.step(i, state)
            if d_ck is not None:
                d_ck.step(i, {"model": d, "optimizer": d_opt})
            if i == 2:
                state.pop("d_optimizer", None)
    assert [i for i, s in saved.items() if s] == [6, 9]
