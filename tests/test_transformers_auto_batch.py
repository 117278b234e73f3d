"""``TrainingArguments(auto_find_batch_size=True)``: a run whose batch size the Trainer lowered
after an out-of-memory error resumes at the lowered size, exactly.

The out-of-memory error is upstream's own trick (transformers' ``MockCudaOOMCallback`` in
``test_auto_batch_size_with_resume_from_checkpoint``): a callback raises accelerate's
out-of-memory message while the batch size is 16, so accelerate runs the loop again at 14
(accelerate 1.9 and newer take 90% of it; older ones halve it, to 8).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from transformers import Trainer, TrainerCallback

from resilient_callbacks import history
from resilient_callbacks.errors import CheckpointMismatchError
from resilient_callbacks.transformers import ResilientCheckpoint
from upstream.transformers.trainer_test_utils import (
    RegressionDataset,
    RegressionModelConfig,
    RegressionRandomPreTrainedModel,
    RegressionTrainingArguments,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


class OutOfMemoryAt16(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.train_batch_size >= 16:
            raise RuntimeError("CUDA out of memory.")


class Crash(Exception):
    pass


class CrashInStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            raise Crash(f"crash in step {self.step}")


def make_trainer(out, *extra, add_ours="init", length=128, max_steps=8, **options):
    torch.manual_seed(0)
    model = RegressionRandomPreTrainedModel(RegressionModelConfig(a=0, b=2))
    args = RegressionTrainingArguments(
        str(out),
        max_steps=max_steps,
        save_steps=1,
        per_device_train_batch_size=16,
        auto_find_batch_size=True,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    ours = ResilientCheckpoint(log_save_metrics=False, **options)
    callbacks = [OutOfMemoryAt16(), *extra] + ([ours] if add_ours == "init" else [])
    data = RegressionDataset(length=length)
    trainer = Trainer(model, args, train_dataset=data, callbacks=callbacks)
    if add_ours == "add_callback":
        trainer.add_callback(ours)
    elif add_ours == "attach":
        trainer.add_callback(ours.attach(trainer))
    return trainer, ours


def weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def crash_after_step_3(out):
    trainer, _ = make_trainer(out, CrashInStep(4))
    with pytest.raises(Crash):
        trainer.train()
    assert trainer._train_batch_size < 16  # accelerate lowered it before the crash
    return trainer._train_batch_size


def test_a_resume_continues_at_the_batch_size_auto_find_batch_size_had_found(tmp_path):
    reference, _ = make_trainer(tmp_path / "reference")
    reference.train()
    lowered = reference._train_batch_size  # 14; 8 before accelerate 1.9 (it halved)
    assert lowered in (8, 14)

    assert crash_after_step_3(tmp_path / "run") == lowered
    # added with add_callback alone, the callback sees the run too late: an error says how
    late, _ = make_trainer(tmp_path / "run", add_ours="add_callback")
    with pytest.raises(
        CheckpointMismatchError, match=rf"batch size {lowered}.*Trainer\(callbacks=\[cb\]\)"
    ):
        late.train()

    resumed, ours = make_trainer(tmp_path / "run")  # starts at 16 again, as a restarted job does
    resumed.train()
    assert ours.restored_step == 3
    assert resumed._train_batch_size == lowered
    assert resumed.state.global_step == 8
    for a, b in zip(weights(resumed), weights(reference), strict=True):
        assert torch.equal(a, b)

    # attach() wraps the loop as Trainer(callbacks=[...]) does: the finished run, at the lowered
    # size, by path (read ahead too: before, the loop started again after a first restore)
    step_8 = tmp_path / "run" / "_resilient_checkpoints" / "step_000000008"
    attached, ours = make_trainer(tmp_path / "run", add_ours="attach", resume=str(step_8))
    attached.train()
    assert ours.restored_step == 8
    assert attached._train_batch_size == lowered
    # the restarts recorded: the retry at the lowered size after the out-of-memory attempt (it
    # failed before the first save: the same run again, from step 0), the late callback's
    # (refused after its restore), the automatic resume's one and the resume by path's one
    # (read ahead: restored once, not twice)
    records = history.records(str(tmp_path / "run" / "_resilient_checkpoints"))
    assert [r["step"] for r in records if r["event"] == "restart"] == [0, 3, 3, 8]
    assert len({r["run_id"] for r in records}) == 1


def test_data_added_at_an_epochs_end_resumes_at_the_size_the_run_had_found(tmp_path):
    """A run that lowered its batch size to 14 and ended an epoch (112 samples: 8 batches), re-run
    on more data (140: 10 batches an epoch): it starts at 16, restarts at 14 (not refused as
    another global batch), and the next epoch goes over the new data, with a warning."""
    first, _ = make_trainer(tmp_path, length=112)
    first.train()
    lowered = first._train_batch_size
    if lowered != 14:
        pytest.skip("accelerate before 1.9 halves the batch size (8): no epoch end at step 8")
    again, ours = make_trainer(tmp_path, length=140, max_steps=12)
    with pytest.warns(UserWarning, match=r"140 samples here but 112 .* step 8, saved at an epoch"):
        again.train()
    assert ours.restored_step == 8
    assert again._train_batch_size == 14
    assert again.state.global_step == 12
    assert again.state.epoch == pytest.approx(1.4)  # 4 of the new epoch's 10 batches
