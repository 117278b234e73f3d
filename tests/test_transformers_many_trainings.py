"""Trainings one after another in one process (a sweep, a notebook) with ResilientCheckpoint:
nothing is kept per training once its Trainer and model are gone."""

from __future__ import annotations

import gc
import os
import warnings

from transformers import Trainer

import hf_train
from resilient_callbacks.transformers import ResilientCheckpoint


def test_a_sweep_of_trainings_keeps_no_entry_per_training(tmp_path):
    """What the callback remembers of a finished training (so that the same model's next
    ``train()`` saves apart) stayed, one entry per dirpath, after its model was gone: one per
    trial of a sweep, for the life of the process."""
    from resilient_callbacks.transformers import phases

    for trial in range(2):
        args = hf_train.training_args(
            str(tmp_path / "out"),
            2,
            eval_strategy="no",
            metric_for_best_model=None,
            gradient_accumulation_steps=1,
        )
        trainer = Trainer(
            model=hf_train.build_model(), args=args, train_dataset=hf_train.TokenDataset(8, 0)
        )
        trainer.add_callback(ResilientCheckpoint(tmp_path / f"t{trial}", every_n_steps=1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        del trainer
        gc.collect()
    mine = [k for k in phases._FINISHED if k.startswith(os.path.realpath(tmp_path))]
    assert len(mine) <= 1, mine
