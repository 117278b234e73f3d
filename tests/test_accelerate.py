"""A plain Hugging Face Accelerate loop (``accelerator.prepare`` + ``accumulate``) with a
Checkpointer: SIGKILLed mid-epoch and mid accumulation window, re-run, it equals the run never
stopped bit for bit (docs/accelerate.md); accelerate's prepared loaders and a save inside an
accumulation window are refused, before anything is written."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

import spawn_ranks
from resilient_callbacks import Checkpointer
from resilient_callbacks.errors import CheckpointMismatchError, UnsupportedStateError

LOOP = str(Path(__file__).with_name("accelerate_loop.py"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in path.read_text().splitlines():
        i, v = line.split()
        out[int(i)] = v  # a resumed run logs the steps after its checkpoint again: last wins
    return out


def _one(
    tmp: Path, ck: str, out: str, kill_at: int, expect: int, *more: str, **env: str
) -> subprocess.CompletedProcess[str]:
    # a process of its own, forked from the session's zygote (torch imported once)
    argv = [sys.executable, LOOP, str(tmp / ck), str(tmp / out), str(kill_at), *more]
    p = spawn_ranks.run_python(argv, {**ENV, **env}, timeout=300)
    assert p.returncode == expect, p.stdout + p.stderr
    return p


def _same(tmp: Path, a: str, b: str, ranks: int) -> None:
    for r in range(ranks):
        la, lb = _losses(tmp / f"{a}.rank{r}.losses"), _losses(tmp / f"{b}.rank{r}.losses")
        assert la == lb, f"rank {r}: first differing micro-step " + str(
            min(i for i in la if la[i] != lb.get(i))
        )
    pa = torch.load(tmp / f"{a}.params")
    pb = torch.load(tmp / f"{b}.params")
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.slow  # three processes importing accelerate: about 15 s
def test_killed_mid_window_resumes_exactly_one_process(tmp_path: Path) -> None:
    _one(tmp_path, "ck_full", "full", 0, 0)
    _one(tmp_path, "ck", "run", 9, -9)  # mid epoch 0 (11 batches), in a window (after step 4)
    _one(tmp_path, "ck", "run", 0, 0)
    assert len(_losses(tmp_path / "full.rank0.losses")) == 33
    _same(tmp_path, "full", "run", 1)


@pytest.mark.slow  # docs/accelerate.md says bf16 (CPU autocast) was probed: now it is tested
def test_killed_mid_window_resumes_exactly_in_bf16(tmp_path: Path) -> None:
    _one(tmp_path, "ck_full", "full", 0, 0, "bf16")
    _one(tmp_path, "ck", "run", 15, -9, "bf16")  # mid epoch 1, in a window
    _one(tmp_path, "ck", "run", 0, 0, "bf16")
    _same(tmp_path, "full", "run", 1)


@pytest.mark.slow
def test_killed_mid_window_resumes_exactly_two_processes(tmp_path: Path) -> None:
    def group(ck: str, out: str, kill_at: int, expect: int) -> None:
        argv = [sys.executable, LOOP, str(tmp_path / ck), str(tmp_path / out), str(kill_at)]
        spawn_ranks.run(argv, 2, tmp_path, f"{out}{kill_at}", expect=expect)

    group("ck_full", "full", 0, 0)
    group("ck", "run", 5, -9)  # mid epoch 0 (6 batches a rank), in a window
    group("ck", "run", 0, 0)
    assert len(_losses(tmp_path / "full.rank1.losses")) == 18  # two ranks sharded the data
    _same(tmp_path, "full", "run", 2)


REFUSAL = """
import sys, torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from resilient_callbacks import Checkpointer
from resilient_callbacks.errors import CheckpointMismatchError, UnsupportedStateError
cfg = DataLoaderConfiguration(use_stateful_dataloader=sys.argv[2] == "stateful")
acc = Accelerator(cpu=True, dataloader_config=cfg)
ds = torch.utils.data.TensorDataset(torch.randn(8, 2))
loader = acc.prepare(torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True))
next(iter(loader))
with Checkpointer(sys.argv[1]) as ckpt:
    try:
        ckpt.save(1, {"data": loader})
    except UnsupportedStateError as e:
        print("REFUSED", e)
