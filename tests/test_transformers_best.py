"""The best checkpoint ``ResilientCheckpoint(keep_best=..., monitor=...)`` keeps is the one the
Trainer records as best (``state.best_global_step``, what ``load_best_model_at_end`` loads from
its own checkpoints): also when evaluations tie."""

from __future__ import annotations

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


def test_a_resume_forgets_a_best_checkpoint_directory_that_is_gone(tmp_path):
    """trainer_checkpoints=True and load_best_model_at_end: the checkpoint restored names the
    Trainer's best checkpoint-N, which is gone on the machine that resumes (a new node resuming
    from the remote copy, an output_dir cleaned). It was set on the Trainer's state as saved:
    the Trainer's end tried to load it ("Could not locate the best model ... activate
    --save_on_each_node") and ended with the last step's weights. As the Trainer's own resume
    does: forgotten, with a warning naming it, until an evaluation is better."""
    import shutil

    def run(out: Path, kill_at: int | None = None) -> tuple:
        cb = ResilientCheckpoint(out / "ck", every_n_steps=2, trainer_checkpoints=True)
        callbacks = [tt._SeesEpoch(kill_at=kill_at), cb]
        trainer = hf_train.build_trainer(
            str(out / "out"), 8, callbacks=callbacks, eval_steps=2, save_strategy="steps",
            save_steps=2, load_best_model_at_end=True,
        )  # fmt: skip
        trainer.train()
        return cb, trainer

    _, ref = run(tmp_path / "ref")
    best_step = ref.state.best_global_step
    with pytest.raises(tt._Killed):
        run(tmp_path / "got", kill_at=7)
    shutil.rmtree(tmp_path / "got" / "out")  # the Trainer's checkpoint-N directories
    with pytest.warns(UserWarning, match=r"best checkpoint .*checkpoint-\d+ .* does not exist"):
        cb, got = run(tmp_path / "got")
    assert cb.restored_step == 6
    assert got.state.best_metric == ref.state.best_metric
    if best_step <= 6:  # not trained again: nothing to load
        assert got.state.best_model_checkpoint is None
    else:
        assert got.state.best_model_checkpoint == str(
            tmp_path / "got" / "out" / f"checkpoint-{best_step}"
        )
