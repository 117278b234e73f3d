"""Hugging Face's own Trainer resume tests, run with ``ResilientCheckpoint`` added.

``tests/upstream/transformers/`` holds an excerpt of transformers' ``TrainerResumeTrainingTest``
(``tests/trainer/test_trainer_checkpointing.py``) and the regression model, dataset and
Trainer factory it uses (``tests/trainer/trainer_test_utils.py``), as upstream wrote them
(ORIGIN.md lists every change). Each test trains a Trainer to the end with our callback added
(the Trainer's ``save_steps=5`` becomes its schedule), then, where upstream resumes a second
Trainer from ``checkpoint-N``, a Trainer with our callback crashes in step N + 1 and the same
Trainer is run again with a plain ``train()``: our callback resumes it from its checkpoint of
step N. Upstream's assertions then run unchanged: the weights equal the uninterrupted run's
(``assertEqual`` on the floats, so bit for bit) and so does the whole ``TrainerState`` (log
history included, timings aside).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


from upstream.transformers import trainer_resume as upstream

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]


class TestTrainerResumeWithResilientCheckpoint(upstream.TrainerResumeTrainingTest):
    """Upstream's tests; the default suite runs the fastest (gradient accumulation)."""

    @pytest.mark.slow
    def test_can_resume_training(self):
        super().test_can_resume_training()

    @pytest.mark.slow
    def test_resume_training_with_randomness(self):
        super().test_resume_training_with_randomness()

    def test_resume_training_with_gradient_accumulation(self):
        super().test_resume_training_with_gradient_accumulation()

    @pytest.mark.slow
    def test_resume_training_with_frozen_params(self):
        super().test_resume_training_with_frozen_params()
