"""The Trainer adapter re-run with another training dataset length (data added or removed between
runs), or other data settings, at an epoch's end and inside an epoch.

At an epoch's end the next epoch goes over the new data, with a warning: bit-identical to the
Trainer's own ``resume_from_checkpoint`` on the new data where that lands on the same epoch (the
epoch has as many optimizer steps as before); where the epoch's length changed, the Trainer's
own resume lands inside another epoch (``global_step // new steps an epoch``), while ours goes on
with the next epoch: each later epoch reads exactly what the Trainer reads in that epoch of the
new data, and the run is deterministic. Inside an epoch the new length is refused, naming the
checkpoint to resume from. The Trainer is the tiny GPT-2 of ``hf_train.py`` (batch 4,
accumulation 3: 50 samples are 13 batches, 5 optimizer steps an epoch, the last over 1 batch).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import hf_train
from resilient_callbacks import CheckpointMismatchError
from resilient_callbacks.transformers import ResilientCheckpoint

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]


def _updates(n: int, drop_last: bool = False) -> int:
    """Optimizer steps an epoch of ``n`` samples (batch 4, accumulation 3)."""
    batches = n // 4 if drop_last else math.ceil(n / 4)
    return math.ceil(batches / 3)


def _trainer(out: Path, n: int, cb: Any = None, **args: Any) -> tuple[Any, hf_train.TokenDataset]:
    """The Trainer over the first ``n`` samples of one token set (more data: the same samples
    and some new ones)."""
    data = hf_train.TokenDataset(n, 1)
    callbacks = [cb] if cb is not None else None
    return hf_train.build_trainer(str(out), train_dataset=data, callbacks=callbacks, **args), data


def _steps(trainer: Any) -> list[tuple]:
    return [
        (e["step"], e["loss"], e["grad_norm"], e["learning_rate"], e["epoch"])
        for e in trainer.state.log_history
        if "loss" in e
    ]


def _same_weights(a: Any, b: Any) -> bool:
    wa, wb = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(wa[k], wb[k]) for k in wa)


def test_data_added_at_an_epochs_end_trains_on_as_the_trainers_own_resume(tmp_path):
    """3 epochs over 50 samples, a checkpoint at the end of the first (step 5; ours and the
    Trainer's own checkpoint-5). Re-run over 60 samples (10 added; still 5 optimizer steps an
    epoch): epochs 2 and 3 go over the 60, with a warning, bit for bit as the Trainer's own
    resume_from_checkpoint of checkpoint-5 trains them (losses, gradient norms, learning rates,
    weights, the samples read)."""
    epochs = {"max_steps": -1, "num_train_epochs": 3}
    first, _ = _trainer(
        tmp_path / "first",
        50,
        ResilientCheckpoint(tmp_path / "ck", trainer_checkpoints=True),
        save_strategy="epoch",
        **epochs,
    )
    first.train()

    cb = ResilientCheckpoint(tmp_path / "ck", resume=5, save_on_train_end=False)
    ours, ours_data = _trainer(tmp_path / "ours", 60, cb, **epochs)
    with pytest.warns(
        UserWarning,
        match=r"60 samples here but 50 in the checkpoint of step 5, saved at an epoch's end "
        r"\(1 epoch\(s\) done\): the next epoch and the later ones go over the new data, 5 "
        r"optimizer steps an epoch \(5 before\); the run trains to step 15, the end of epoch 3 "
        r"\(num_train_epochs\) and max_steps",
    ):
        ours.train()
    assert cb.restored_step == 5

    theirs, theirs_data = _trainer(tmp_path / "theirs", 60, **epochs)
    theirs.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-5"))

    assert ours.state.global_step == theirs.state.global_step == 15
    assert _steps(ours) == _steps(theirs)
    assert [s for s, *_ in _steps(ours)][-10:] == list(range(6, 16))
    assert ours_data.reads == theirs_data.reads and len(ours_data.reads) == 2 * 60
    assert _same_weights(ours, theirs)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_max_steps_run_over_more_data_goes_on_with_the_next_epoch_to_max_steps(
    tmp_path, drop_last
):
    """2 epochs over 50 samples, then more data (98: 9 optimizer steps an epoch, the last over a
    short accumulation group) and max_steps = 3 more steps than the checkpoint's. The
    Trainer's own epoch count for the new data (ceil(max_steps / 9) = 2 epochs) is not the
    limit: the run trains epoch 3 (0-based 2) to max_steps. It reads the first batches of
    epoch 3 of the new data, those an uninterrupted run on the new data reads in its epoch 3,
    and it is deterministic."""
    args = {"dataloader_drop_last": drop_last}
    old, new = _updates(50, drop_last), _updates(98, drop_last)
    saved, max_steps = 2 * old, 2 * old + 3
    assert math.ceil(max_steps / new) == 2  # the Trainer's num_train_epochs here
    first, _ = _trainer(
        tmp_path / "first", 50, ResilientCheckpoint(tmp_path / "ck"), max_steps=saved, **args
    )
    first.train()

    runs = []
    for i in range(2):
        cb = ResilientCheckpoint(tmp_path / "ck", resume=saved, save_on_train_end=False)
        trainer, data = _trainer(tmp_path / f"run{i}", 98, cb, max_steps=max_steps, **args)
        with pytest.warns(UserWarning, match=rf"the run trains to step {max_steps} \(max_steps\)"):
            trainer.train()
        assert cb.restored_step == saved
        assert trainer.state.global_step == max_steps
        assert trainer.state.epoch == pytest.approx(2 + 3 * 3 / (98 // 4 if drop_last else 25))
        runs.append((trainer, data))
    (a, a_data), (b, b_data) = runs
    assert _steps(a) == _steps(b) and _same_weights(a, b) and a_data.reads == b_data.reads

    fresh, fresh_data = _trainer(tmp_path / "fresh", 98, max_steps=3 * new, **args)
    fresh.train()
    per_epoch = len(fresh_data.reads) // 3
    # 3 steps of 3 batches of 4 (and the batch accelerate's loader fetches ahead)
    assert len(a_data.reads) >= 3 * 3 * 4
    assert a_data.reads == fresh_data.reads[2 * per_epoch :][: len(a_data.reads)]


def test_an_epoch_run_over_more_data_ends_at_num_train_epochs_before_the_schedules_end(tmp_path):
    """num_train_epochs=3, the first over 50 samples; then 98 (9 optimizer steps an epoch): the
    Trainer plans max_steps = 3 x 9 = 27 and its learning-rate schedule over them; the resumed
    run trains epochs 2 and 3 over the new data, to step 5 + 18 = 23, and says so. (The
    Trainer's own resume would land 5 steps into epoch 1 of the new data: 5 // 9 = 0 epochs,
    5 steps done, and train to 27.)"""
    epochs = {"max_steps": -1, "num_train_epochs": 3}
    first, _ = _trainer(tmp_path / "first", 50, ResilientCheckpoint(tmp_path / "ck"), max_steps=5)
    first.train()
    cb = ResilientCheckpoint(tmp_path / "ck", save_on_train_end=False)
    ours, data = _trainer(tmp_path / "ours", 98, cb, **epochs)
    with pytest.warns(
        UserWarning,
        match=r"the run trains to step 23, the end of epoch 3 \(num_train_epochs\), before the "
        r"Trainer's max_steps=27, num_train_epochs x 9, where its learning-rate schedule ends",
    ):
        ours.train()
    assert (ours.state.global_step, ours.state.max_steps, ours.state.epoch) == (23, 27, 3.0)
    fresh, fresh_data = _trainer(tmp_path / "fresh", 98, **epochs)
    fresh.train()
    assert data.reads == fresh_data.reads[98:]  # epochs 2 and 3 of the new data

    # less data (14 samples: 2 optimizer steps an epoch), 2 epochs: the Trainer's max_steps is
    # 4, below the checkpoint's step 5: nothing is trained, and the warning says so
    cb = ResilientCheckpoint(tmp_path / "ck", resume=5, save_on_train_end=False)
    less, _ = _trainer(tmp_path / "less", 14, cb, **{**epochs, "num_train_epochs": 2})
    with pytest.warns(UserWarning, match=r"nothing is left to train: max_steps=4 here"):
        less.train()
    assert less.state.global_step == 5 and _steps(less) == _steps(first)


def test_another_length_inside_an_epoch_is_refused_naming_the_checkpoint_to_resume_from(tmp_path):
    """A checkpoint 2 optimizer steps into the second epoch (step 7) with 60 samples here: the
    position means nothing in the new data, refused (nothing trained); the message names the
    epoch's start, step 5, which then resumes over the new data."""
    ck = ResilientCheckpoint(tmp_path / "ck", every_n_steps=1)
    _trainer(tmp_path / "first", 50, ck, max_steps=7)[0].train()
    cb = ResilientCheckpoint(tmp_path / "ck", save_on_train_end=False)
    refused, _ = _trainer(tmp_path / "refused", 60, cb, max_steps=10)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"num_samples: 50 in the checkpoint, 60 here\. The training dataset has another "
        r"length, and step 7 is inside an epoch \(2 optimizer steps into it\).*"
        r"resume=5\), if the directory still holds it\), or train this epoch to its end "
        r"\(step 10\) with the checkpoint's data",
    ):
        refused.train()
    assert refused.state.global_step == 0  # refused before any step

    cb = ResilientCheckpoint(tmp_path / "ck", resume=5, save_on_train_end=False)
    resumed, _ = _trainer(tmp_path / "resumed", 60, cb, max_steps=10)
    with pytest.warns(UserWarning, match=r"60 samples here but 50 .* step 5, saved at an epoch"):
        resumed.train()
    assert resumed.state.global_step == 10


