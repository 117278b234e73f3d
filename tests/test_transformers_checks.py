"""What the HF Trainer adapter says about the Trainer's own checkpoint settings."""

from __future__ import annotations

import logging
import warnings

import pytest

pytest.importorskip("transformers")

from transformers import TrainingArguments

from resilient_callbacks.transformers import checks


def _args(tmp_path, **kw):
    return TrainingArguments(
        output_dir=str(tmp_path),
        eval_strategy="steps",
        eval_steps=4,
        save_steps=4,
        metric_for_best_model="eval_loss",
        report_to="none",
        use_cpu=True,
        **kw,
    )


def test_save_strategy_best_with_load_best_is_not_warned_as_loading_nothing(tmp_path, caplog):
    # save_strategy="best" keeps writing the Trainer's checkpoint-N (a callback cannot switch it
    # off), so load_best_model_at_end does load the best model: found by a user's probe, the
    # warning said "no best model will be loaded at the end" while the Trainer loaded it.
    args = _args(tmp_path, save_strategy="best", load_best_model_at_end=True)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        checks.warn_about_trainer_saves(args, trainer_checkpoints=False)
    assert not [w for w in caught if "load_best_model_at_end" in str(w.message)]
    assert "no best model will be loaded" not in caplog.text
    assert "ResilientCheckpoint: save_strategy='best'" in caplog.text


def test_load_best_with_the_trainer_checkpoints_switched_off_is_warned(tmp_path):
    args = _args(tmp_path, save_strategy="steps", load_best_model_at_end=True)
    with pytest.warns(UserWarning, match="no best model will be loaded"):
        checks.warn_about_trainer_saves(args, trainer_checkpoints=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checks.warn_about_trainer_saves(args, trainer_checkpoints=True)
