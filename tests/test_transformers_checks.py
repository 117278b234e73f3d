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


def test_keep_best_follows_the_trainers_direction_for_its_own_metric(tmp_path, one_thread):
    """``monitor`` is the Trainer's ``metric_for_best_model`` and ``greater_is_better=True``
    (the Trainer's default for a metric whose name does not end in "loss", e.g. accuracy):
    without ``mode`` the kept best checkpoint is the highest. Found 2026-12-06: ``mode``
    defaulted to "min" whatever the Trainer said, and keep_best kept the worst evaluation."""
    import hf_train
    from resilient_callbacks.transformers import ResilientCheckpoint

    ck = tmp_path / "ck"
    cb = ResilientCheckpoint(ck, every_n_steps=100, keep_last=1, keep_best=1, monitor="eval_loss")
    trainer = hf_train.build_trainer(str(tmp_path / "out"), 10, greater_is_better=True)
    trainer.add_callback(cb)
    trainer.train()
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best, worst = max(evals, key=evals.get), min(evals, key=evals.get)
    assert sorted(evals) == [4, 8, 10] and best not in (worst, 10)  # (the premise)
    kept = sorted(int(p.name.split("_")[1]) for p in ck.glob("step_*"))
    assert kept == sorted({best, 10})


def test_an_explicit_mode_against_the_trainers_direction_is_warned(tmp_path, caplog):
    args = _args(tmp_path, greater_is_better=True)
    options = {"monitor": "eval_loss", "mode": "min", "every_n_steps": 2}
    with caplog.at_level(logging.WARNING):
        resolved, _ = checks.resolved_options(options, args, None)
    assert resolved["mode"] == "min"
    assert "greater_is_better=True" in caplog.text and "mode='min'" in caplog.text


def test_a_deepspeed_sections_keep_best_mode_and_monitor_are_used(tmp_path):
    """Under DeepSpeed the callback's options may come from the config's section; options the
    callback was not given are taken from it. keep_best and mode had defaults (0, "min") in
    the callback's signature, so the section's were ignored, and its monitor did not make the
    callback save after evaluations."""
    from transformers import TrainerState

    from resilient_callbacks.transformers import ResilientCheckpoint, under_deepspeed

    cb, state = ResilientCheckpoint(), TrainerState(save_steps=4)
    section = {"dirpath": str(tmp_path), "keep_best": 2, "monitor": "eval_loss", "mode": "max"}
    _, own = under_deepspeed.with_section(cb.dirpath, cb.options, section)
    options, _ = checks.resolved_options(own, _args(tmp_path / "o"), state)
    assert (options["keep_best"], options["mode"], options["monitor"]) == (2, "max", "eval_loss")
    assert checks.save_on_evaluate(None, options) is True
    plain, _ = checks.resolved_options(dict(cb.options), _args(tmp_path / "p"), state)
    assert (plain["keep_best"], plain["mode"]) == (0, "min")
