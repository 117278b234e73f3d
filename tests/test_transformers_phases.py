"""Two ``trainer.train()`` calls of one model in one process (a second stage, a notebook): the
second starts a new training at step 0 from the weights in memory, with the callback as without
it, and saves into ``<dirpath>/train-2``; the same calls made again after a crash in the second
training resume each training from its own directory, exactly. (It used to resume the finished
first training: nothing trained, its metrics returned again.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback

import hf_train
from resilient_callbacks import catalog
from resilient_callbacks.transformers import ResilientCheckpoint, phases

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]


class _Crash(TrainerCallback):
    """Raises at ``step`` of the training made while ``armed``."""

    def __init__(self, step: int) -> None:
        self.step, self.armed = step, False

    def on_step_end(self, args, state, control, **kwargs):
        if self.armed and state.global_step == self.step:
            raise RuntimeError("crash in the second training")


def _two_trainings(outdir, cb=None, crash=None):
    trainer = hf_train.build_trainer(str(outdir), 4, callbacks=[c for c in (cb, crash) if c])
    first = trainer.train()
    trainer.args.learning_rate = 0.01  # a second stage with other settings
    if crash is not None:
        crash.armed = True
    second = trainer.train()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return first.training_loss, second.training_loss, weights


def _steps(d) -> list[int]:
    return [e.step for e in catalog.committed(catalog.scan(str(d), catalog.Depth.NONE))]


def test_a_second_training_trains_as_without_the_callback_and_resumes_exactly(tmp_path):
    ref = _two_trainings(tmp_path / "ref")
    ck = tmp_path / "ck"
    got = _two_trainings(tmp_path / "cb", ResilientCheckpoint(ck, every_n_steps=2))
    assert got[:2] == ref[:2] and ref[0] != ref[1]
    assert all(torch.equal(got[2][k], v) for k, v in ref[2].items())
    assert _steps(ck) == [2, 4] and _steps(ck / "train-2") == [2, 4]

    # the same calls, with a crash at step 3 of the second training; then again, as a new
    # process would (nothing of this process's trainings remembered)
    ck = tmp_path / "ck2"
    with pytest.raises(RuntimeError, match="crash in the second training"):
        _two_trainings(tmp_path / "cb2", ResilientCheckpoint(ck, every_n_steps=2), _Crash(3))
    phases._FINISHED.clear()
    cb = ResilientCheckpoint(ck, every_n_steps=2)
    again = _two_trainings(tmp_path / "cb2", cb)
    assert cb.restored_step == 2  # the second training resumed from train-2's step 2
    assert again[1] == ref[1]
    assert all(torch.equal(again[2][k], v) for k, v in ref[2].items())


def test_two_resilient_checkpoints_on_one_trainer_are_refused_before_anything(tmp_path, one_thread):
    """Each would restore and save the same training; the first used to wrap the Trainer and
    open its directory before the second failed on a misleading message about _run_epoch."""
    from resilient_callbacks import ConfigError

    first = ResilientCheckpoint(tmp_path / "a", every_n_steps=2)
    second = ResilientCheckpoint(tmp_path / "b", every_n_steps=2)
    trainer = hf_train.build_trainer(str(tmp_path / "out"), 4, callbacks=[first, second])
    with pytest.raises(ConfigError, match="2 ResilientCheckpoint callbacks"):
        trainer.train()
    assert first.checkpointer is None and "_run_epoch" not in trainer.__dict__
    assert not (tmp_path / "a").exists()


def test_one_resilient_checkpoint_added_twice_is_refused_before_anything(tmp_path, one_thread):
    """``Trainer(callbacks=[cb])`` and then ``trainer.add_callback(cb)`` (the two ways the docs
    show, both used): the Trainer only warns, and every event reached the callback twice. Found
    2026-12-06: it counted each optimizer step twice, so the logged epochs differed from the
    run without it and checkpoints recorded other data positions (a resume trained other
    batches), with every_n_steps=1 steps 3, 4, 8 and 9 of 10 were not saved."""
    from resilient_callbacks import ConfigError

    cb = ResilientCheckpoint(tmp_path / "a", every_n_steps=1)
    trainer = hf_train.build_trainer(str(tmp_path / "out"), 4, callbacks=[cb])
    trainer.add_callback(cb)
    with pytest.raises(ConfigError, match="added 2 times"):
        trainer.train()
    assert cb.checkpointer is None and "_run_epoch" not in trainer.__dict__
    assert not (tmp_path / "a").exists()


def test_a_failed_last_save_still_lets_every_callback_end_its_run(
    tmp_path, one_thread, monkeypatch
):
    """The final figures are logged before the callbacks' on_train_end (see the MLflow test);
    when the last background save failed, that raises, after the other callbacks (a reporting
    integration ending its run) had their on_train_end."""
    from resilient_callbacks import CheckpointWriteError, persisting

    ended = []

    class Ends(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            ended.append(state.global_step)

    real, calls = persisting.layout.write_part, [0]

    def failing_later(*a, **k):
        calls[0] += 1
        if calls[0] >= 2:
            raise OSError(5, "disk gone")
        return real(*a, **k)

    monkeypatch.setattr(persisting.layout, "write_part", failing_later)
    cb = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    trainer = hf_train.build_trainer(str(tmp_path / "out"), 4, callbacks=[Ends(), cb])
    with pytest.raises(CheckpointWriteError):
        trainer.train()
    assert ended == [4]


def _model_init_sweep(outdir, cb=None):
    """A Trainer with ``model_init`` (a new model at every ``train()``), trained twice with
    another learning rate: a sweep by hand, as ``hyperparameter_search`` makes one."""
    args = hf_train.training_args(str(outdir), 4)
    trainer = hf_train.NoisyTrainer(
        model_init=hf_train.build_model,
        args=args,
        train_dataset=hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1),
        eval_dataset=hf_train.TokenDataset(8, seed=2),
        callbacks=[cb] if cb is not None else None,
    )
    first = trainer.train()
    trainer.args.learning_rate = 0.02
    second = trainer.train()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return first.training_loss, second.training_loss, weights


def test_a_model_init_trainer_trains_again_as_without_the_callback(tmp_path):
    """Its second train() builds a new model: it used to count as a new model and resume the
    first, finished training (nothing trained, the first training's loss and weights returned,
    the new learning rate never used)."""
    ref = _model_init_sweep(tmp_path / "ref")
    ck = tmp_path / "ck"
    got = _model_init_sweep(tmp_path / "cb", ResilientCheckpoint(ck, every_n_steps=2))
    assert ref[0] != ref[1]
    assert got[:2] == ref[:2]
    assert all(torch.equal(got[2][k], v) for k, v in ref[2].items())
    assert _steps(ck) == [2, 4] and _steps(ck / "train-2") == [2, 4]
