"""The Lightning adapter end to end, with a real ``Trainer`` on a tiny model (CPU).

The training script is tests/lightning_train.py: dropout, Python/NumPy randomness in the loss, a
shuffled train loader (plain ``DataLoader`` or torchdata's ``StatefulDataLoader``), validation
every 6 batches, a sanity check, AdamW with a per-step schedule; 13 batches per epoch, a
checkpoint every 4 steps, 60 steps. Its uninterrupted run is the reference; every interrupted
and resumed run must match it bit for bit: the loss of every step and the final weights.

- In-process: resume from a chosen step of each kind (right after a validation, at an epoch end,
  mid-epoch), without Lightning's "unreliable mid-epoch resume" warning; the same without our
  loader conversion is *not* exact and does warn (the control that shows the check can fail);
  an exception, a corrupt newest checkpoint, the remote tier (moto S3 server), ``ckpt_path``,
  ModelCheckpoint next to ours, the AMP GradScaler, the overlapped snapshot being awaited before
  the next optimizer step, unsaveable values, loggers, FSDP.
- Real processes: a real SIGKILL mid-epoch, then SIGTERM (exit 75, emergency checkpoint), then
  the same script to the end (in this process, which saves a start-up); the same with
  ``StatefulDataLoader`` and SIGUSR1 under Slurm; DDP with two CPU processes (gloo) both
  SIGKILLed and started again. The references run in this process (same seeds, one intra-op
  thread: bit-identical to a subprocess run), except DDP's.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import inspect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import types
import warnings
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

import spawn_ranks
from resilient_callbacks import (
    Checkpointer,
    CheckpointMismatchError,
    ConfigError,
    NoValidCheckpointError,
    ResumeFallbackWarning,
    UnsupportedStateError,
    catalog,
)
from resilient_callbacks.checkpointer import RESUMABLE_EXIT_CODE
from resilient_callbacks.lightning import ResilientCheckpoint
from resilient_callbacks.lightning.state import Converter, HparamsConversionWarning
from spawn_ranks import free_port
from torch_needs import needs_dcp

sys.path.insert(0, str(Path(__file__).parent))
import lightning_train

SCRIPT = Path(__file__).with_name("lightning_train.py")
TOTAL = 60
EVERY = 4
SEED = int(os.environ.get("RC_TEST_SEED", "20240611"))
RUN_TIMEOUT = 180
UNRELIABLE = "not resumable"  # from Lightning's "unreliable results" mid-epoch warning

pytestmark = pytest.mark.timeout(600)


# ----------------------------------------------------------------------------- helpers


def _argv(workdir: Path, *more: str, loader: str = "plain") -> list[str]:
    return [
        str(workdir / "ckpt"),
        "--loader",
        loader,
        "--every-n-steps",
        str(EVERY),
        "--out-jsonl",
        str(workdir / "losses.jsonl"),
        "--out-params",
        str(workdir / "params.safetensors"),
        "--root",
        str(workdir),
        *more,
    ]


def _run_inprocess(argv: list[str]) -> tuple[ResilientCheckpoint, list[str]]:
    """Run the script in this process; return the callback and the warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = lightning_train.main(argv)
    return rc, [str(w.message) for w in caught]


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))  # a line cut by SIGKILL is skipped
    return out


def _losses(path: Path) -> dict[int, str]:
    return {r["step"]: r["loss"] for r in _records(path)}  # a re-trained step: the last wins


def _places(path: Path) -> dict[int, tuple[int, int]]:
    return {r["step"]: (r["epoch"], r["batch"]) for r in _records(path)}


def _assert_same_run(ref: Path, got: Path, suffix: str = "", places: bool = True) -> None:
    a, b = _losses(ref / f"losses.jsonl{suffix}"), _losses(got / f"losses.jsonl{suffix}")
    assert sorted(a) == list(range(1, TOTAL + 1))
    assert sorted(b) == list(range(1, TOTAL + 1)), f"steps missing: {set(a) - set(b)}"
    diff = [s for s in a if a[s] != b[s]]
    assert not diff, (
        f"losses differ from the uninterrupted run at {len(diff)} step(s), first at step "
        f"{diff[0]}: {float.fromhex(a[diff[0]])!r} vs {float.fromhex(b[diff[0]])!r}"
    )
    pa = load_file(str(ref / f"params.safetensors{suffix}"))
    pb = load_file(str(got / f"params.safetensors{suffix}"))
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k].view(torch.uint8), pb[k].view(torch.uint8)), f"weight {k}"
    if not places:
        return
    # and each step in the same epoch, at the same batch of it
    ea, eb = _places(ref / f"losses.jsonl{suffix}"), _places(got / f"losses.jsonl{suffix}")
    diff = [s for s in ea if ea[s] != eb[s]]
    assert not diff, f"step {diff[0]}: (epoch, batch) {ea[diff[0]]} vs {eb[diff[0]]}"


def _committed(ckdir: Path) -> list[catalog.Entry]:
    return [e for e in catalog.scan(str(ckdir), catalog.Depth.FULL) if e.manifest is not None]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    for k in [k for k in env if k.startswith("SLURM_")]:
        del env[k]
    env.update(extra or {})
    return env


def _start(
    argv: list[str], errpath: Path, env: dict[str, str] | None = None
) -> spawn_ranks.Forked | subprocess.Popen:
    """Start the script with ``argv``, its stdout and stderr to ``errpath``: a fresh process
    in a session of its own, forked from the test session's zygote that imported Lightning
    once (spawn_ranks.Zygote: about 5 s of CPU a run). A ``--deepspeed`` run imports DeepSpeed
    itself, as a fresh interpreter does (lightning_train.cpu_deepspeed_strategy sets
    ``DS_ACCELERATOR=cpu`` first): about 1.2 s a run, less than a zygote of its own for the
    default suite's one DeepSpeed test (about 6 s to start)."""
    zygote = spawn_ranks.shared_zygote("lightning_train")
    return zygote.spawn([sys.executable, str(SCRIPT), *argv], env or _env(), errpath)


def _wait_for_step(
    jsonl: Path, offset: int, step: int, proc: spawn_ranks.Forked | subprocess.Popen, err: Path
) -> int:
    """Wait until this run logged step >= ``step`` (in training_step); return that step."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the run exited (rc={proc.returncode}) early:\n{err.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"the run did not reach step {step} in {RUN_TIMEOUT} s")
        if jsonl.exists():
            with open(jsonl, "rb") as f:
                f.seek(offset)
                lines = f.read().split(b"\n")[:-1]
            steps = []
            for line in lines:
                with contextlib.suppress(ValueError):
                    steps.append(json.loads(line)["step"])
            if steps and steps[-1] >= step:
                return steps[-1]
        time.sleep(0.005)


def _finish(proc: spawn_ranks.Forked | subprocess.Popen, err: Path, expect: int = 0) -> str:
    try:
        proc.wait(timeout=RUN_TIMEOUT)
    except (subprocess.TimeoutExpired, TimeoutError):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the run hung:\n{err.read_text()}")
    text = err.read_text()
    assert proc.returncode == expect, f"rc={proc.returncode}, expected {expect}:\n{text}"
    return text


def _restored(stderr: str, rank: int = 0) -> int:
    for line in stderr.splitlines():
        if line.startswith(f"[rank {rank}] restored step "):
            return int(line.split()[4])
    raise AssertionError(f"no 'restored step' line for rank {rank}:\n{stderr}")


def _kill(proc: spawn_ranks.Forked | subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job: rank 0 and the rank it launched
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, in this process (bit-identical to a subprocess run: same seeds, one
    intra-op thread), one per loader kind."""
    done: dict[str, Path] = {}

    def get(loader: str) -> Path:
        if loader not in done:
            work = tmp_path_factory.mktemp(f"reference-{loader}")
            rc, _ = _run_inprocess(_argv(work, loader=loader))
            assert rc.restored_step is None
            assert [r["step"] for r in _records(work / "losses.jsonl")] == list(range(1, TOTAL + 1))
            done[loader] = work
        return done[loader]

    return get


# ----------------------------------------------------------------------------- in-process


@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_resume_from_each_kind_of_step_is_bit_exact(tmp_path, reference, loader):
    """Stop at step K (max_steps=K saves it), re-run to the end: identical to the reference.
    K=6: validation runs right after it; K=13: the last batch of epoch 0; K=18: mid-epoch."""
    ref = reference(loader)
    for k in (6, 13, 18):
        work = tmp_path / f"k{k}"
        rc, _ = _run_inprocess(_argv(work, "--max-steps", str(k), loader=loader))
        assert rc.restored_step is None
        assert [e.step for e in _committed(work / "ckpt")][-1] == k
        rc, caught = _run_inprocess(_argv(work, loader=loader))
        assert rc.restored_step == k
        assert not [w for w in caught if UNRELIABLE in w], caught
        # torchdata's loader restored at an epoch's end gives an empty pass; the callback makes
        # the next epoch's iterator where the uninterrupted run does, so Lightning does not
        # count that pass as an epoch (until 2026-11-25: the same steps one epoch ahead)
        _assert_same_run(ref, work)


