"""The best checkpoint ``ResilientCheckpoint(keep_best=..., monitor=...)`` keeps is the one the
Trainer records as best (``state.best_global_step``, what ``load_best_model_at_end`` loads from
its own checkpoints): also when evaluations tie."""

from __future__ import annotations

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
