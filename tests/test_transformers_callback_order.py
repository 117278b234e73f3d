"""What callbacks listed before ``ResilientCheckpoint`` see at ``on_train_begin`` of a resumed
run: what they see under the Trainer's own ``train(resume_from_checkpoint=...)``, which loads
the ``TrainerState``, the callbacks' states and the weights before the first event -- the
restored step, epoch and log history, and the trained weights (a callback that copies them
there, an EMA's shadow weights, copies those)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback

import hf_train
from resilient_callbacks.transformers import ResilientCheckpoint

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]


class _Killed(Exception):
    pass


class _KillAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            raise _Killed(f"killed in step {self.step}")


class _SeesBegin(TrainerCallback):
    """Records what ``on_train_begin`` shows it: the step, epoch, log history, the weights."""

    def __init__(self) -> None:
        self.seen: tuple | None = None
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.seen = (state.global_step, state.epoch, list(state.log_history))
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_callback_before_ours_sees_the_resumed_run_at_train_begin_as_under_the_trainers_resume(
    tmp_path: Path,
):
    """It saw step 0, epoch 0, an empty log history and the initial weights: ours restored in
    its own on_train_begin, after theirs. One run writes both checkpoints of step 6 (the
    Trainer's and ours) and is killed in step 8; resumed by the Trainer from its checkpoint-6,
    and by ours (the same script again), the callback sees the same at on_train_begin."""

    def trainer(probe: TrainerCallback, *more: TrainerCallback):  # type: ignore[no-untyped-def]
        return hf_train.build_trainer(
            str(tmp_path / "out"),
            10,
            callbacks=[probe, *more],
            save_strategy="steps",
            save_steps=3,
        )

    def ours() -> ResilientCheckpoint:
        return ResilientCheckpoint(
            tmp_path / "ck", every_n_steps=3, trainer_checkpoints=True, log_save_metrics=False
        )

    first = trainer(_SeesBegin(), _KillAt(8))
    first.add_callback(ours())
    with pytest.raises(_Killed):
        first.train()
    theirs = _SeesBegin()
    trainer(theirs).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6"))
    probe = _SeesBegin()
    again = trainer(probe)
    again.add_callback(ours())
    again.train()
    assert theirs.seen is not None and theirs.seen[0] == 6
    assert probe.seen == theirs.seen
    assert probe.weights.keys() == theirs.weights.keys()
    assert all(torch.equal(probe.weights[k], v) for k, v in theirs.weights.items())


class _FailsAtBegin(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        raise RuntimeError("the user's callback failed at train begin")


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_callback_failing_at_train_begin_leaves_ours_closed_and_unwrapped(tmp_path, where):
    """Ours had opened its Checkpointer and wrapped the Trainer's methods; an error in any
    callback's on_train_begin left them open until the next train() (or the process's end)."""
    ours = ResilientCheckpoint(tmp_path / "ck", every_n_steps=3)
    callbacks = [_FailsAtBegin(), ours] if where == "before" else [ours, _FailsAtBegin()]
    trainer = hf_train.build_trainer(str(tmp_path / "out"), 4, callbacks=callbacks)
    with pytest.raises(RuntimeError, match="failed at train begin"):
        trainer.train()
    assert ours.checkpointer is not None and ours.checkpointer.closed
    assert "_run_epoch" not in vars(trainer) and "_maybe_log_save_evaluate" not in vars(trainer)