@pytest.mark.parametrize(
    ("val_every", "stops"),
    [(6, (6, 13, 18)), (0, (13, 18))],
    ids=["val-every-6", "val-at-epoch-end"],
)
def test_resume_is_exact_with_epoch_hooks_and_plateau_schedulers(tmp_path, val_every, stops):
    """The work Lightning does after a step's batch -- validation, ``ReduceLROnPlateau`` every 3
    steps and at each epoch's end (on ``val_loss``), ``on_train_epoch_end`` and the next
    ``on_train_epoch_start`` -- is in the checkpoint or redone at the resume, once. Found
    2026-11-25: from a checkpoint of an epoch's last batch the epoch-end and next epoch-start
    hooks were skipped; a draw in the module's ``on_train_start`` shifted every resumed run
    (the RNG was put back before it); a plateau reduction due right after the saved step was lost; the
    epoch-end reduction was skipped after any resume; and a re-run after a save followed by
    validation raised Lightning's "ReduceLROnPlateau conditioned on metric val_loss which is not
    available". Stops: 6 (validation follows), 13 (an epoch's last batch), 18 (mid-epoch)."""
    opts = ("--plateau", "--epoch-hooks", "--val-every", str(val_every))
    ref = tmp_path / "ref"
    _run_inprocess(_argv(ref, *opts))
    for k in stops:
        work = tmp_path / f"k{k}"
        _run_inprocess(_argv(work, "--max-steps", str(k), *opts))
        rc, _ = _run_inprocess(_argv(work, *opts))
        assert rc.restored_step == k
        _assert_same_run(ref, work)


@pytest.mark.parametrize(
    ("opts", "stop"),
    [
        (("--limit-train", "7"), 7),
        (("--reload",), 13),
        (("--loader", "iterable", "--val-every", "0"), 13),
    ],
    ids=["limit_train_batches", "reload_dataloaders", "iterable-without-len"],
)
def test_resume_at_an_epochs_end_makes_the_next_epochs_data_as_the_run_did(tmp_path, opts, stop):
    """Resumed from the checkpoint of an epoch's last batch, the next epoch's data come as in
    the uninterrupted run (found 2026-11-25): with ``limit_train_batches`` the restored loader
    went on with the cut epoch's order; with ``reload_dataloaders_every_n_epochs=1`` the
    reloaded loader's iterator was made before the epoch was announced; with an iterable
    dataset of unknown length its shuffle drew from the RNG before the RNG was restored, and
    Lightning numbered the next epoch's batches from 13."""
    ref = tmp_path / "ref"
    _run_inprocess(_argv(ref, *opts))
    work = tmp_path / "stopped"
    _run_inprocess(_argv(work, "--max-steps", str(stop), *opts))
    rc, _ = _run_inprocess(_argv(work, *opts))
    assert rc.restored_step == stop
    _assert_same_run(ref, work)


def test_a_persistent_validation_loader_resumes_exactly(tmp_path, reference):
    """The val loader keeps 2 workers (persistent_workers=True), no sanity check: the
    uninterrupted run makes its iterator at its first validation (end of epoch 0, step 13) and
    resets it at each later one without a draw from the global RNG. A run resumed at step 20
    made a new one at its first validation, drawing a base seed the uninterrupted run did not,
    and every later step differed. Stopped at 20 and re-run: the same as the uninterrupted
    run."""
    opts = ("--val-persistent", "--no-sanity", "--val-every", "0")  # at each epoch's end
    ref = tmp_path / "ref"
    _run_inprocess(_argv(ref, *opts))
    work = tmp_path / "k20"
    _run_inprocess(_argv(work, "--max-steps", "20", *opts))
    rc, _ = _run_inprocess(_argv(work, *opts))
    assert rc.restored_step == 20
    _assert_same_run(ref, work)


def test_a_run_stopped_by_early_stopping_is_not_trained_further_when_re_run(tmp_path):
    """EarlyStopping stops fit at step 12 (the second validation); that step is saved. The same
    script run again restores step 12 and trains nothing (it trained on: Lightning's
    checkpoint does not hold trainer.should_stop)."""
    rc, _ = _run_inprocess(_argv(tmp_path, "--early-stop"))
    steps = [r["step"] for r in _records(tmp_path / "losses.jsonl")]
    assert steps[-1] == 12 and [e.step for e in _committed(tmp_path / "ckpt")][-1] == 12
    rc, _ = _run_inprocess(_argv(tmp_path, "--early-stop"))
    assert rc.restored_step == 12
    assert [r["step"] for r in _records(tmp_path / "losses.jsonl")] == steps  # nothing trained
    assert [e.step for e in _committed(tmp_path / "ckpt")][-1] == 12


class _Clock:
    """Lightning's Timer reads ``time.monotonic()``: here each training batch takes 1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Tick(L.Callback):
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def on_train_batch_start(self, *args) -> None:
        self.clock.now += 1.0


def test_a_run_stopped_by_max_time_trains_on_when_max_time_leaves_time(tmp_path, monkeypatch):
    """One ``max_time`` chunk per job: a run stopped by max_time was recorded as stopped, and
    every re-run trained nothing, whatever max_time it had (a probe, 2026-12-05). The Timer
    keeps the training time across the resume (Lightning's own resume trains on): the same
    max_time trains nothing, a larger one trains on to it, none trains on to max_steps."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import Timer

    clock = _Clock()
    monkeypatch.setattr("lightning.pytorch.callbacks.timer.time", clock)

    def fit(seconds: int | None, max_steps: int = 12) -> tuple[int, int]:
        timer = [Timer(timedelta(seconds=seconds), interval="step")] if seconds else []
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100)
        trainer = _tiny_fit(tmp_path, _Tiny(), *timer, _Tick(clock), rc, max_steps=max_steps)
        return rc.restored_step or 0, trainer.global_step

    assert fit(5) == (0, 5)  # stopped by its Timer after 5 batches, and saved
    assert fit(5) == (5, 5)  # the same max_time: used up, nothing to train
    assert fit(8) == (5, 8)  # 3 s more
    assert fit(None) == (8, 12)  # no max_time now: on to max_steps
    assert [e.step for e in _committed(tmp_path / "ck")][-3:] == [5, 8, 12]