"""


@pytest.mark.parametrize("kind", ["plain", "stateful"])
def test_prepared_loader_refused(tmp_path: Path, kind: str) -> None:
    """Old src: plain failed inside accelerate (AttributeError: 'DataLoader' object has no
    attribute 'dl_state_dict'); stateful was saved and resumed with other batches, silently."""
    if kind == "stateful":
        pytest.importorskip("torchdata")
    # forked from the session's zygote (torch imported once)
    p = spawn_ranks.run_python([sys.executable, "-c", REFUSAL, str(tmp_path / "ck"), kind], ENV)
    assert "REFUSED state['data'] is accelerate's DataLoaderShard" in p.stdout, p.stderr
    assert "ResumableDataLoader" in p.stdout and "docs/accelerate.md" in p.stdout
    assert not any((tmp_path / "ck").glob("step*"))


class _FakeAccelerator:  # the attributes Accumulation reads, as accelerate names them
    def __init__(self, step: int, sync: bool) -> None:
        self.gradient_state = object()
        self.step, self.sync_gradients, self.gradient_accumulation_steps = step, sync, 4
        self.scaler: Any = None


def test_accumulation_saves_the_step_and_refuses_mid_window(tmp_path: Path) -> None:
    from resilient_callbacks.accelerate import Accumulation

    with Checkpointer(tmp_path / "ck") as ckpt:
        with pytest.raises(UnsupportedStateError, match="inside a gradient accumulation window"):
            ckpt.save(1, {"acc": Accumulation(_FakeAccelerator(3, False))})
        assert ckpt.save(2, {"acc": Accumulation(_FakeAccelerator(8, True))})
    live = _FakeAccelerator(0, True)
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore({"acc": Accumulation(live)}) == 2
    assert live.step == 8
    with pytest.raises(TypeError, match=r"accelerate\.Accelerator"):
        Accumulation(object())


def test_save_on_exception_with_step_called_every_micro_batch(tmp_path: Path) -> None:
    """With save_on_exception, every step() remembers its state for an exception's save: one
    inside an accumulation window (no save due) raised Accumulation's refusal, so a loop
    calling step() every micro-batch died at its first one. Now that step() goes on, and an
    exception mid-window saves the window's start (the last optimizer step)."""
    from resilient_callbacks.accelerate import Accumulation

    live = _FakeAccelerator(0, True)
    w = torch.zeros(3)
    state = {"w": w, "acc": Accumulation(live)}
    with (
        pytest.raises(RuntimeError, match="boom"),
        Checkpointer(tmp_path / "ck", every_n_steps=100, save_on_exception=True) as ckpt,
    ):
        for micro in range(1, 7):
            live.step, live.sync_gradients = micro, micro % 4 == 0
            if live.sync_gradients:
                w += 1.0  # the optimizer step
            assert not ckpt.step(micro, state)
        raise RuntimeError("boom")  # inside the second window (micro-steps 5, 6)
    back = _FakeAccelerator(0, True)
    got = {"w": torch.zeros(3), "acc": Accumulation(back)}
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore(got) == 4
    assert back.step == 4 and torch.equal(got["w"], torch.ones(3))


def test_a_subclass_of_a_prepared_loader_is_refused_too(tmp_path: Path) -> None:
    """A user's subclass of accelerate's DataLoaderShard has its state_dict(): it was not
    refused (the check read the class's own name), and the save failed inside accelerate."""
    from accelerate.data_loader import DataLoaderShard

    class MyShard(DataLoaderShard):
        pass

    loader = MyShard(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2)
    with (
        pytest.raises(UnsupportedStateError, match=r"DataLoaderShard \(MyShard subclasses it\)"),
        Checkpointer(tmp_path / "ck", async_save=False) as ckpt,
    ):
        ckpt.save(1, {"data": loader})
    assert not any((tmp_path / "ck").glob("step*"))


