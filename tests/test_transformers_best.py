"""The best checkpoint ``ResilientCheckpoint(keep_best=..., monitor=...)`` keeps is the one the
Trainer records as best (``state.best_global_step``, what ``load_best_model_at_end`` loads from
its own checkpoints): also when evaluations tie."""

from __future__ import annotations

import re
import traceback
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import hf_train
import test_transformers as tt
from resilient_callbacks.transformers import ResilientCheckpoint

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]


def _accuracy_to_one_decimal(p) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Next-token accuracy as a small evaluation set reports it: coarse, so evaluations tie."""
    hits = p.predictions.argmax(-1)[:, :-1] == p.label_ids[:, 1:]
    return {"accuracy": round(float(hits.mean()), 1)}


def _the_step(trainer):  # type: ignore[no-untyped-def]
    """A metric that is the step evaluated: with greater_is_better, each evaluation is the
    best so far; without, the first stays the best."""
    return lambda p: {"step": float(trainer.state.global_step)}


def test_the_kept_best_is_the_trainers_best_when_evaluations_tie(tmp_path):
    """Evaluations at steps 2, 4 and 6 all report the same accuracy: the Trainer's best stays
    the first (a later one must be strictly better, as for Lightning's top-k); keep_best=1
    kept the newest of the ties instead and deleted step 2, the checkpoint of the Trainer's
    best."""
    ck = tmp_path / "ck"
    cb = ResilientCheckpoint(ck, every_n_steps=100, keep_last=1, keep_best=1,
                             monitor="eval_accuracy")  # fmt: skip
    trainer = hf_train.build_trainer(
        str(tmp_path / "out"), 6, callbacks=[cb], eval_steps=2, save_strategy="steps", save_steps=2,
        metric_for_best_model="accuracy",
    )  # fmt: skip
    trainer.compute_metrics = _accuracy_to_one_decimal
    trainer.train()
    evals = [e["eval_accuracy"] for e in trainer.state.log_history if "eval_accuracy" in e]
    assert len(evals) == 3 and len(set(evals)) == 1, evals  # the evaluations tie
    assert trainer.state.best_global_step == 2
    assert sorted(tt._committed_steps(ck)) == [2, 6]


@pytest.mark.parametrize("later_is_better", [False, True], ids=["best_before", "best_after"])
def test_a_resume_forgets_a_best_checkpoint_directory_that_is_gone(tmp_path, later_is_better):
    """trainer_checkpoints=True and load_best_model_at_end: the checkpoint restored names the
    Trainer's best checkpoint-N, which is gone on the machine that resumes (a new node resuming
    from the remote copy, an output_dir cleaned). It was set on the Trainer's state as saved:
    the Trainer's end tried to load it ("Could not locate the best model ... activate
    --save_on_each_node") and ended with the last step's weights. As the Trainer's own resume
    does: forgotten, with a warning naming it, until an evaluation is better. The metric is
    the step evaluated, so which case runs is chosen: the best at step 2, before the step
    restored (none is loaded at the end), or each evaluation better (step 8's is)."""
    import shutil

    def run(out: Path, kill_at: int | None = None) -> tuple:
        cb = ResilientCheckpoint(out / "ck", every_n_steps=2, trainer_checkpoints=True)
        callbacks = [tt._SeesEpoch(kill_at=kill_at), cb]
        trainer = hf_train.build_trainer(
            str(out / "out"), 8, callbacks=callbacks, eval_steps=2, save_strategy="steps",
            save_steps=2, load_best_model_at_end=True, metric_for_best_model="step",
            greater_is_better=later_is_better,
        )  # fmt: skip
        trainer.compute_metrics = _the_step(trainer)
        trainer.train()
        return cb, trainer

    _, ref = run(tmp_path / "ref")
    assert ref.state.best_global_step == (8 if later_is_better else 2)
    with pytest.raises(tt._Killed):
        run(tmp_path / "got", kill_at=7)
    shutil.rmtree(tmp_path / "got" / "out")  # the Trainer's checkpoint-N directories
    if not later_is_better:  # -W error: raised in the restore, once the ranks compared outcomes
        with warnings.catch_warnings(), pytest.raises(UserWarning, match="best checkpoint") as e:
            warnings.filterwarnings("error", message=".*best checkpoint")
            run(tmp_path / "got")
        frames = [f.name for f in traceback.extract_tb(e.tb)]  # (after it, it raised on the
        assert "_try_load" in frames, frames  # rank that lacks the folder alone: 2-rank test)
    with pytest.warns(UserWarning, match=r"best checkpoint .*checkpoint-\d+ .* does not exist"):
        cb, got = run(tmp_path / "got")
    assert cb.restored_step == 6
    assert got.state.best_metric == ref.state.best_metric
    if later_is_better:  # step 8 evaluated better: its checkpoint is the best
        assert got.state.best_model_checkpoint == str(tmp_path / "got" / "out" / "checkpoint-8")
    else:  # the best, at step 2, is not trained again: nothing to load
        assert got.state.best_model_checkpoint is None


def test_a_resume_says_at_info_a_best_the_trainers_rotation_removed_and_the_run_repeats(
    tmp_path, caplog
):
    """trainer_checkpoints=True, save_total_limit=1, load_best_model_at_end: the Trainer saves
    every 2 steps, ours every 4; killed in step 7, the run resumes from step 4, whose state
    names checkpoint-4 as best. The stopped run's evaluation at step 6 was better, and its
    rotation removed checkpoint-4: a warning said the best was lost, but the resumed run
    repeats that evaluation and ends as the uninterrupted one. Now said at INFO, naming why."""
    import logging
    import warnings

    def run(out: Path, kill_at: int | None = None) -> tuple:
        cb = ResilientCheckpoint(out / "ck", every_n_steps=4, trainer_checkpoints=True)
        callbacks = [tt._SeesEpoch(kill_at=kill_at), cb]
        trainer = hf_train.build_trainer(
            str(out / "out"), 8, callbacks=callbacks, eval_steps=2, save_strategy="steps",
            save_steps=2, save_total_limit=1, load_best_model_at_end=True,
            metric_for_best_model="step", greater_is_better=True,
        )  # fmt: skip
        trainer.compute_metrics = _the_step(trainer)  # each evaluation better than the last
        trainer.train()
        return cb, trainer

    _, ref = run(tmp_path / "ref")
    assert ref.state.best_global_step == 8
    with pytest.raises(tt._Killed):
        run(tmp_path / "got", kill_at=7)
    assert not (tmp_path / "got" / "out" / "checkpoint-4").exists()  # the rotation's doing
    caplog.set_level(logging.INFO, "resilient_callbacks")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cb, got = run(tmp_path / "got")
    assert cb.restored_step == 4
    assert [str(w.message) for w in seen if "best checkpoint" in str(w.message)] == []
    said = [r for r in caplog.records if "checkpoint-4" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], said
    assert "better evaluation of step 6" in said[0].getMessage()
    assert got.state.best_global_step == ref.state.best_global_step
    assert got.state.best_metric == ref.state.best_metric
    assert got.state.best_model_checkpoint == str(
        tmp_path / "got" / "out" / f"checkpoint-{ref.state.best_global_step}"
    )


def _trainer_state(step: int, best: int, out: Path, history: list) -> object:
    from transformers import TrainerState

    state = TrainerState(global_step=step, log_history=list(history))
    state.best_global_step, state.best_metric = best, float(best)
    state.best_model_checkpoint = str(out / f"checkpoint-{best}")
    return state


def _leave_checkpoint(out: Path, step: int, best: int, history: list) -> None:
    """A Trainer's ``checkpoint-{step}`` in ``out``, as its own save writes the state."""
    (out / f"checkpoint-{step}").mkdir(parents=True)
    _trainer_state(step, best, out, history).save_to_json(
        str(out / f"checkpoint-{step}" / "trainer_state.json")
    )


def test_a_gone_best_is_warned_when_only_another_runs_checkpoint_records_a_later_best(
    tmp_path, caplog
):
    """The INFO "the rotation removed it after a better evaluation" read the newest
    checkpoint-N above the step restored in output_dir, whoever wrote it: another run's
    checkpoint-20 left in the same output_dir (best at step 18) made a best this run had lost
    (checkpoint-2 gone with a cleaned directory) an INFO naming step 18, and
    load_best_model_at_end lost it without a warning. Only a checkpoint-N whose log_history
    begins with the one restored (the run's own) counts now; the run's own still does."""
    import logging

    from transformers import TrainingArguments

    from resilient_callbacks.transformers.trainer_state import (
        forget_a_best_checkpoint_that_is_gone,
    )

    out = tmp_path / "out"
    args = TrainingArguments(
        str(out), save_total_limit=1, load_best_model_at_end=True, eval_strategy="steps",
        save_strategy="steps", metric_for_best_model="step", report_to=[],
    )  # fmt: skip
    nan = float("nan")  # (a NaN loss logged: the same entry in both, though nan != nan)
    mine = [{"loss": nan, "step": 2}, {"eval_step": 2.0, "step": 2}, {"loss": 1.25, "step": 4}]
    other = [{"loss": 3.5, "step": 2}, {"eval_step": 18.0, "step": 18}]
    _leave_checkpoint(out, 20, 18, other)  # another run's, left in the same output_dir
    caplog.set_level(logging.INFO, "resilient_callbacks")
    state = _trainer_state(6, 2, out, mine)
    said = forget_a_best_checkpoint_that_is_gone(state, args)  # (the restore says it)
    assert re.search(r"best checkpoint .*checkpoint-2 .* does not exist", said or ""), said
    assert state.best_model_checkpoint is None
    assert not [r for r in caplog.records if r.levelno == logging.INFO and "step 18" in r.message]

    # the run's own checkpoint-8 (its history goes on from the one restored) records a best
    # after the step restored: said at INFO, naming it, not the other run's
    _leave_checkpoint(out, 8, 8, [*mine, {"eval_step": 8.0, "step": 8}])
    caplog.clear()
    state = _trainer_state(6, 2, out, mine)
    forget_a_best_checkpoint_that_is_gone(state, args)
    said = [r.getMessage() for r in caplog.records if "checkpoint-2" in r.getMessage()]
    assert len(said) == 1 and "better evaluation of step 8" in said[0], said
