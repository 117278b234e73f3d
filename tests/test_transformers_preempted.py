"""``exit_on_preemption=False`` under the Transformers Trainer: after the emergency checkpoint
``train()`` stops and returns (the process decides what to do), as the Lightning callback's
``fit()`` does, and the checkpoint is not recorded as a finished or stopped run: the same script
run again resumes there and trains to the end, as the uninterrupted run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback

import hf_train
from resilient_callbacks import catalog
from resilient_callbacks.transformers import ResilientCheckpoint

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]


class _SigtermAt(TrainerCallback):
    """A real SIGTERM to this process at the end of step ``step`` (before ours sees it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _steps(d: Path) -> list[int]:
    return [e.step for e in catalog.committed(catalog.scan(str(d), catalog.Depth.NONE))]


def _weights(trainer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.slow  # three short trainings: ~2.5 s each case, ~5 s the first of a process
@pytest.mark.parametrize("again_in", ["a new process", "the same trainer"])
def test_a_preemption_without_exit_stops_train_and_the_rerun_trains_to_the_end(tmp_path, again_in):
    """It trained on after the emergency save of step 3 to step 10 (saving 5 and 10): the
    minutes of a grace period spent on steps the re-run trains again, or a kill mid-save.
    train() called again on the same Trainer resumes too (a preempted training is not counted
    as finished: that one would start a new training in train-2/)."""
    plain = hf_train.build_trainer(str(tmp_path / "plain"), 10)
    plain.train()

    ck = tmp_path / "ck"
    first = hf_train.build_trainer(str(tmp_path / "out"), 10, callbacks=[_SigtermAt(3)])
    ours = ResilientCheckpoint(ck, every_n_steps=5, exit_on_preemption=False)
    first.add_callback(ours)
    out = first.train()
    assert ours.checkpointer is not None and ours.checkpointer.preempted
    assert out.global_step == 3 and _steps(ck) == [3]

    if again_in == "the same trainer":
        again, rerun = first, ours
    else:
        again = hf_train.build_trainer(str(tmp_path / "out"), 10)
        rerun = ResilientCheckpoint(ck, every_n_steps=5)
        again.add_callback(rerun)
    again.train()
    assert rerun.restored_step == 3 and again.state.global_step == 10
    assert _steps(ck) == [3, 5, 10]
    ref, got = _weights(plain), _weights(again)
    assert all(torch.equal(got[k], v) for k, v in ref.items())


class _Events(_SigtermAt):
    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.events: list[tuple[str, int]] = []

    def on_evaluate(self, args, state, control, **kwargs):
        self.events.append(("evaluate", state.global_step))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))


def test_a_preemption_without_exit_mid_epoch_runs_no_end_of_epoch_evaluation_or_save(tmp_path):
    """train() stopped at step 3 of a 13-step epoch by the preemption: the Trainer ended the
    epoch there, so eval_strategy/save_strategy="epoch" ran a whole evaluation and wrote a
    Trainer checkpoint of the partial epoch, inside the grace period."""
    events = _Events(3)
    trainer = hf_train.build_trainer(
        str(tmp_path / "out"),
        40,
        callbacks=[events],
        eval_strategy="epoch",
        save_strategy="epoch",
    )
    assert len(trainer.get_train_dataloader()) > 3  # (the preemption is mid-epoch)
    ours = ResilientCheckpoint(
        tmp_path / "ck", every_n_steps=5, exit_on_preemption=False, trainer_checkpoints=True
    )
    trainer.add_callback(ours)
    out = trainer.train()
    assert ours.checkpointer is not None and ours.checkpointer.preempted
    assert out.global_step == 3 and _steps(tmp_path / "ck") == [3]
    assert events.events == []
    assert not list((tmp_path / "out").glob("checkpoint-*"))