@pytest.mark.slow  # three processes importing accelerate: about 20 s
def test_sigterm_inside_a_window_saves_at_its_end_and_resumes_exactly(tmp_path: Path) -> None:
    """A preemption (a real SIGTERM) whose step() comes inside an accumulation window, in a
    loop calling ckpt.step at every micro-batch: the emergency save was refused there
    (UnsupportedStateError), so nothing was saved and the process died with a traceback
    instead of exiting 75. Now the save waits for the window's end, and the re-run equals
    the run never stopped, bit for bit."""
    micro = {"LOOP_EVERY_MICRO": "1", "LOOP_GAS": "3"}
    _one(tmp_path, "ck_full", "full", 0, 0, **micro)
    # after micro-batch 7 (window 7-9): step(8) is inside the window, step(9) ends it
    p = _one(tmp_path, "ck", "run", 7, 75, LOOP_SIGNAL="SIGTERM", **micro)
    assert "inside a gradient accumulation window" in p.stderr
    assert (tmp_path / "ck" / "step_000000009").is_dir()  # (every_n_steps=2: 3, 6 before)
    _one(tmp_path, "ck", "run", 0, 0, **micro)
    _same(tmp_path, "full", "run", 1)


@pytest.mark.slow
def test_sigterm_inside_a_window_two_processes(tmp_path: Path) -> None:
    """Two ranks, windows of 4 (6 batches a rank: 4 + 2), step() at every micro-batch, a real
    SIGTERM to each after micro-batch 1: the ranks agree on the request at a decision step
    inside the window and save at its end (4). An emergency save put off by itself waited for
    the next decision step, which the ranks space out (here past the run's end; in a long run
    possibly always inside a window): never made."""
    env = {"LOOP_EVERY_MICRO": "1", "LOOP_GAS": "4"}

    def group(ck: str, out: str, kill_at: int, expect: int, **more: str) -> None:
        argv = [sys.executable, LOOP, str(tmp_path / ck), str(tmp_path / out), str(kill_at)]
        spawn_ranks.run(argv, 2, tmp_path, f"{out}{kill_at}", expect=expect, env={**env, **more})

    group("ck_full", "full", 0, 0)
    group("ck", "run", 1, 75, LOOP_SIGNAL="SIGTERM")
    assert [p.name for p in (tmp_path / "ck").glob("step*")] == ["step_000000004"]
    group("ck", "run", 0, 0)
    _same(tmp_path, "full", "run", 2)


@pytest.mark.slow  # three processes importing accelerate: about 20 s
def test_epoch_end_partial_window_as_a_prepared_loader(tmp_path: Path) -> None:
    """11 batches an epoch, gradient_accumulation_steps=3: accelerate's prepared loader ends
    a window at the epoch's last batch (windows 3, 3, 3, 2). The loop of docs/accelerate.md
    (accumulation.epoch(loader)) trains bit for bit as that loop does, and SIGTERMed inside
    the partial window, then re-run, still does. Old src: Accumulation had no epoch(); its
    windows ran across epochs, and the final save, inside a window, was refused."""
    _one(tmp_path, "ck_ref", "ref", 0, 0, LOOP_PREPARED="1", LOOP_GAS="3")
    _one(tmp_path, "ck", "run", 21, 75, LOOP_SIGNAL="SIGTERM", LOOP_GAS="3")  # epoch 1: 12-22
    _one(tmp_path, "ck", "run", 0, 0, LOOP_GAS="3")
    assert len(_losses(tmp_path / "ref.rank0.losses")) == 33
    _same(tmp_path, "ref", "run", 1)