class _Noisy(L.LightningModule):
    """Noise from the global torch RNG in the loss; a validation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.losses: list[float] = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        loss = self.lin(batch[0]).pow(2).mean() + torch.rand(()) * 1e-3
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.lin(batch[0]).pow(2).mean())


def test_a_max_time_chunk_trained_on_ends_as_the_run_never_stopped(tmp_path, monkeypatch):
    """Lightning runs a validation when training stops mid-epoch (``should_stop``: here the
    Timer's), one the run without a stop does not; creating its dataloader iterator draws
    from the global torch RNG. The re-run that trained on from the stop went on from the
    streams after that validation: every later step differed from a run never stopped. It
    goes on from the streams as they were before it: the losses and weights are that run's."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import Timer

    clock = _Clock()
    monkeypatch.setattr("lightning.pytorch.callbacks.timer.time", clock)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4))

    def fit(*callbacks) -> _Noisy:
        L.seed_everything(0, verbose=False)
        module = _Noisy()
        trainer = L.Trainer(
            max_steps=12,
            accelerator="cpu",
            callbacks=[*callbacks, _Tick(clock)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        trainer.fit(module, loader, torch.utils.data.DataLoader(data, batch_size=8))
        return module

    plain = fit()
    timer = Timer(timedelta(seconds=5), interval="step")
    first = fit(timer, ResilientCheckpoint(tmp_path / "ck", every_n_steps=100))
    assert len(first.losses) == 5  # stopped in epoch 0 (8 batches), and validated
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100)
    again = fit(rc)  # no max_time now: trains on
    assert rc.restored_step == 5
    assert first.losses + again.losses == plain.losses
    assert torch.equal(again.lin.weight, plain.lin.weight)


def test_another_accumulate_grad_batches_on_resume_is_warned_about(tmp_path):
    """Lightning takes another accumulate_grad_batches on resume silently (the global batch
    changes mid-run; the Transformers callback refuses it): the callback warns, naming both."""

    def fit(accumulate: int, max_steps: int) -> list[str]:
        return lightning_train.fit_warned(
            tmp_path, _Tiny(), max_steps, "accumulate_grad_batches", accumulate
        )

    assert fit(1, 4) == []
    assert fit(1, 6) == []  # the same value: nothing said
    said = fit(2, 8)
    assert len(said) == 1 and "accumulate_grad_batches=2 here, 1 when the checkpoint" in said[0]


def test_a_scheduler_added_or_removed_on_resume_is_warned_about(tmp_path):
    """Lightning pairs the saved scheduler states with the run's schedulers in order and drops
    the rest silently: a scheduler added on resume started from its first learning rate, one
    removed lost its state, unsaid. The callback warns, naming both counts."""

    def fit(schedulers: int, max_steps: int) -> list[str]:
        return lightning_train.fit_warned(
            tmp_path, _Scheduled(schedulers), max_steps, "LR scheduler"
        )

    assert fit(0, 2) == []
    assert fit(0, 4) == []  # the same: nothing said
    (added,) = fit(1, 6)
    assert "1 LR scheduler(s) here, 0 when the checkpoint was saved" in added, added
    assert "start(s) from the initial state" in added, added
    (removed,) = fit(0, 8)
    assert "0 LR scheduler(s) here, 1 when" in removed and "is dropped" in removed, removed


def test_a_stop_asked_before_min_epochs_trains_on_as_the_run_did(tmp_path):
    """EarlyStopping sets should_stop at step 12 (its second validation); with min_epochs=2
    Lightning trains on to the end of epoch 1 (step 26). Found 2026-11-25: every step from 12
    on was saved as final, marked stopped; a re-run said "nothing to train" and trained. Saves
    keep their schedule; a run stopped at 20 and re-run stops at 26 with the same weights."""
    opts = ("--early-stop", "--min-epochs", "2")
    ref = tmp_path / "ref"
    _run_inprocess(_argv(ref, *opts))
    assert [e.step for e in _committed(ref / "ckpt")][-3:] == [20, 24, 26]
    work = tmp_path / "run"
    _run_inprocess(_argv(work, *opts, "--max-steps", "20"))
    rc, _ = _run_inprocess(_argv(work, *opts))
    assert rc.restored_step == 20
    assert _losses(work / "losses.jsonl") == _losses(ref / "losses.jsonl")
    assert max(_losses(ref / "losses.jsonl")) == 26


class _Validated4(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        self.trained.append(batch_idx)
        return self.lin(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.lin(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_stop_after_a_batch_that_made_no_step_saves_the_last_step(tmp_path):
    """accumulate_grad_batches=3, validation every 4 batches: EarlyStopping stops after batch
    8, which made no optimizer step (the last step, 2, was batch 6's). Found 2026-12-05: the
    last step was saved only if due (every_n_steps=4: never), so no checkpoint was left and
    the script run again trained the whole run anew. Step 2 is saved as the stop's final
    checkpoint; run again, it trains nothing."""

    def fit() -> tuple[ResilientCheckpoint, L.Trainer, _Validated4]:
        torch.manual_seed(0)
        ds = torch.utils.data.TensorDataset(torch.randn(64, 4))
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=4)
        stop = L.pytorch.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)
        trainer = L.Trainer(
            max_steps=50,
            accumulate_grad_batches=3,
            val_check_interval=4,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            accelerator="cpu",
            callbacks=[rc, stop],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        module = _Validated4()
        loader = torch.utils.data.DataLoader(ds, batch_size=4)
        trainer.fit(module, loader, loader)
        return rc, trainer, module

    rc, trainer, first = fit()
    assert trainer.global_step == 2 and len(first.trained) == 8
    (saved,) = _committed(tmp_path / "ck")
    assert saved.step == 2 and saved.manifest.reason == "final"
    rc, trainer, again = fit()
    assert rc.restored_step == 2 and again.trained == [] and trainer.global_step == 2
    assert torch.equal(again.lin.weight, first.lin.weight)


def test_control_without_resumable_loader_warns_and_diverges(tmp_path, reference):
    """The check above can fail: a plain DataLoader left as it is restarts its epoch on resume;
    Lightning warns, and the run is not the reference run."""
    work = tmp_path / "run"
    _run_inprocess(_argv(work, "--max-steps", "18", "--no-resumable-loaders"))
    rc, caught = _run_inprocess(_argv(work, "--no-resumable-loaders"))
    assert rc.restored_step == 18
    assert [w for w in caught if UNRELIABLE in w]
    assert _losses(work / "losses.jsonl") != _losses(reference("plain") / "losses.jsonl")


def test_exception_saves_the_last_step_and_the_rerun_is_exact(tmp_path, reference):
    work = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated failure in step 15"):
        _run_inprocess(_argv(work, "--fail-at", "15", "--save-on-exception"))
    newest = _committed(work / "ckpt")[-1]
    assert newest.step == 14 and newest.manifest.reason == "emergency"
    rc, _ = _run_inprocess(_argv(work))
    assert rc.restored_step == 14
    _assert_same_run(reference("plain"), work)


@pytest.mark.parametrize("fail_at", [14, 17], ids=["after-an-epoch-end", "mid-epoch"])
def test_the_exception_save_records_what_a_periodic_save_records(tmp_path, fail_at):
    """With plateau schedulers on val_loss and epoch hooks: the emergency save of the last
    completed step holds the callback metrics and, after an epoch's end (step 13), the
    epoch-end mark. Found 2026-11-25: it held neither, so the re-run resumed step 13 as the
    middle of epoch 0 and skipped a plateau reduction; both diverged."""
    opts = ("--plateau", "--epoch-hooks", "--every-n-steps", "100")
    ref = tmp_path / "ref"
    _run_inprocess(_argv(ref, *opts))
    work = tmp_path / "run"
    with pytest.raises(RuntimeError, match=f"simulated failure in step {fail_at}"):
        _run_inprocess(_argv(work, *opts, "--fail-at", str(fail_at), "--save-on-exception"))
    assert _committed(work / "ckpt")[-1].step == fail_at - 1
    rc, _ = _run_inprocess(_argv(work, *opts))
    assert rc.restored_step == fail_at - 1
    _assert_same_run(ref, work)


def test_exception_without_save_on_exception_keeps_the_periodic_checkpoint(tmp_path):
    work = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated failure"):
        _run_inprocess(_argv(work, "--fail-at", "15"))
    assert [e.step for e in _committed(work / "ckpt")] == [4, 8, 12]
    # the history records a failure (the report counts it, an MLflow run ends FAILED); it
    # used to record a clean end
    from resilient_callbacks import history

    events = [r["event"] for r in history.records(str(work / "ckpt"))]
    assert events[-1] == "failed" and "end" not in events, events


def _flip_byte(ckpt_dir: Path) -> Path:
    target = max(ckpt_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def test_corrupt_newest_checkpoint_falls_back_loudly(tmp_path, reference):
    work = tmp_path / "run"
    _run_inprocess(_argv(work, "--max-steps", "22"))  # saves 4, 8, ..., 20 and 22 (final)
    newest = _committed(work / "ckpt")[-1]
    assert newest.step == 22
    _flip_byte(Path(newest.path))
    rc, caught = _run_inprocess(_argv(work))
    assert rc.restored_step == 20
    assert [w for w in caught if "step_000000022" in w and "skipping" in w], caught
    _assert_same_run(reference("plain"), work)


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    work = tmp_path / "run"
    _run_inprocess(_argv(work, "--max-steps", "4"))
    _flip_byte(Path(_committed(work / "ckpt")[-1].path))
    with pytest.raises(NoValidCheckpointError), warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumeFallbackWarning)
        lightning_train.main(_argv(work))


def test_remote_delete_local_then_rerun_resumes(tmp_path, reference, s3_remote):
    if "remote" not in inspect.signature(Checkpointer).parameters:
        pytest.skip("the core Checkpointer has no remote tier yet")
    url, options = s3_remote
    work = tmp_path / "run"
    remote = ["--remote", url, "--remote-options", json.dumps(options)]
    _run_inprocess(_argv(work, "--max-steps", "22", *remote))  # close() waits for uploads
    shutil.rmtree(work / "ckpt")
    rc, _ = _run_inprocess(_argv(work, *remote))
    assert rc.restored_step == 22
    _assert_same_run(reference("plain"), work)


def test_explicit_ckpt_path_wins(tmp_path):
    work = tmp_path / "run"
    _run_inprocess(_argv(work, "--max-steps", "20", "--model-checkpoint"))
    (best,) = (work / "mc").glob("*.ckpt")  # ModelCheckpoint's best: a validation step
    best_step = torch.load(best, weights_only=True, map_location="cpu")["global_step"]
    assert best_step in (6, 12, 19)  # validation: batches 6 and 12 of each 13-batch epoch
    offset = len(_records(work / "losses.jsonl"))
    rc, _ = _run_inprocess(_argv(work, "--max-steps", "24", "--ckpt-path", str(best)))
    assert rc.restored_step is None  # ours (step 20) was not used
    assert _records(work / "losses.jsonl")[offset]["step"] == best_step + 1

    # one of our checkpoint directories given explicitly: that one, not the newest
    ours = next(e.path for e in _committed(work / "ckpt") if e.step == 8)
    offset = len(_records(work / "losses.jsonl"))
    rc, _ = _run_inprocess(_argv(work, "--max-steps", "10", "--ckpt-path", ours))
    assert rc.restored_step == 8
    assert _records(work / "losses.jsonl")[offset]["step"] == 9


def test_ckpt_path_last_that_lightning_resolves_to_no_file_resumes_ours(tmp_path):
    work = tmp_path / "run"
    _run_inprocess(_argv(work, "--max-steps", "8"))  # no ModelCheckpoint: no "last" file
    rc, _ = _run_inprocess(_argv(work, "--max-steps", "12", "--ckpt-path", "last"))
    assert rc.restored_step == 8
    assert _records(work / "losses.jsonl")[8]["step"] == 9


def test_coexists_with_model_checkpoint(tmp_path):
    work = tmp_path / "run"
    rc, _ = _run_inprocess(_argv(work, "--max-steps", "13", "--model-checkpoint"))
    # no default ModelCheckpoint is added next to ours (no duplicate .ckpt every epoch) ...
    trainer = L.Trainer(callbacks=[ResilientCheckpoint(tmp_path / "x")], logger=False)
    assert [type(c).__name__ for c in trainer.checkpoint_callbacks] == ["ResilientCheckpoint"]
    # ... but one the user adds works as usual, and its state survives our resume
    (best,) = (work / "mc").glob("*.ckpt")
    rc, _ = _run_inprocess(_argv(work, "--max-steps", "16", "--model-checkpoint"))
    assert rc.restored_step == 13
    mc = next(
        c
        for c in rc._trainer.callbacks
        if isinstance(c, L.pytorch.callbacks.ModelCheckpoint)  # type: ignore[attr-defined]
    )
    assert mc.best_model_path == str(best)
    assert rc.best_model_path == str(best)  # so trainer.test(ckpt_path="best") finds it


def test_save_timings_and_sizes_go_to_the_loggers(tmp_path):
    work = tmp_path / "run"
    _run_inprocess(_argv(work, "--max-steps", "12", "--csv-logs", str(work / "logs")))
    import csv

    with open(work / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    saved = [r for r in rows if r.get("resilient/save_mb")]
    assert saved, rows[0].keys()
    assert all(float(r["resilient/save_mb"]) > 0 for r in saved)
    # the final save commits in the background: logged at the end of training
    assert {int(float(r["resilient/saved_step"])) for r in saved} == {4, 8, 12}
    assert any(r.get("resilient/blocking_s") for r in rows)


# ----------------------------------------------------------------------------- unsaveable values


class Color(enum.Enum):
    RED = "red"


@dataclass
class Opt:
    lr: float
    path: Path


Pair = namedtuple("Pair", "a b")


def _convert_sample(conv: Converter) -> dict:
    return conv.convert(
        {
            "hyper_parameters": {
                "path": Path("/data"),
                "color": Color.RED,
                "ns": argparse.Namespace(a=1),
                "opt": Opt(0.1, Path("/x")),
                "pair": Pair(1, 2),
                "cls": torch.nn.Linear,
                "fn": lambda x: x,
            },
            "extra": {"dir": Path("/y"), "t": torch.ones(2)},
        },
        lossy_keys=frozenset({"hyper_parameters"}),
    )


def test_converter_converts_what_it_can():
    conv = Converter()
    with pytest.warns(HparamsConversionWarning, match=r"'fn'.*builtins\.function"):
        out = _convert_sample(conv)
    hp = out["hyper_parameters"]
    assert hp["path"] == "/data" and hp["color"] == "red" and hp["ns"] == {"a": 1}
    assert hp["opt"] == {"lr": 0.1, "path": "/x"} and hp["pair"] == {"a": 1, "b": 2}
    assert hp["cls"] == "torch.nn.modules.linear.Linear"
    assert hp["fn"].startswith("<function")  # stored as its repr, with the warning
    assert out["extra"]["dir"] == "/y" and torch.equal(out["extra"]["t"], torch.ones(2))
    with pytest.raises(UnsupportedStateError, match=r"checkpoint\['extra'\]\['fn'\]"):
        conv.convert({"extra": {"fn": lambda x: x}})


def test_each_rank_saves_and_resumes_its_own_callback_states(caplog):
    """Under DDP Lightning's ``callbacks`` entry is rank 0's (saved once); a rank whose
    EarlyStopping went by its own unsynced metric resumed with rank 0's state. Each rank's
    part (``"data"``) now holds its own, which the resume puts back (the DDP run:
    ``tests/test_lightning_setups.py::test_ddp_each_rank_resumes_its_own_callback_states``);
    a large state (SWA's averaged model) stays rank 0's alone."""
    from resilient_callbacks.lightning import state as st

    def dump(wait: int) -> dict:
        return {
            "callbacks": {
                "EarlyStopping{'monitor': 'train_loss'}": {
                    "wait_count": wait,
                    "best_score": torch.tensor(0.5 + wait),
                },
                "SWA": {"average_model_state": {"w": torch.zeros(1 << 19)}},  # 2 MiB
            },
            "loops": {},
        }

    def ctx(wait: int) -> st.SaveContext:
        return st.SaveContext(lambda: dump(wait), frozenset(), Converter())

    def resume(data: dict) -> dict:
        holder = st.receivers()
        holder["lightning"].value = st.LightningState(ctx(0)).state_dict()  # rank 0's
        holder["state_dict"].value = {}
        holder["optimizer_states"].value = {"optimizers": []}
        holder["data"].obj.value = data
        return st.assemble(holder)["callbacks"]

    rank1 = st.LoaderStates(ctx(2), Converter()).state_dict()  # what rank 1 saves
    es = resume(rank1)["EarlyStopping{'monitor': 'train_loss'}"]
    assert es["wait_count"] == 2 and float(es["best_score"]) == 2.5
    assert "SWA" not in rank1["callbacks"]  # large: rank 0's only
    assert resume(rank1)["SWA"]["average_model_state"]["w"].numel() == 1 << 19
    # a checkpoint of an earlier version (no per-rank states): rank 0's, as before
    assert resume({"loaders": []})["EarlyStopping{'monitor': 'train_loss'}"]["wait_count"] == 0
    # written by 2 ranks, resumed on 1 (this process): rank 0's, and the log says so
    with caplog.at_level("INFO"):
        es = resume({**rank1, "callbacks_world_size": 2})["EarlyStopping{'monitor': 'train_loss'}"]
    assert es["wait_count"] == 0
    assert "written by 2 ranks, this run has 1" in caplog.text


def test_a_rank_the_checkpoint_has_no_files_of_keeps_fresh_streams_when_training_on(monkeypatch):
    """The streams taken before a stop's validation are a rank's own: resumed on more ranks,
    a rank the checkpoint has no files of (which loads rank 0's part) does not take rank 0's,
    as the core leaves it its fresh streams."""
    from resilient_callbacks.lightning import rank_callbacks as rcb

    saved = {"info": {}, "tensors": {"torch_cpu": torch.get_rng_state()}}
    data = {rcb.WORLD_SIZE_KEY: 1, rcb.STOP_RNG_KEY: saved}  # written by one rank
    ckpt: dict = {}
    rcb.put_back(ckpt, data)
    assert ckpt[rcb.STOP_RNG_KEY] is saved  # rank 0: its own
    monkeypatch.setattr(rcb.dist, "rank", lambda: 1)
    monkeypatch.setattr(rcb.dist, "world_size", lambda: 2)
    ckpt = {}
    rcb.put_back(ckpt, data)
    assert rcb.STOP_RNG_KEY not in ckpt


class _Opaque:
    """Picklable (so Lightning keeps it in hparams) but not JSON-able."""


class _Tiny(L.LightningModule):
    def __init__(self, **hparams):
        super().__init__()
        self.save_hyperparameters(hparams)
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Scheduled(_Tiny):
    def __init__(self, schedulers: int) -> None:
        super().__init__()
        self.schedulers = schedulers

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.schedulers:
            return opt
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]


class _TwoOptimizersManual(L.LightningModule):
    """Manual optimization with two optimizers (a GAN's shape): each batch steps both, so
    trainer.global_step goes up by 2 a batch; noise from the global RNG in the loss."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.g = torch.nn.Linear(4, 4)
        self.d = torch.nn.Linear(4, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        x = batch[0]
        loss_d = (self.d(x) - self.d(self.g(x).detach())).pow(2).mean() + torch.rand(()) * 1e-3
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = self.d(self.g(x)).pow(2).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.losses += [loss_d.item(), loss_g.item()]

    def configure_optimizers(self):
        return (
            torch.optim.AdamW(self.g.parameters(), lr=0.01),
            torch.optim.SGD(self.d.parameters(), lr=0.1, momentum=0.9),
        )


def test_manual_optimization_with_two_optimizers_resumes_as_the_run_without_it(tmp_path):
    """Two optimizers stepped by hand: global_step moves 2 a batch, so every_n_steps=3 saves
    the first step past each multiple of 3; stopped at step 12 (6 batches, in epoch 0) and
    resumed, the run equals the one without the callback, loss for loss and in its weights."""

    def fit(*callbacks, max_steps):
        L.seed_everything(0, verbose=False)
        module = _TwoOptimizersManual()
        _tiny_fit(tmp_path, module, *callbacks, max_steps=max_steps)
        return module

    plain = fit(max_steps=40)
    first = fit(ResilientCheckpoint(tmp_path / "ck", every_n_steps=3), max_steps=12)
    assert [e.step for e in _committed(tmp_path / "ck")] == [4, 6, 10, 12]
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=3)
    resumed = fit(rc, max_steps=40)
    assert rc.restored_step == 12
    assert first.losses + resumed.losses == plain.losses
    for a, b in zip(plain.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def _tiny_fit(tmp_path: Path, module: L.LightningModule, *callbacks, max_steps: int = 4):
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4))
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True))
    return trainer


def test_hparams_are_converted_or_reported_and_resume_works(tmp_path):
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    with pytest.warns(HparamsConversionWarning, match=r"'thing'.*_Opaque.*repr"):
        _tiny_fit(tmp_path, _Tiny(data=Path("/d"), thing=_Opaque()), rc)
    saved = json.loads((Path(_committed(tmp_path / "ck")[-1].path) / "shared.json").read_text())
    assert "/d" in json.dumps(saved) and "_Opaque object at" in json.dumps(saved)
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    with pytest.warns(HparamsConversionWarning):
        trainer = _tiny_fit(tmp_path, _Tiny(data=Path("/d"), thing=_Opaque()), rc, max_steps=6)
    assert rc.restored_step == 4 and trainer.global_step == 6


def test_without_a_schedule_it_says_it_saves_the_last_step_and_on_preemption(tmp_path, caplog):
    """ResilientCheckpoint() without every_n_steps/every_seconds/adaptive/loss_jump: one line
    at the start says when it saves (not the core's warning, written for users who call
    step() and save() themselves), and it saves the last step."""
    with caplog.at_level("INFO"):
        _tiny_fit(tmp_path, _Tiny(), ResilientCheckpoint(tmp_path / "ck"))
    said = "it saves at the last step of fit() and on preemption only"
    assert caplog.text.count(said) == 1, caplog.text
    assert "no save schedule is configured" not in caplog.text
    assert [e.step for e in _committed(tmp_path / "ck")] == [4]
    caplog.clear()
    with caplog.at_level("INFO"):
        _tiny_fit(tmp_path / "b", _Tiny(), ResilientCheckpoint(tmp_path / "b", adaptive=True))
    assert said not in caplog.text


@pytest.mark.slow  # suite time budget (the read-only restore itself: tests/test_read_only.py)
def test_an_evaluation_loads_the_lightning_module_alone_read_only(tmp_path):
    """A Lightning run's checkpoint holds the LightningModule's state dict under
    "state_dict", beside Lightning's loop state: an evaluation job restores the module alone
    with a read-only Checkpointer, and a module of another shape is refused by name."""
    from resilient_callbacks import Checkpointer

    trained = _Tiny()
    _tiny_fit(tmp_path, trained, ResilientCheckpoint(tmp_path / "ck", every_n_steps=2))
    evaluated = _Tiny()
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.restore({"state_dict": evaluated}) == 4
    assert torch.equal(evaluated.lin.weight, trained.lin.weight)
    other = _Tiny()
    other.lin = torch.nn.Linear(4, 2)
    with (
        Checkpointer(tmp_path / "ck", read_only=True) as ck,
        pytest.raises(CheckpointMismatchError, match=r"lin.weight'\]: shape \[1, 4\]"),
    ):
        ck.restore({"state_dict": other})


class _BadCallback(L.Callback):
    def state_dict(self):
        return {"thing": _Opaque()}


def test_unsaveable_callback_state_fails_before_training(tmp_path):
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    module = _Tiny()
    with pytest.raises(UnsupportedStateError, match=r"_BadCallback.*_Opaque"):
        _tiny_fit(tmp_path, module, _BadCallback(), rc)
    assert module.global_step == 0  # not a single step was trained
    assert not _committed(tmp_path / "ck")


class _ScaleAtStart(L.Callback):
    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler, self.scale = scaler, None

    def on_train_start(self, trainer, pl_module):
        self.scale = self.scaler.get_scale()


def test_amp_grad_scaler_state_is_restored(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    def fit(steps: int) -> tuple[ResilientCheckpoint, _ScaleAtStart, torch.amp.GradScaler]:
        # the scale doubles after every step (growth_interval=1): 1024 * 2**steps
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        rc, probe = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2), _ScaleAtStart(scaler)
        # Small fixed inputs: the fp16 loss scaled by up to 2**16 must not overflow (an
        # overflow skips the step and halves the scale, whatever the global RNG left behind).
        x = 0.1 * torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        ds = torch.utils.data.TensorDataset(x)
        L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            callbacks=[rc, probe],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(_Tiny(), torch.utils.data.DataLoader(ds, batch_size=4))
        return rc, probe, scaler

    _, _, scaler = fit(4)
    assert scaler.get_scale() == 1024.0 * 2**4
    rc, probe, scaler = fit(6)
    assert rc.restored_step == 4
    assert probe.scale == 1024.0 * 2**4  # restored before the first step ...
    assert scaler.get_scale() == 1024.0 * 2**6  # ... and continued


@pytest.mark.parametrize("before, after", [("bf16-true", "bf16-true"), ("32-true", "bf16-true")])
def test_a_resume_in_another_precision_says_the_weights_are_cast(tmp_path, before, after):
    """Lightning resumed in another precision cast the weights in silence (the core and the
    Trainer's adapter say so); a bf16-true run resumed as bf16-true is exact and says nothing,
    though the module is still fp32 when the checkpoint is checked (the precision plugin
    converts it after the restore). The warning names the user's fit() line."""

    def fit(precision: str, steps: int) -> ResilientCheckpoint:
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
        ds = torch.utils.data.TensorDataset(torch.randn(32, 4))
        L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            precision=precision,
            callbacks=[rc],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(_Tiny(), torch.utils.data.DataLoader(ds, batch_size=4))  # the line warned at
        return rc

    fit(before, 2)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert fit(after, 4).restored_step == 2
    cast = [w for w in got if "cast to the dtype" in str(w.message)]
    if before == after:
        assert cast == []
    else:
        assert len(cast) == 1 and str(cast[0].message).startswith("2 tensor(s)"), cast
        assert "lin.weight: float32 in checkpoint, bfloat16 here" in str(cast[0].message)
        assert cast[0].filename == __file__


class _Weights(L.Callback):
    """Copies of the weights after each optimizer step."""

    def __init__(self) -> None:
        self.after: dict[int, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = pl_module.lin.weight.detach().clone()


@pytest.mark.parametrize("wait", [True, False], ids=["awaited", "control-not-awaited"])
def test_overlapped_snapshot_is_awaited_before_the_next_optimizer_step(tmp_path, monkeypatch, wait):
    """The copy of parameters runs in the background while the next forward/backward runs; made
    slow here, it must still hold the weights of the saved step: the callback waits for it in
    on_before_optimizer_step. The control skips that wait and gets the next step's weights.

    The control's copy starts once step 3 has ended, not after a fixed 0.3 s: on a loaded
    machine step 3 could take longer than that, and the control read step 2's weights."""
    import threading

    from resilient_callbacks import snapshot

    copy_later = snapshot.Snapshot._copy_later
    stepped = threading.Event()

    class _StepEnded(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step >= 3:
                stepped.set()

    def slow(self, items, stream):
        if wait:
            time.sleep(0.3)  # late: only the callback's wait keeps the next step out
        else:
            stepped.wait(60)  # nothing waits for the copy: it reads a later step's weights
        copy_later(self, items, stream)

    monkeypatch.setattr(snapshot.Snapshot, "_copy_later", slow)
    rc, weights = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2), _Weights()
    if not wait:
        from resilient_callbacks import saving

        class _NoHook:
            def remove(self) -> None:
                pass

        monkeypatch.setattr(rc, "on_before_optimizer_step", lambda *a: None)
        # and the global pre-step hook with which every torch optimizer's step waits
        monkeypatch.setattr(saving, "register_optimizer_step_pre_hook", lambda fn: _NoHook())
    _tiny_fit(tmp_path, _Tiny(), rc, weights, _StepEnded(), max_steps=4)
    step2 = next(e for e in _committed(tmp_path / "ck") if e.step == 2)
    saved = load_file(str(Path(step2.path) / "shared.safetensors"))
    (key,) = [k for k in saved if k.endswith("lin.weight")]
    assert not torch.equal(weights.after[2], weights.after[3])
    assert torch.equal(saved[key], weights.after[2]) is wait
    if not wait:  # a later step's weights
        assert any(torch.equal(saved[key], w) for s, w in weights.after.items() if s > 2)


class _FrozenBackbone(_Tiny):
    """A frozen layer (blob-sized) before the trained one: what incremental saves are for."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Linear(4, 4096).requires_grad_(False)
        self.lin = torch.nn.Linear(4096, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(self.backbone(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.lin.parameters(), lr=0.1)


def test_incremental_saves_store_a_frozen_layer_once_and_resume(tmp_path):
    """``incremental=True`` under Lightning: every save commits (the callback's optimizer-state
    value must tell which parameters its optimizers step), the frozen layer is one blob that
    every checkpoint refers to, a re-run restores from it, and ``export`` writes the module's
    weights."""
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2, incremental=True)
    module = _FrozenBackbone()
    _tiny_fit(tmp_path, module, rc, max_steps=6)
    steps = [e.step for e in _committed(tmp_path / "ck")]
    assert steps == [2, 4, 6]
    refs = [
        json.loads((Path(e.path) / "shared.json").read_text())["blobs"]
        for e in _committed(tmp_path / "ck")
    ]
    frozen = {r[k] for r in refs for k in r if "/backbone." in k}
    trained = {r[k] for r in refs for k in r if k.endswith("lin.weight")}
    assert len(frozen) == 2 and len(trained) == 3  # weight + bias, once; a new one per save
    assert set(os.listdir(tmp_path / "ck" / "blobs")) == frozen | trained
    again = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2, incremental=True)
    resumed = _FrozenBackbone()
    _tiny_fit(tmp_path, resumed, again, max_steps=6)
    assert again.restored_step == 6
    assert torch.equal(resumed.backbone.weight, module.backbone.weight)
    assert torch.equal(resumed.lin.weight, module.lin.weight)
    # `resilient-ckpt export`: the LightningModule's state dict (blobs resolved)
    from resilient_callbacks.cli import main

    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "exported")]) == 0
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert exported.keys() == module.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in module.state_dict().items())


def test_the_last_step_is_uploaded_whatever_remote_every_n_saves(tmp_path):
    """The end of training is a final save, which the remote tier always takes: with
    remote_every_n_saves=100 the last step reached the remote only if it was a 100th."""
    remote = tmp_path / "remote"
    rc = ResilientCheckpoint(
        tmp_path / "ck", every_n_steps=4, remote=f"file://{remote}", remote_every_n_saves=100
    )
    _tiny_fit(tmp_path, _Tiny(), rc, max_steps=6)
    uploaded = sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))
    assert uploaded == ["step_000000006"]


class _Wider(_Tiny):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.extra = torch.nn.Linear(2, 2)


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    _tiny_fit(tmp_path, _Tiny(), ResilientCheckpoint(tmp_path / "ck", every_n_steps=2))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"(?s)missing in the checkpoint: extra.bias.*lin.weight: \[1, 4\] in the checkpoint",
    ):
        _tiny_fit(tmp_path, _Wider(), ResilientCheckpoint(tmp_path / "ck", every_n_steps=2))


class _Renamed(_Tiny):
    """``_Tiny`` with its layer renamed; its ``on_load_checkpoint`` upgrades older checkpoints."""

    def __init__(self):
        super().__init__()
        self.body = self.lin
        del self.lin

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).pow(2).mean()

    def on_load_checkpoint(self, checkpoint):
        sd = checkpoint["state_dict"]
        for k in [k for k in sd if k.startswith("lin.")]:
            sd["body." + k.removeprefix("lin.")] = sd.pop(k)


def test_a_modules_on_load_checkpoint_may_rename_the_saved_weights(tmp_path):
    """Lightning calls the module's ``on_load_checkpoint`` before it loads the weights, so a
    hook may upgrade a checkpoint of an older layout, as with ``fit(ckpt_path=...)``. Found
    2026-12-06: our check of the keys ran before the hook and refused the resume
    (``CheckpointMismatchError``)."""
    torch.manual_seed(0)
    plain = _Tiny()
    _tiny_fit(tmp_path / "plain", plain, max_steps=6)
    torch.manual_seed(0)
    _tiny_fit(tmp_path, _Tiny(), ResilientCheckpoint(tmp_path / "ck", every_n_steps=2))
    torch.manual_seed(0)
    renamed, rc = _Renamed(), ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    _tiny_fit(tmp_path, renamed, rc, max_steps=6)
    assert rc.restored_step == 4
    assert torch.equal(renamed.body.weight, plain.lin.weight)
    assert torch.equal(renamed.body.bias, plain.lin.bias)


class _Handlers(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.during = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]


def test_sigterm_is_ours_during_fit_and_handlers_are_restored_after(tmp_path):
    """Lightning's signal connector registers its SIGTERM handler when training starts; during
    training the Checkpointer's handler is in place instead, and after fit the handlers from
    before fit are back."""
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]
    probe = _Handlers()
    _tiny_fit(tmp_path, _Tiny(), ResilientCheckpoint(tmp_path / "ck", every_n_steps=2), probe)
    assert [getattr(h, "__qualname__", h) for h in probe.during] == [
        "PreemptionWatcher._on_signal"
    ] * 2
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)] == before


class _SignalAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:  # during step self.step + 1
            os.kill(os.getpid(), signal.SIGUSR1)


def test_preemption_without_exit_stops_fit_after_the_emergency_save(tmp_path):
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100, exit_on_preemption=False)
    trainer = _tiny_fit(tmp_path, _Tiny(), rc, _SignalAt(2), max_steps=20)
    assert rc.preempted and trainer.global_step == 3
    (only,) = _committed(tmp_path / "ck")
    assert only.step == 3 and only.manifest.reason == "emergency"


def test_an_unsupported_strategy_is_refused_before_training(tmp_path):
    class HomeMadeStrategy:  # a strategy of none of the supported kinds
        pass

    rc = ResilientCheckpoint(tmp_path / "ck")
    fake = types.SimpleNamespace(strategy=HomeMadeStrategy(), callbacks=[rc])
    with pytest.raises(ConfigError, match=r"does not support HomeMadeStrategy yet.*FSDPStrategy"):
        rc.setup(fake, None, "fit")  # type: ignore[arg-type]


@pytest.mark.slow  # (suite time: a default test covers the same contract)
@pytest.mark.distributed
@pytest.mark.parametrize(
    "stage", [3, pytest.param(2, marks=pytest.mark.slow), pytest.param(0, marks=pytest.mark.slow)]
)
def test_deepspeed_strategy_sigkill_then_rerun_is_bit_exact(tmp_path, stage):
    """Lightning's DeepSpeedStrategy (on the CPU: lightning_train.cpu_deepspeed_strategy skips
    Lightning's CUDA check only), with our section in its DeepSpeed config: SIGKILL mid-epoch,
    the same command again continues exactly. The ZeRO partitions are in our files, the
    section's keep_last applied, and the section never reached DeepSpeed (no warning). The
    callback's default overlapped snapshot defers the ZeRO ranges (stages 1-3); each deferred
    copy is held until the optimizer step's wait (tests/ds_train.py: RC_HOLD_DEFERRED)."""
    more = ["--deepspeed", str(stage)]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    held = _env({"RC_HOLD_DEFERRED": str(run / "deferred")})
    reference = _start(_argv(ref, *more), ref / "err.txt")
    kill_at = random.Random(f"{SEED}-deepspeed").randint(10, 20)
    first = _start(  # it waits in step kill_at until killed
        _argv(run, "--sleep", "0.02", "--hold-at", str(kill_at), *more), run / "err1.txt", held
    )
    killed = _wait_for_step(run / "losses.jsonl", 0, kill_at, first, run / "err1.txt")
    _kill(first)
    _finish(reference, ref / "err.txt")

    err = _finish(_start(_argv(run, *more), run / "err2.txt", held), run / "err2.txt")
    if stage:  # the saves deferred the ZeRO ranges (the re-run's close() waited for its own)
        deferred = (run / "deferred.rank0").read_text().split()
        assert deferred and all(int(n) > 0 for n in deferred), deferred
    resumed = _restored(err)
    assert 0 < resumed <= killed and killed - resumed <= 2 * EVERY, (resumed, killed)
    assert "nothing is being checkpointed" not in err and UNRELIABLE not in err
    committed = _committed(run / "ckpt")
    assert len(committed) == 3  # keep_last=3, from the DeepSpeed config's section
    files = {f.path for f in committed[-1].manifest.files}
    if stage:
        assert "parts/engine/zero/rank_00000.safetensors" in files
    assert not list((run / "ckpt").rglob("*.pt"))  # nothing of DeepSpeed's own pickles
    _assert_same_run(ref, run)


def test_options_are_checked_at_construction(tmp_path):
    with pytest.raises(TypeError, match="every_n_step"):
        ResilientCheckpoint(tmp_path, every_n_step=5)
    with pytest.raises(ConfigError, match="keep_last"):
        ResilientCheckpoint(tmp_path, keep_last=0)
    with pytest.raises(ConfigError, match="data_seed"):
        ResilientCheckpoint(tmp_path, data_seed="1")


# ----------------------------------------------------------------------------- real processes


def test_sigkill_then_sigterm_then_rerun_is_bit_exact(tmp_path, reference):
    """Run 1 (a process) is SIGKILLed mid-epoch; run 2 (a process) resumes and gets SIGTERM:
    it saves the step it is in and exits 75; run 3 (in this process, to save a start-up)
    resumes there and finishes. Together: the reference run."""
    ref = reference("plain")
    rng = random.Random(f"{SEED}-plain")
    kill_at = rng.randint(14, 30)
    term_at = rng.randint(kill_at + 8, 50)
    jsonl = tmp_path / "losses.jsonl"
    argv = _argv(tmp_path)

    # each run waits in the chosen step for its signal (--hold-at): it lands there however
    # loaded the machine (the SIGTERM had 14 steps of 0.02 s to land before the run ended;
    # no sleep per step since)
    p = _start([*argv, "--hold-at", str(kill_at)], tmp_path / "err1.txt")
    killed = _wait_for_step(jsonl, 0, kill_at, p, tmp_path / "err1.txt")
    _kill(p)

    offset = jsonl.stat().st_size
    p = _start([*argv, "--hold-at", str(term_at)], tmp_path / "err2.txt")
    _wait_for_step(jsonl, offset, term_at, p, tmp_path / "err2.txt")
    os.kill(p.pid, signal.SIGTERM)
    err2 = _finish(p, tmp_path / "err2.txt", expect=RESUMABLE_EXIT_CODE)
    resumed = _restored(err2)
    assert 0 < resumed <= killed and killed - resumed <= 2 * EVERY, (killed, resumed)
    last = _records(jsonl)[-1]["step"]
    newest = _committed(tmp_path / "ckpt")[-1]
    assert newest.step == last and newest.manifest.reason == "emergency", err2
    assert UNRELIABLE not in err2

    rc, caught = _run_inprocess(_argv(tmp_path))  # the same script, to the end
    assert rc.restored_step == last
    assert not [w for w in caught if UNRELIABLE in w]
    counts = {s: sum(1 for r in _records(jsonl) if r["step"] == s) for s in range(1, TOTAL + 1)}
    assert all(counts[s] == 1 for s in range(1, resumed + 1)), counts  # nothing replayed ...
    assert all(counts[s] >= 2 for s in range(resumed + 1, killed + 1)), counts  # ... or skipped
    _assert_same_run(ref, tmp_path)


@pytest.mark.slow  # StatefulDataLoader and SIGUSR1 are each covered by faster default tests
def test_stateful_dataloader_sigkill_then_slurm_sigusr1_then_rerun_is_bit_exact(
    tmp_path, reference
):
    """With torchdata's StatefulDataLoader, and run 2 under Slurm (Lightning's SLURMEnvironment
    with auto-requeue): SIGUSR1 gives one emergency checkpoint by us, exit 75, and no HPC
    checkpoint or requeue attempt by Lightning."""
    ref = reference("stateful")
    rng = random.Random(f"{SEED}-stateful")
    kill_at = rng.randint(14, 30)
    usr1_at = rng.randint(kill_at + 8, 50)
    jsonl = tmp_path / "losses.jsonl"
    argv = _argv(tmp_path, "--sleep", "0.02", loader="stateful")

    p = _start([*argv, "--hold-at", str(kill_at)], tmp_path / "err1.txt")  # waits to be killed
    killed = _wait_for_step(jsonl, 0, kill_at, p, tmp_path / "err1.txt")
    _kill(p)

    slurm = {
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }
    offset = jsonl.stat().st_size
    p = _start([*argv, "--hold-at", str(usr1_at)], tmp_path / "err2.txt", env=_env(slurm))
    _wait_for_step(jsonl, offset, usr1_at, p, tmp_path / "err2.txt")
    os.kill(p.pid, signal.SIGUSR1)
    err2 = _finish(p, tmp_path / "err2.txt", expect=RESUMABLE_EXIT_CODE)
    assert "(SLURMEnvironment)" in err2  # Lightning did see a Slurm job
    resumed = _restored(err2)
    assert 0 < resumed <= killed and killed - resumed <= 2 * EVERY, (killed, resumed)
    last = _records(jsonl)[-1]["step"]
    emergencies = [e for e in _committed(tmp_path / "ckpt") if e.manifest.reason == "emergency"]
    assert [e.step for e in emergencies] == [last], err2
    assert not list(tmp_path.rglob("hpc_ckpt_*.ckpt"))
    assert "Handling auto-requeue signal" not in err2  # Lightning's SIGUSR1 handler never ran

    rc, caught = _run_inprocess(_argv(tmp_path, loader="stateful"))  # to the end
    assert rc.restored_step == last
    assert UNRELIABLE not in err2 and not [w for w in caught if UNRELIABLE in w]
    # torchdata's loader resumed at an epoch's last batch (13 per epoch) puts Lightning one
    # epoch ahead (docs/lightning.md): the same losses and weights, other epoch numbers
    _assert_same_run(ref, tmp_path, places=all(s % 13 for s in (resumed, last)))


class _Job:
    """Two ranks of one DDP run, started like torchrun does (LOCAL_RANK, WORLD_SIZE, MASTER_*
    in the environment; Lightning then launches nothing itself), both at once."""

    def __init__(self, work: Path, name: str, *more: str) -> None:
        port = str(free_port())
        self.errs = [work / f"{name}.rank{r}.txt" for r in (0, 1)]
        self.procs = []
        for r in (0, 1):
            env = _env(
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "WORLD_SIZE": "2",
                    "NODE_RANK": "0",
                    "LOCAL_RANK": str(r),
                }
            )
            argv = _argv(work, "--devices", "2", *more)
            self.procs.append(_start(argv, self.errs[r], env=env))

    def kill(self) -> None:
        for p in self.procs:
            _kill(p)

    def finish(self) -> list[str]:
        return [_finish(p, e) for p, e in zip(self.procs, self.errs, strict=True)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        pytest.param("ddp-stateful-loader", marks=pytest.mark.slow),  # suite time budget
        # suite budget: lightning/sharded.py runs by default through DeepSpeedStrategy (ZeRO 3),
        # Sharded on 2 FSDP2 ranks through test_dcp_sharded.py
        pytest.param("fsdp2", marks=[pytest.mark.slow, needs_dcp]),
        pytest.param("fsdp1", marks=[pytest.mark.slow, needs_dcp]),
        pytest.param("deepspeed", marks=pytest.mark.slow),
    ],
)
def test_two_processes_sigkill_then_rerun_is_bit_exact(tmp_path, strategy):
    """strategy='ddp', ModelParallelStrategy with FSDP2 ``fully_shard`` and FSDPStrategy (FSDP1)
    (sharded checkpoints: each rank writes its own shards), and DeepSpeedStrategy with ZeRO 2 (each rank its
    partitions; on the CPU as in lightning_train.cpu_deepspeed_strategy), on 2 CPU processes
    (gloo). The reference and the run to be killed run side by side; both ranks are SIGKILLed
    mid-epoch, and the same command started again continues exactly, on each rank.
    'ddp-stateful-loader': torchdata's StatefulDataLoader with its own DistributedSampler
    (found 2026-11-25: Lightning restored it before telling the sampler the epoch, so it
    replayed epoch 0's order)."""
    more = {
        "ddp": [],
        "ddp-stateful-loader": ["--loader", "stateful-dist"],
        "fsdp2": ["--fsdp2"],
        "fsdp1": ["--fsdp1"],
        "deepspeed": ["--deepspeed", "2"],
    }[strategy]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    reference = _Job(ref, "err", *more)
    kill_at = random.Random(f"{SEED}-ddp").randint(10, 20)  # 7 batches per epoch and rank
    first = _Job(run, "err1", "--sleep", "0.02", "--hold-at", str(kill_at), *more)  # till killed
    killed = _wait_for_step(run / "losses.jsonl.rank0", 0, kill_at, first.procs[0], first.errs[0])
    first.kill()
    reference.finish()

    errs = _Job(run, "err2", *more).finish()
    resumed = [_restored(e, r) for r, e in enumerate(errs)]
    assert resumed[0] == resumed[1] and 0 < resumed[0] <= killed, (resumed, killed)
    assert killed - resumed[0] <= 2 * EVERY, (resumed, killed)
    assert not [e for e in errs if UNRELIABLE in e]
    assert {e.manifest.world_size for e in _committed(run / "ckpt")} == {2}
    if not strategy.startswith("ddp"):  # the weights and Adam moments: each rank's own files
        newest = _committed(run / "ckpt")[-1].path
        folder = {"fsdp2": ("sharded",), "fsdp1": ("sharded",), "deepspeed": ("engine", "zero")}[
            strategy
        ]
        shards = sorted(p.name for p in Path(newest, "parts", *folder).iterdir())
        assert shards == [f"rank_0000{r}.{x}" for r in (0, 1) for x in ("json", "safetensors")]
    for r in (0, 1):
        _assert_same_run(ref, run, suffix=f".rank{r}")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    ["ddp", pytest.param("fsdp1", marks=needs_dcp), pytest.param("fsdp2", marks=needs_dcp)],
)
def test_two_processes_the_callback_changes_nothing(tmp_path, strategy):
    """Two ranks trained with and without the callback, side by side: per-step losses and final
    weights of every rank are bit-identical (the callback's saves, including the sharded ones,
    and its rebuilt loader change nothing in a run that is never interrupted)."""
    more = {"ddp": [], "fsdp2": ["--fsdp2"], "fsdp1": ["--fsdp1"]}[strategy]
    without, with_ = tmp_path / "without", tmp_path / "with"
    without.mkdir()
    with_.mkdir()
    a = _Job(without, "err", "--no-callback", *more)
    b = _Job(with_, "err", *more)
    a.finish()
    b.finish()
    assert len(_committed(with_ / "ckpt")) >= 2
    for r in (0, 1):
        _assert_same_run(without, with_, suffix=f".rank{r}")


class _TwoStage(L.LightningModule):
    """Momentum SGD whose learning rate the script changes between two fit() calls."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.lr = 0.1
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        self.lrs.append(self.optimizers().param_groups[0]["lr"])
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def _fit_twice(tmp_path: Path, callbacks: list) -> _TwoStage:
    torch.manual_seed(0)
    module = _TwoStage()
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4))
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=8))
    module.lr = 0.01  # stage 2: a smaller learning rate, fresh optimizer state
    trainer.fit_loop.max_epochs = 4
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=8))
    return module


def test_a_second_fit_of_the_same_trainer_goes_on_from_the_live_state(tmp_path):
    """The second fit() restored the first one's last checkpoint: its optimizer (momentum,
    learning rate 0.1 instead of the 0.01 configure_optimizers now gives) and RNG, so adding
    the callback changed the run. It goes on as without the callback, as the same run."""
    plain = _fit_twice(tmp_path / "plain", [])
    ck = tmp_path / "ck"
    ours = _fit_twice(tmp_path / "ours", [ResilientCheckpoint(ck, every_n_steps=4)])
    assert ours.lrs == plain.lrs and ours.lrs[-1] == 0.01
    assert torch.equal(ours.lin.weight, plain.lin.weight)
    steps = [e.step for e in _committed(ck)]
    assert steps == [4, 8, 12, 16], steps
    assert len({e.manifest.run_id for e in _committed(ck)}) == 1  # one run


def test_a_new_trainer_of_the_module_a_finished_fit_trained_is_refused(tmp_path):
    """A fine-tuning Trainer after a pre-training one, same module, both at the default
    dirpath: it resumed the finished pre-training run and trained nothing, silently. A new
    module (the script or notebook cell run again) still resumes as usual."""
    module = _Tiny()
    _tiny_fit(tmp_path, module, ResilientCheckpoint(every_n_steps=2))
    with pytest.raises(ConfigError, match="its own dirpath"):
        _tiny_fit(tmp_path, module, ResilientCheckpoint(every_n_steps=2))
    # its own directory, or an explicit resume=, passes
    _tiny_fit(tmp_path, module, ResilientCheckpoint(tmp_path / "stage2", every_n_steps=2))
    trainer = _tiny_fit(tmp_path, module, ResilientCheckpoint(every_n_steps=2, resume=4))
    assert trainer.global_step == 4
    cb = ResilientCheckpoint(every_n_steps=2)
    _tiny_fit(tmp_path, _Tiny(), cb)
    assert cb.restored_step == 4


class _Validated(_Tiny):
    """Each validation step lets a held overlapped copy start, then waits for it: the copy
    reads the parameters while validation runs (tests below). The events are the class's:
    WeightAveraging deep-copies the module."""

    events: ClassVar[dict] = {}

    def validation_step(self, batch, batch_idx):
        self.events["may_copy"].set()
        self.events["copied"].wait(timeout=20)


def test_a_validation_after_a_save_and_before_the_next_step_sees_the_copy_done(
    tmp_path, monkeypatch
):
    """Lightning's WeightAveraging writes the averaged weights into the model in place for
    validation. With gradient accumulation a validation can come after a save and before the
    next optimizer step, whose pre-step wait came too late: the overlapped copy read the
    averaged weights (here held until the validation runs). The callback now waits for the copy
    when validation starts."""
    import threading

    from resilient_callbacks import snapshot

    WeightAveraging = getattr(L.pytorch.callbacks, "WeightAveraging", None)
    if WeightAveraging is None:
        pytest.skip(f"Lightning {L.__version__} has no WeightAveraging (2.6 added it)")

    events = {"may_copy": threading.Event(), "copied": threading.Event()}
    copy_later = snapshot.Snapshot._copy_later

    def held(self, items, stream):
        events["may_copy"].wait(timeout=3)  # (only if nothing lets it go: a failure)
        copy_later(self, items, stream)
        events["copied"].set()

    wait_device = snapshot.Snapshot.wait_device

    def waited_for(self):
        # the training thread waits for a held copy: it goes at once (the fixed callback waits
        # at on_validation_start, and waited out the 3 s above); before the fix nothing waited
        # for it before the validation step let it go
        if self._thread is not None:
            events["may_copy"].set()
        wait_device(self)

    monkeypatch.setattr(snapshot.Snapshot, "_copy_later", held)
    monkeypatch.setattr(snapshot.Snapshot, "wait_device", waited_for)
    trained = {}

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            trained.setdefault(trainer.global_step, pl_module.lin.weight.detach().clone())

    ds = torch.utils.data.TensorDataset(torch.randn(32, 4))
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    trainer = L.Trainer(
        max_steps=3,
        accumulate_grad_batches=2,
        val_check_interval=5,  # after batch 5: step 2 was saved after batch 4, step 3 is batch 6's
        limit_val_batches=1,
        num_sanity_val_steps=0,
        accelerator="cpu",
        callbacks=[WeightAveraging(), Record(), rc],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    monkeypatch.setattr(_Validated, "events", events)
    trainer.fit(_Validated(), loader, loader)
    assert events["copied"].is_set()
    (saved,) = [e for e in _committed(tmp_path / "ck") if e.step == 2]
    tensors = load_file(Path(saved.path) / "shared.safetensors")
    # WeightAveraging saves the averaged weights as "state_dict", the trained ones beside them
    assert torch.equal(tensors["lightning/current_model_state/lin.weight"], trained[2])


def test_a_fresh_start_says_once_where_it_looked(tmp_path, caplog):
    """The core logs the folder a fresh start looked in (and what a relative dirpath was
    resolved against); the callback then said "no checkpoint in ...: starting fresh" again
    on every fresh fit."""
    import logging

    caplog.set_level(logging.INFO, "resilient_callbacks")
    lightning_train.fit_warned(tmp_path, _Tiny(), 2, "-")
    said = [r.getMessage() for r in caplog.records if "no checkpoint in" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "ck") in said[0], said