def test_another_batch_is_refused_at_an_epochs_end_too_and_drop_last_is_taken(tmp_path):
    """At an epoch's end (step 5) another per-device batch (another global batch) is refused as
    inside an epoch, as the plain loop and the Lightning adapter refuse another batch size, with
    the new data too; another dataloader_drop_last (12 batches an epoch instead of 13, the
    same global batch) resumes with a warning that says so, not one about another layout."""
    first, _ = _trainer(tmp_path / "first", 50, ResilientCheckpoint(tmp_path / "ck"), max_steps=5)
    first.train()
    for n in (50, 60):
        cb = ResilientCheckpoint(tmp_path / "ck", save_on_train_end=False)
        trainer, _ = _trainer(
            tmp_path / f"bs{n}", n, cb, max_steps=8, per_device_train_batch_size=2
        )
        with pytest.raises(
            CheckpointMismatchError,
            match=r"other data settings, at an epoch's end: .*per_device_batch_size: 4 in the "
            r"checkpoint, 2 here.*stays 12.*at an epoch's end too",
        ):
            trainer.train()

    cb = ResilientCheckpoint(tmp_path / "ck", save_on_train_end=False)
    trainer, _ = _trainer(tmp_path / "drop", 50, cb, max_steps=8, dataloader_drop_last=True)
    with pytest.warns(UserWarning) as seen:
        trainer.train()
    said = [str(w.message) for w in seen if "ResilientCheckpoint:" in str(w.message)]
    assert any("an epoch has 12 batches here but 13" in s for s in said), said
    assert not any("same global batch" in s for s in said), said
    assert trainer.state.global_step == 8 and trainer.state.epoch == pytest.approx(1.75)