def test_a_preemption_inside_a_window_waits_for_its_end(tmp_path: Path) -> None:
    """A real SIGTERM while step() is called every micro-batch: the emergency save at a step
    inside an accumulation window raised Accumulation's refusal (nothing saved, the loop
    died). Now step() goes on there and saves at the window's end."""
    import signal

    from resilient_callbacks.accelerate import Accumulation

    live = _FakeAccelerator(0, True)
    w = torch.zeros(3)
    state = {"w": w, "acc": Accumulation(live)}
    with Checkpointer(tmp_path / "ck", exit_on_preemption=False, async_save=False) as ckpt:
        for micro in range(1, 9):
            live.step, live.sync_gradients = micro, micro % 4 == 0
            if live.sync_gradients:
                w += 1.0
            if micro == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            saved = ckpt.step(micro, state)
            assert saved == (micro == 8) and ckpt.preempted == (micro == 8)
    back = _FakeAccelerator(0, True)
    got = {"w": torch.zeros(3), "acc": Accumulation(back)}
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore(got) == 8
    assert back.step == 8 and torch.equal(got["w"], torch.full((3,), 2.0))


@pytest.mark.parametrize("micro_s", [1.0, 30.0])
def test_a_preemption_held_longer_than_the_grace_period_left_is_said_loudly(
    tmp_path: Path, micro_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    """A real SIGTERM (grace period 60 s) at micro-step 5 of windows of 4, micro-steps of
    ``micro_s`` s on a fake clock: the save waits for the window's end, 3 micro-steps away.
    At 30 s a step (90 s > 60 s) the job would be killed before that save: a RuntimeWarning
    says so with the figures and what to do (the hold only said 'made at the window's end',
    whatever the grace period). At 1 s a step (3 s) only the log line says so, with the
    figures. What is saved does not change: step 8, the window's end."""
    import signal
    import warnings

    from resilient_callbacks.accelerate import Accumulation

    live = _FakeAccelerator(0, True)
    state = {"w": torch.zeros(3), "acc": Accumulation(live)}
    clock = [0.0]
    opts = {"exit_on_preemption": False, "async_save": False, "grace_period": 60.0}
    with warnings.catch_warnings(record=True) as said, Checkpointer(tmp_path / "ck", **opts) as ck:
        warnings.simplefilter("always")
        ck._trigger.now = lambda: clock[0]
        for micro in range(1, 9):
            clock[0] += micro_s  # the micro-step's compute
            live.step, live.sync_gradients = micro, micro % 4 == 0
            if micro == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            assert ck.step(micro, state) == (micro == 8)
        assert ck.preempted
    loud = [str(w.message) for w in said if issubclass(w.category, RuntimeWarning)]
    if micro_s == 1.0:
        assert loud == [], loud
        assert "3 more micro-step(s) at the 1.00 s a step took recently" in caplog.text
        return
    assert len(loud) == 1, loud
    msg = loud[0]
    assert "preemption (SIGTERM) at step 5" in msg and "3 more micro-step(s)" in msg, msg
    assert "30.00 s a step" in msg and "about 90.0 s" in msg, msg
    assert "grace period left" in msg and "Lower gradient_accumulation_steps" in msg, msg
    assert said[[str(w.message) for w in said].index(msg)].filename == __file__


def test_a_periodic_save_due_inside_a_window_is_made_at_its_end(tmp_path: Path) -> None:
    """step() at every micro-batch, counting micro-batches, with every_n_steps=2 and windows
    of 4: the saves due at 2 and 6, inside windows, raised Accumulation's refusal (the loop
    died at its first); now each is made at its window's end (4, 8)."""
    from resilient_callbacks.accelerate import Accumulation

    live = _FakeAccelerator(0, True)
    state = {"w": torch.zeros(3), "acc": Accumulation(live)}
    saved = []
    with Checkpointer(tmp_path / "ck", every_n_steps=2, async_save=False) as ckpt:
        for micro in range(1, 11):
            live.step, live.sync_gradients = micro, micro % 4 == 0
            if ckpt.step(micro, state):
                saved.append(micro)
    assert saved == [4, 8]  # (10, due inside the third window, waits for its end)


def _syncs(acc: Any, batches: Any) -> list[bool]:
    out = []
    for _ in batches:
        with acc.accumulate(torch.nn.Linear(1, 1)):
            pass
        out.append(acc.sync_gradients)
    return out


def test_epoch_ends_a_window_at_the_last_batch_as_a_prepared_loader() -> None:
    """Accumulation.epoch(loader) tells accelerate the epoch's last batch, as a prepared
    loader does: 11 batches with gradient_accumulation_steps=3 synchronize at 3, 6, 9 and
    11 in both, and a loader resumed mid-epoch ends its window at the same batch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from resilient_callbacks import ResumableDataLoader
    from resilient_callbacks.accelerate import Accumulation

    ds = torch.utils.data.TensorDataset(torch.arange(44.0))
    try:
        acc = Accelerator(gradient_accumulation_steps=3, cpu=True)
        want = [i % 3 == 2 or i == 10 for i in range(11)]
        assert _syncs(acc, acc.prepare(torch.utils.data.DataLoader(ds, batch_size=4))) == want
        accumulation, loader = Accumulation(acc), ResumableDataLoader(ds, batch_size=4)
        assert _syncs(acc, accumulation.epoch(loader)) == want
        assert _syncs(acc, accumulation.epoch(loader)) == want  # the next epoch
        passing = accumulation.epoch(loader)
        assert _syncs(acc, itertools.islice(passing, 6)) == want[:6]  # then interrupted
        sd = (loader.state_dict(), accumulation.state_dict())
        passing.close()
        acc.step = 0
        again = ResumableDataLoader(ds, batch_size=4)
        again.load_state_dict(sd[0])
        Accumulation(acc).load_state_dict(sd[1])
        assert _syncs(acc, Accumulation(acc).epoch(again)) == want[6:]
        assert not acc.gradient_state.in_dataloader  # each pass leaves the gradient state
        with pytest.raises(TypeError, match="needs a loader with a length"):
            next(accumulation.epoch(iter([1, 2])))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_accumulation_saves_accelerates_grad_scaler(tmp_path: Path) -> None:
    """fp16 on a GPU: accelerator.scaler's scale and growth tracker were lost on resume
    unless the user also put the scaler in the state (the scale restarted at 65536: skipped
    steps, other weights). Accumulation saves and restores it now. (On CPU accelerate makes
    no scaler for fp16; GradScaler("cpu") stands in for the GPU's.)"""
    from resilient_callbacks.accelerate import Accumulation

    live = _FakeAccelerator(4, True)
    live.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    w = torch.ones(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for grad in (1.0, float("inf"), 1.0):  # a skipped step, then one that counts toward growth
        live.scaler.scale(w.sum()).backward()
        w.grad.fill_(grad)
        live.scaler.step(opt)
        live.scaler.update()
        opt.zero_grad()
    saved = live.scaler.state_dict()
    assert saved["scale"] == 2.0**15 and saved["_growth_tracker"] == 1
    with Checkpointer(tmp_path / "ck", async_save=False) as ckpt:
        ckpt.save(1, {"acc": Accumulation(live)})
    back = _FakeAccelerator(0, True)
    back.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore({"acc": Accumulation(back)}) == 1
    assert back.scaler.state_dict() == saved


def test_another_accumulation_count_starts_a_whole_window(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Saved at a window's end with gradient_accumulation_steps=4 (accelerator.step=8),
    resumed with 3: step 8 was restored and the first window after the resume synchronized
    after one micro-batch (9 % 3 == 0). Now the step starts at 0, with a warning."""
    from resilient_callbacks.accelerate import Accumulation

    with Checkpointer(tmp_path / "ck", async_save=False) as ckpt:
        ckpt.save(2, {"acc": Accumulation(_FakeAccelerator(8, True))})
    back = _FakeAccelerator(0, True)
    back.gradient_accumulation_steps = 3
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore({"acc": Accumulation(back)}) == 2
    assert back.step == 0
    assert "gradient_accumulation_steps is 3 here but was 4" in caplog.text


@pytest.mark.parametrize(("batches", "warned"), [(10, False), (8, True)])
def test_another_accumulation_count_warns_only_where_a_window_would_be_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, batches: int, warned: bool
) -> None:
    """Saved with gradient_accumulation_steps=4 and resumed with 3: at the epoch's end (10
    batches of 10: accelerate resets accelerator.step to 0) the warning that the windows
    start afresh was given too, though the next window is whole anyway; now only where the
    saved step (8, at a window's end mid-epoch) would cut the first window short."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from resilient_callbacks import ResumableDataLoader
    from resilient_callbacks.accelerate import Accumulation

    ds = torch.utils.data.TensorDataset(torch.arange(40.0))
    try:
        acc = Accelerator(gradient_accumulation_steps=4, cpu=True)
        passing = Accumulation(acc).epoch(ResumableDataLoader(ds, batch_size=4))
        assert _syncs(acc, itertools.islice(passing, batches))[-1]
        passing.close()
        assert acc.step == (0 if batches == 10 else 8)
        with Checkpointer(tmp_path / "ck", async_save=False) as ckpt:
            ckpt.save(2, {"acc": Accumulation(acc)})
        acc.step = 5
        acc.gradient_accumulation_steps = 3
        caplog.set_level(logging.WARNING, "resilient_callbacks")
        with Checkpointer(tmp_path / "ck") as ckpt:
            assert ckpt.restore({"acc": Accumulation(acc)}) == 2
        assert acc.step == 0
        said = "gradient_accumulation_steps is 3 here but was 4" in caplog.text
        assert said == warned, caplog.text
        assert _syncs(acc, range(3)) == [False, False, True]  # a whole window of 3
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_skip_first_batches_loader_is_refused(tmp_path: Path) -> None:
    """accelerator.skip_first_batches() of an iterable dataset's loader is a SkipDataLoader
    (accelerate's documented way to resume mid-epoch): its save failed inside accelerate
    ("'DataLoader' object has no attribute 'dl_state_dict'") instead of being refused."""
    from accelerate.data_loader import SkipDataLoader

    class Numbers(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.arange(8.0))

    loader = SkipDataLoader(Numbers(), skip_batches=1, batch_size=2)
    with (
        pytest.raises(UnsupportedStateError, match=r"accelerate's SkipDataLoader.*ResumableDataL"),
        Checkpointer(tmp_path / "ck", async_save=False) as ckpt,
    ):
        ckpt.save(1, {"data": loader})
    assert not any((tmp_path / "ck").glob("step*"))


def test_save_on_exception_refuses_a_prepared_loader_at_the_first_step(tmp_path: Path) -> None:
    """With save_on_exception every step() freezes the state: a prepared loader in it failed
    there inside accelerate (an AttributeError at step 1), not with the refusal that says what
    to do; and a state no save could take is still said at once outside an accumulation
    window (only Accumulation's own refusal inside one is let pass)."""
    from accelerate.data_loader import DataLoaderShard

    from resilient_callbacks.accelerate import Accumulation

    loader = DataLoaderShard(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2)
    live = _FakeAccelerator(0, False)  # inside a window: the refusal is not let pass either
    state = {"w": torch.zeros(2), "data": loader, "acc": Accumulation(live)}
    with (
        pytest.raises(UnsupportedStateError, match=r"state\['data'\] is accelerate's DataLoaderS"),
        Checkpointer(tmp_path / "ck", every_n_steps=100, save_on_exception=True) as ckpt,
    ):
        ckpt.step(1, state)


class _Counter:
    """An object a loop registers with ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


class _Before:
    """What Accumulation saved before it saved the registered objects."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": 0, "num_steps": 2}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise AssertionError("not restored")


def _registered(ema: torch.nn.Module | None = None) -> tuple[Any, _Counter, torch.nn.Module]:
    from accelerate import Accelerator

    from resilient_callbacks.accelerate import Accumulation

    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    counter, ema = _Counter(), ema or torch.nn.Linear(3, 2)
    acc.register_for_checkpointing(counter, ema)
    return Accumulation(acc), counter, ema


def test_objects_registered_for_checkpointing_are_saved_and_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop moving from save_state()/load_state() keeps the objects it registered with
    ``accelerator.register_for_checkpointing`` (an EMA model, a counter of its own), which
    save_state() saved: with Accumulation in the state they were neither saved nor restored,
    and nothing said so (the counter came back 0). Accumulation saves them now, as
    save_state() does, and restores them in the order they were registered."""
    accumulation, counter, ema = _registered()
    accumulation.accelerator.register_for_checkpointing(accumulation)  # for save_state() too
    counter.n = 7
    with torch.no_grad():
        ema.weight.fill_(0.25)
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.save(3, {"accumulation": accumulation})
    accumulation, counter, ema = _registered()
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore({"accumulation": accumulation}) == 3
    assert counter.n == 7
    assert torch.equal(ema.weight, torch.full((2, 3), 0.25))
    # registered otherwise than when saved: said, not loaded into the wrong objects
    from accelerate import Accelerator

    from resilient_callbacks.accelerate import Accumulation

    other = Accelerator(gradient_accumulation_steps=2, cpu=True)
    other.register_for_checkpointing(_Counter())
    with Checkpointer(tmp_path / "old") as ckpt:  # Accumulation's state before it saved them
        assert ckpt.save(1, {"accumulation": _Before()})
    accumulation, counter, _ = _registered()
    counter.n = 5
    logs = caplog.at_level(logging.WARNING, logger="resilient_callbacks")
    with logs, Checkpointer(tmp_path / "old") as ckpt:
        assert ckpt.restore({"accumulation": accumulation}) == 1
    assert counter.n == 5 and "does not hold the 2 object(s) registered" in caplog.text
    mismatch = r"holds 2 object.*this accelerator has 1"
    with (
        Checkpointer(tmp_path / "ck") as ckpt,
        pytest.raises(CheckpointMismatchError, match=mismatch),
    ):
        ckpt.restore({"accumulation": Accumulation(other)})


@pytest.mark.parametrize("how", ["prepare", "skip_first_batches"])
def test_our_loader_iterated_through_accelerate_is_refused(tmp_path: Path, how: str) -> None:
    """A ResumableDataLoader in the state but iterated as accelerator.prepare(loader) (the
    accelerate idiom) or accelerator.skip_first_batches(loader) (accelerate's resume recipe,
    kept after restore()) trains on its sampler through another loader: its saved position
    stayed at 0 batches (a resume replayed the epoch) or skipped the restored batches twice,
    silently. Now the save is refused, nothing written."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from resilient_callbacks import ResumableDataLoader

    try:
        acc = Accelerator(cpu=True)
        ds = torch.utils.data.TensorDataset(torch.arange(10.0))
        loader = ResumableDataLoader(ds, batch_size=2)
        other = acc.prepare(loader) if how == "prepare" else acc.skip_first_batches(loader, 1)
        it = iter(other)
        next(it)
        with (
            pytest.raises(UnsupportedStateError, match=r"another loader iterated its sampler"),
            Checkpointer(tmp_path / "ck", async_save=False) as ckpt,
        ):
            ckpt.save(1, {"data": loader})
        assert not any((tmp_path / "ck").glob("step*"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_step_per_micro_batch_with_accumulation_on_several_ranks_warns_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The loop of docs/accelerate.md calling step() at every micro-batch (supported: the
    Accumulation in the state holds the saves on every rank): with several ranks the plain
    loop's window check warned on rank 0 to call step() once per optimizer step."""
    from resilient_callbacks.accelerate import Accumulation
    from resilient_callbacks.windows import StepWatch

    live = _FakeAccelerator(0, True)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt, "acc": Accumulation(live)}
    watch = StepWatch()
    with caplog.at_level(logging.INFO, logger="resilient_callbacks"):
        for micro in range(1, 13):
            live.step, live.sync_gradients = micro, micro % 4 == 0
            model(torch.ones(1, 3)).sum().backward()
            if live.sync_gradients:
                opt.step()
                opt.zero_grad()
            assert watch.inside(state, world_size=2) is None
    watch.release()
    assert "once per optimizer step" not in caplog.text
