"""Under the Trainer, the restore's warning of LR scheduler settings the checkpoint replaces
points at the user's ``trainer.train(...)`` line and tells a Trainer's user where to set new
values: a ``TrainerCallback``'s ``on_train_begin``, not ``restore()``, which a Trainer's user
never calls; so does the warning of tensors cast to another dtype. A callback added for the
resumed run is no "removed" key."""

from __future__ import annotations

import sys
import warnings

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

import hf_train
from resilient_callbacks.transformers import ResilientCheckpoint


def _trainer(outdir, t_max: int, max_steps: int) -> Trainer:
    model = hf_train.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
    args = hf_train.training_args(str(outdir), max_steps, eval_strategy="no")
    data = hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1)
    return Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))


def test_changed_scheduler_settings_are_said_at_the_train_line_in_the_trainers_words(tmp_path):
    """Found 2026-12-07: the warning pointed into transformers/trainer.py and advised 'set them
    on the scheduler after restore()'."""
    ck = tmp_path / "ck"
    first = _trainer(tmp_path / "a", 10, 2)
    first.add_callback(ResilientCheckpoint(str(ck), every_n_steps=1))
    first.train()
    again = _trainer(tmp_path / "b", 100, 3)
    again.add_callback(ResilientCheckpoint(str(ck), every_n_steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line() + 1
        again.train()
    (said,) = [w for w in caught if "LR scheduler settings" in str(w.message)]
    text = str(said.message)
    assert "T_max=10 from the checkpoint (100 here)" in text, text
    assert (said.filename, said.lineno) == (__file__, line), (said.filename, said.lineno)
    assert "restore()" not in text and "on_train_begin" in text, text
    assert "Trainer's own resume_from_checkpoint" in text, text


def _line() -> int:
    return sys._getframe(1).f_lineno


class _Counts(TrainerCallback, ExportableState):
    """A callback with an exportable state, added in the resumed run only."""

    def __init__(self) -> None:
        self.n = 7

    def state(self) -> dict:
        return {"args": {}, "attributes": {"n": self.n}}


def test_an_exportable_callback_new_to_the_resumed_run_keeps_its_state_unsaid(tmp_path):
    """Found 2026-12-07: a callback with an exportable state added for the resumed run (an
    EarlyStoppingCallback) was warned about as a key 'not in the checkpoint: removed', with
    advice to set it in on_train_begin; it has no saved state and starts from its own, as under
    the Trainer's own resume."""
    ck = tmp_path / "ck"
    first = _trainer(tmp_path / "a", 10, 2)
    first.add_callback(ResilientCheckpoint(str(ck), every_n_steps=1))
    first.train()
    again = _trainer(tmp_path / "b", 10, 3)
    counts = _Counts()
    again.add_callback(counts)
    again.add_callback(ResilientCheckpoint(str(ck), every_n_steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.train()
    assert again.state.global_step == 3  # (resumed at 2)
    said = [str(w.message) for w in caught if "not in the checkpoint" in str(w.message)]
    assert said == [], said
    assert counts.n == 7


def test_a_cast_on_resume_is_said_at_the_train_line(tmp_path):
    """Found 2026-12-07: a checkpoint's tensors cast to the dtype they have here (a run resumed
    in bf16) were said at a line inside transformers/trainer.py."""
    ck = tmp_path / "ck"
    first = _trainer(tmp_path / "a", 10, 2)
    first.add_callback(ResilientCheckpoint(str(ck), every_n_steps=1))
    first.train()
    again = _trainer(tmp_path / "b", 10, 3)
    again.model.to(torch.bfloat16)
    again.add_callback(ResilientCheckpoint(str(ck), every_n_steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line() + 1
        again.train()
    (said,) = [w for w in caught if "cast to the dtype they have here" in str(w.message)]
    assert (said.filename, said.lineno) == (__file__, line), (said.filename, said.lineno)
