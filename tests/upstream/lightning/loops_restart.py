# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Vendored from Lightning-AI/pytorch-lightning, tag 2.6.5,
# tests/tests_pytorch/loops/test_loops.py (see ORIGIN.md in this folder). Not a test module:
# tests/test_upstream_lightning.py calls these functions. Every change to upstream's code is
# marked "CHANGED:"; the rest is upstream's text.
import copy
import os
import signal
import sys
from typing import Any
from unittest.mock import ANY

import torch
from torch.utils.data.dataloader import DataLoader

from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities.types import STEP_OUTPUT
from resilient_callbacks.lightning import ResilientCheckpoint  # CHANGED: the one object added

# CHANGED (added): how a run is stopped and started again instead of `fit(ckpt_path=...)`.
# The first run stops right before its step `STOP` (an exception raised in this process, or a
# real SIGKILL of a child process running `_interrupted_fit` below); the same `fit` is then run
# again with a new model object, and our callback resumes it from its newest checkpoint: step 2.
STOP = 3
SEED = 1234


class CustomException(Exception):
    pass


class _StopBefore(Callback):  # CHANGED (added)
    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        if self.how == "sigkill":
            ours = next(c for c in trainer.callbacks if isinstance(c, ResilientCheckpoint))
            ours.checkpointer.flush()  # the kill lands once step 2's checkpoint is committed
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        raise CustomException


def _ours(tmp_path, name: str) -> ResilientCheckpoint:  # CHANGED (added)
    return ResilientCheckpoint(os.path.join(tmp_path, name), every_n_steps=2, keep_last=100)


def compare_state_dicts(dict1, dict2):
    def compare_leaves(d1, d2):
        result = {}
        all_keys = set(d1.keys()).union(d2.keys())

        for key in all_keys:
            val1 = d1.get(key, None)
            val2 = d2.get(key, None)

            if isinstance(val1, dict) and isinstance(val2, dict):
                res = compare_leaves(val1, val2)
                if res:
                    result[key] = res
            elif isinstance(val1, dict) or isinstance(val2, dict):
                raise ValueError("dicts have different leaves")
            # CHANGED (added): lists, as in the train dataloader's state our callback adds to
            # `loops.fit_loop.state_dict.combined_loader` (it makes the loader resumable)
            elif isinstance(val1, list) and isinstance(val2, list) and len(val1) == len(val2):
                res = compare_leaves(dict(enumerate(val1)), dict(enumerate(val2)))
                if res:
                    result[key] = res
            elif isinstance(val1, torch.Tensor) and isinstance(val2, torch.Tensor):
                # CHANGED: `.double()`, as the loader's RNG state is a uint8 tensor
                diff = torch.norm(val1.double() - val2.double())
                if diff > 1e-8:
                    result[key] = f"{diff} > 1e-8"
            elif isinstance(val1, float) and isinstance(val2, float):
                if abs(val1 - val2) > 1e-8:
                    result[key] = f"{val1} != {val2}"
            elif val1 != val2:
                result[key] = f"{val1} != {val2}"
        return result

    return compare_leaves(dict1, dict2)


class RangeDataset(torch.utils.data.Dataset):
    def __init__(self, size: int, length: int):
        self.len = length
        data = torch.arange(0, size) / size
        self.data = data.unsqueeze(0).repeat(length, 1)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class PredictableBoringModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.last_loss = float("inf")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RangeDataset(32, 64))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RangeDataset(32, 64))

    def test_dataloader(self) -> DataLoader:
        return DataLoader(RangeDataset(32, 64))

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(RangeDataset(32, 64))

    def training_step(self, batch: Any, batch_idx: int) -> STEP_OUTPUT:
        loss = self.step(batch)
        self.last_loss = loss
        return {"loss": loss}


# CHANGED (added): the Trainer arguments of test_restart_parity / test_restart_with_val_parity
def _restart_kwargs(tmp_path, with_val: bool) -> dict:
    kwargs = dict(
        default_root_dir=tmp_path,
        limit_train_batches=4,
        max_epochs=4,
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    if with_val:
        kwargs.update(limit_val_batches=4, val_check_interval=2)
    return kwargs


def _interrupted_fit(tmp_path, with_val: bool, how: str) -> None:  # CHANGED (added)
    """The run that is stopped before step STOP; in a child process for how="sigkill"."""
    seed_everything(SEED)  # the uninterrupted run's initial weights
    model = PredictableBoringModel()
    checkpoint_callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(
        **_restart_kwargs(tmp_path, with_val),
        callbacks=[checkpoint_callback, _ours(tmp_path, "resumed"), _StopBefore(STOP, how)],
    )
    trainer.fit(model)


def _restart(tmp_path, with_val: bool, how: str):  # CHANGED (added)
    """Stop a run before step STOP (``how``), then run the same ``fit`` again: it resumes."""
    import subprocess

    import pytest

    if how == "sigkill":
        proc = subprocess.run(
            [sys.executable, __file__, str(tmp_path), str(int(with_val))],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    else:
        with pytest.raises(CustomException):
            _interrupted_fit(tmp_path, with_val, how)
    seed_everything(SEED + 1)  # a new model object with other weights: they are restored
    model = PredictableBoringModel()
    ours = _ours(tmp_path, "resumed")
    checkpoint_callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(**_restart_kwargs(tmp_path, with_val), callbacks=[checkpoint_callback, ours])
    trainer.fit(model)
    assert ours.restored_step == 2
    return model


def test_restart_parity(tmp_path, how="exception"):
    seed_everything(SEED)  # CHANGED: the interrupted run starts from the same weights
    model = PredictableBoringModel()
    checkpoint_callback = ModelCheckpoint(
        dirpath=tmp_path,
        every_n_train_steps=2,
        save_top_k=-1,
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=4,
        max_epochs=4,
        callbacks=[checkpoint_callback, _ours(tmp_path, "uninterrupted")],  # CHANGED: ours added
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model)
    loss = model.last_loss

    # CHANGED: instead of a second Trainer with `fit(model, ckpt_path=".../epoch=0-step=2.ckpt")`:
    # a run stopped before step 3 and the same fit again, resumed by our callback from step 2
    model = _restart(tmp_path, with_val=False, how=how)
    loss_v1 = model.last_loss

    assert abs(loss - loss_v1) < 1e-8

    end_of_epoch_ckpt = torch.load(str(tmp_path / "epoch=0-step=4.ckpt"), weights_only=True)
    end_of_epoch_ckpt_v1 = torch.load(str(tmp_path / "epoch=0-step=4-v1.ckpt"), weights_only=True)

    assert compare_state_dicts(end_of_epoch_ckpt["loops"], end_of_epoch_ckpt_v1["loops"]) == {}
    assert compare_state_dicts(end_of_epoch_ckpt["lr_schedulers"][0], end_of_epoch_ckpt_v1["lr_schedulers"][0]) == {}
    assert end_of_epoch_ckpt["epoch"] == end_of_epoch_ckpt_v1["epoch"]
    assert end_of_epoch_ckpt["global_step"] == end_of_epoch_ckpt_v1["global_step"]
    assert compare_state_dicts(end_of_epoch_ckpt["state_dict"], end_of_epoch_ckpt_v1["state_dict"]) == {}

    mid_epoch_ckpt = torch.load(str(tmp_path / "epoch=1-step=6.ckpt"), weights_only=True)
    mid_epoch_ckpt_v1 = torch.load(str(tmp_path / "epoch=1-step=6-v1.ckpt"), weights_only=True)

    assert compare_state_dicts(mid_epoch_ckpt["loops"], mid_epoch_ckpt_v1["loops"]) == {}
    assert compare_state_dicts(mid_epoch_ckpt["lr_schedulers"][0], mid_epoch_ckpt_v1["lr_schedulers"][0]) == {}
    assert mid_epoch_ckpt["epoch"] == mid_epoch_ckpt_v1["epoch"]
    assert mid_epoch_ckpt["global_step"] == mid_epoch_ckpt_v1["global_step"]
    assert compare_state_dicts(mid_epoch_ckpt["state_dict"], mid_epoch_ckpt_v1["state_dict"]) == {}

    end_of_epoch_ckpt = torch.load(str(tmp_path / "epoch=1-step=8.ckpt"), weights_only=True)
    end_of_epoch_ckpt_v1 = torch.load(str(tmp_path / "epoch=1-step=8-v1.ckpt"), weights_only=True)

    assert compare_state_dicts(end_of_epoch_ckpt["loops"], end_of_epoch_ckpt_v1["loops"]) == {}
    assert compare_state_dicts(end_of_epoch_ckpt["lr_schedulers"][0], end_of_epoch_ckpt_v1["lr_schedulers"][0]) == {}
    assert end_of_epoch_ckpt["epoch"] == end_of_epoch_ckpt_v1["epoch"]
    assert end_of_epoch_ckpt["global_step"] == end_of_epoch_ckpt_v1["global_step"]
    assert compare_state_dicts(end_of_epoch_ckpt["state_dict"], end_of_epoch_ckpt_v1["state_dict"]) == {}


def test_restart_with_val_parity(tmp_path, how="exception"):
    seed_everything(SEED)  # CHANGED: the interrupted run starts from the same weights
    model = PredictableBoringModel()
    checkpoint_callback = ModelCheckpoint(
        dirpath=tmp_path,
        every_n_train_steps=2,
        save_top_k=-1,
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=4,
        max_epochs=4,
        callbacks=[checkpoint_callback, _ours(tmp_path, "uninterrupted")],  # CHANGED: ours added
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=4,
        val_check_interval=2,
    )
    trainer.fit(model)
    loss = model.last_loss

    # CHANGED: instead of a second Trainer with `fit(model, ckpt_path=".../epoch=0-step=2.ckpt")`:
    # a run stopped before step 3 and the same fit again, resumed by our callback from step 2
    model = _restart(tmp_path, with_val=True, how=how)
    loss_v1 = model.last_loss

    assert abs(loss - loss_v1) < 1e-8

    end_of_epoch_ckpt = torch.load(str(tmp_path / "epoch=0-step=4.ckpt"), weights_only=True)
    end_of_epoch_ckpt_v1 = torch.load(str(tmp_path / "epoch=0-step=4-v1.ckpt"), weights_only=True)

    assert compare_state_dicts(end_of_epoch_ckpt["loops"], end_of_epoch_ckpt_v1["loops"]) == {}
    assert compare_state_dicts(end_of_epoch_ckpt["lr_schedulers"][0], end_of_epoch_ckpt_v1["lr_schedulers"][0]) == {}
    assert end_of_epoch_ckpt["epoch"] == end_of_epoch_ckpt_v1["epoch"]
    assert end_of_epoch_ckpt["global_step"] == end_of_epoch_ckpt_v1["global_step"]
    assert compare_state_dicts(end_of_epoch_ckpt["state_dict"], end_of_epoch_ckpt_v1["state_dict"]) == {}

    mid_epoch_ckpt = torch.load(str(tmp_path / "epoch=1-step=6.ckpt"), weights_only=True)
    mid_epoch_ckpt_v1 = torch.load(str(tmp_path / "epoch=1-step=6-v1.ckpt"), weights_only=True)

    assert compare_state_dicts(mid_epoch_ckpt["loops"], mid_epoch_ckpt_v1["loops"]) == {}
    assert compare_state_dicts(mid_epoch_ckpt["lr_schedulers"][0], mid_epoch_ckpt_v1["lr_schedulers"][0]) == {}
    assert mid_epoch_ckpt["epoch"] == mid_epoch_ckpt_v1["epoch"]
    assert mid_epoch_ckpt["global_step"] == mid_epoch_ckpt_v1["global_step"]
    assert compare_state_dicts(mid_epoch_ckpt["state_dict"], mid_epoch_ckpt_v1["state_dict"]) == {}

    end_of_epoch_ckpt = torch.load(str(tmp_path / "epoch=1-step=8.ckpt"), weights_only=True)
    end_of_epoch_ckpt_v1 = torch.load(str(tmp_path / "epoch=1-step=8-v1.ckpt"), weights_only=True)

    assert compare_state_dicts(end_of_epoch_ckpt["loops"], end_of_epoch_ckpt_v1["loops"]) == {}
    assert compare_state_dicts(end_of_epoch_ckpt["lr_schedulers"][0], end_of_epoch_ckpt_v1["lr_schedulers"][0]) == {}
    assert end_of_epoch_ckpt["epoch"] == end_of_epoch_ckpt_v1["epoch"]
    assert end_of_epoch_ckpt["global_step"] == end_of_epoch_ckpt_v1["global_step"]
    assert compare_state_dicts(end_of_epoch_ckpt["state_dict"], end_of_epoch_ckpt_v1["state_dict"]) == {}



class _Captured(Exception):  # CHANGED (added)
    pass


class _Capture(Callback):  # CHANGED (added): the dictionary our callback hands Lightning
    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.checkpoint = copy.deepcopy(checkpoint)
        raise _Captured


def _our_checkpoint(dirpath, step: int) -> dict:  # CHANGED (added)
    """What our callback gives Lightning's restore when it resumes from our step ``step``."""
    import pytest

    capture = _Capture()
    trainer = Trainer(
        default_root_dir=dirpath,
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[ResilientCheckpoint(dirpath, resume=step), capture],
    )
    with pytest.raises(_Captured):
        trainer.fit(BoringModel())
    return capture.checkpoint


def test_loop_state_on_exception(accumulate_grad_batches, stop_epoch, stop_batch, tmp_path):
    # CHANGED: upstream's test checks the file OnExceptionCheckpoint writes *at* the exception;
    # ours (save_on_exception=True) saves the last completed step instead, by design. Kept:
    # upstream's model, Trainer, stop points and its count of the optimizer steps done before
    # the exception (the step ours must resume from); added: the same fit run again, resumed by
    # ours, ends with the uninterrupted run's weights and loop state (its last.ckpt)
    import pytest

    n_epochs = 3
    n_batches = 3

    class TestModel(BoringModel):
        stop = True  # CHANGED (added): False for the uninterrupted run and the resumed one

        def training_step(self, batch, batch_idx):
            if self.stop and self.trainer.current_epoch == stop_epoch and batch_idx == stop_batch:
                raise CustomException
            return super().training_step(batch, batch_idx)

    def fit(dirpath, stop):  # CHANGED (added): upstream's Trainer, ours and a ModelCheckpoint
        seed_everything(SEED)  # the one model object of upstream's test: here one per run
        model = TestModel()
        model.stop = stop
        ours = ResilientCheckpoint(dirpath / "ours", every_n_steps=100, save_on_exception=True)
        trainer = Trainer(
            default_root_dir=dirpath,
            max_epochs=n_epochs,
            limit_train_batches=n_batches,
            limit_val_batches=0,
            accumulate_grad_batches=accumulate_grad_batches,
            enable_progress_bar=False,
            logger=False,
            callbacks=[ModelCheckpoint(dirpath=dirpath / "mc", save_last=True), ours],  # CHANGED
        )
        trainer.fit(model)
        return ours

    # simulate a failure
    with pytest.raises(CustomException):
        fit(tmp_path / "resumed", stop=True)

    # `nbe_`: non-breaking epoch, as in, no exception will be raised. `be_`: breaking epoch
    nbe_batches_completed = stop_epoch * n_batches
    be_batches_completed = stop_batch
    # lightning applies leftover accumulated gradients when the epoch ends
    has_leftover_accumulation_batches = n_batches % accumulate_grad_batches != 0
    # number of batches that will call `optimizer.step()` during non-breaking and breaking epochs
    nbe_stepping_batches = nbe_batches_completed // accumulate_grad_batches
    be_stepping_batches = be_batches_completed // accumulate_grad_batches

    nbe_total_opt_steps = nbe_stepping_batches + has_leftover_accumulation_batches
    be_total_opt_steps = be_stepping_batches

    # CHANGED (added): the resumed run and an uninterrupted one
    ours = fit(tmp_path / "resumed", stop=False)
    assert ours.restored_step == nbe_total_opt_steps + be_total_opt_steps
    fit(tmp_path / "uninterrupted", stop=False)
    last = torch.load(str(tmp_path / "uninterrupted" / "mc" / "last.ckpt"), weights_only=True)
    last_v1 = torch.load(str(tmp_path / "resumed" / "mc" / "last.ckpt"), weights_only=True)
    assert compare_state_dicts(last["loops"], last_v1["loops"]) == {}
    assert compare_state_dicts(last["state_dict"], last_v1["state_dict"]) == {}
    assert last["global_step"] == last_v1["global_step"]


def test_loop_state_on_complete_run(tmp_path, stop_epoch=1, stop_batch=1):
    n_epochs = 3
    n_batches = 3
    accumulate_grad_batches = 1

    # CHANGED (added): the run is stopped by test_loop_state_on_exception's TestModel (an exception
    # in epoch `stop_epoch`, batch `stop_batch`) and run again, resumed by our callback
    class ExceptionTestModel(BoringModel):
        def training_step(self, batch, batch_idx):
            if self.trainer.current_epoch == stop_epoch and batch_idx == stop_batch:
                raise CustomException
            return super().training_step(batch, batch_idx)

        def train_dataloader(self):
            return DataLoader(RandomDataset(32, n_batches))

    class TestModel(BoringModel):
        def train_dataloader(self):
            # override to test the `is_last_batch` value
            return DataLoader(RandomDataset(32, n_batches))

    # CHANGED (added): ours replaces Lightning's default ModelCheckpoint (it is a `Checkpoint`),
    # so the ModelCheckpoint whose file is read below is given explicitly
    def callbacks():
        ours = ResilientCheckpoint(os.path.join(tmp_path, "ours"), every_n_steps=2)
        return [ModelCheckpoint(), ours]

    import pytest

    with pytest.raises(CustomException):
        Trainer(
            default_root_dir=tmp_path,
            max_epochs=n_epochs,
            limit_val_batches=0,
            accumulate_grad_batches=accumulate_grad_batches,
            enable_progress_bar=False,
            logger=False,
            callbacks=callbacks(),
        ).fit(ExceptionTestModel())

    model = TestModel()

    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=n_epochs,
        limit_val_batches=0,
        accumulate_grad_batches=accumulate_grad_batches,
        enable_progress_bar=False,
        logger=False,
        callbacks=callbacks(),  # CHANGED: ours added
    )
    trainer.fit(model)
    # CHANGED (added): it resumed from our newest checkpoint (one every 2 steps)
    ours = next(c for c in trainer.callbacks if isinstance(c, ResilientCheckpoint))  # CHANGED (added)
    assert ours.restored_step == (stop_epoch * n_batches + stop_batch) // 2 * 2

    assert trainer.num_training_batches == n_batches

    ckpt_path = trainer.checkpoint_callback.best_model_path
    assert os.path.exists(ckpt_path)
    checkpoint = torch.load(ckpt_path, weights_only=True)

    n_sch_steps_total = n_epochs
    n_sch_steps_current = 1

    expected = {
        "state_dict": ANY,
        "epoch_progress": {
            "total": {
                "ready": n_epochs,
                "started": n_epochs,
                "processed": n_epochs,
                "completed": n_epochs - 1,
            },
            "current": {
                "ready": n_epochs,
                "started": n_epochs,
                "processed": n_epochs,
                "completed": n_epochs - 1,
            },
        },
        "epoch_loop.state_dict": ANY,
        "epoch_loop.batch_progress": {
            "total": {
                "ready": n_epochs * n_batches,
                "started": n_epochs * n_batches,
                "processed": n_epochs * n_batches,
                "completed": n_epochs * n_batches,
            },
            "current": {
                "ready": n_batches,
                "started": n_batches,
                "processed": n_batches,
                "completed": n_batches,
            },
            "is_last_batch": True,
        },
        "epoch_loop.scheduler_progress": {
            "total": {"ready": n_sch_steps_total, "completed": n_sch_steps_total},
            "current": {"ready": n_sch_steps_current, "completed": n_sch_steps_current},
        },
        "epoch_loop.manual_optimization.state_dict": ANY,
        "epoch_loop.manual_optimization.optim_step_progress": {
            "total": {"ready": 0, "completed": 0},
            "current": {"ready": 0, "completed": 0},
        },
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {
            "optimizer": {
                "step": {
                    "total": {
                        "ready": n_epochs * n_batches,
                        "completed": n_epochs * n_batches,
                    },
                    "current": {
                        "ready": n_batches,
                        "completed": n_batches,
                    },
                },
                "zero_grad": {
                    "total": {
                        "ready": n_epochs * n_batches,
                        "started": n_epochs * n_batches,
                        "completed": n_epochs * n_batches,
                    },
                    "current": {
                        "ready": n_batches,
                        "started": n_batches,
                        "completed": n_batches,
                    },
                },
            },
        },
        "epoch_loop.val_loop.state_dict": ANY,
        "epoch_loop.val_loop.batch_progress": ANY,
    }
    assert checkpoint["loops"]["fit_loop"] == expected


def test_fit_loop_reset(tmp_path, source="ours"):
    """Test that the reset logic in fit- and epoch loop is aware of whether the loop is restarting from a completed
    loop or from a mid-epoch checkpoint."""

    # CHANGED (added): the checkpoints read are Lightning's (source="lightning", upstream's test
    # as it is) or ours of the same steps, as our callback hands them to Lightning's restore
    def load(name, step):
        if source == "lightning":
            return torch.load(str(tmp_path / name), weights_only=True)
        return _our_checkpoint(tmp_path / "ours", step)

    # generate checkpoints at end of epoch and mid-epoch
    model = BoringModel()
    checkpoint_callback = ModelCheckpoint(
        dirpath=tmp_path,
        every_n_train_steps=2,
        save_top_k=-1,
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=4,
        max_epochs=2,
        # CHANGED: ours added
        callbacks=[checkpoint_callback, ResilientCheckpoint(tmp_path / "ours", every_n_steps=2, keep_last=10)],
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(model)

    # reset state loaded from a checkpoint from mid-epoch
    mid_epoch_ckpt = load("epoch=0-step=2.ckpt", 2)  # CHANGED: load(...), was torch.load(...)
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    optimizer_loop = epoch_loop.automatic_optimization
    assert not fit_loop.restarting
    assert not epoch_loop.restarting
    assert not optimizer_loop.restarting

    # we load exactly what was saved - no reset yet
    fit_loop.load_state_dict(mid_epoch_ckpt["loops"]["fit_loop"])

    assert fit_loop.restarting
    assert fit_loop.epoch_progress.total.ready == 1
    assert fit_loop.epoch_progress.total.completed == 0  # the checkpoint was saved mid epoch
    assert fit_loop.epoch_progress.current.ready == 1
    assert fit_loop.epoch_progress.current.completed == 0

    assert epoch_loop.batch_progress.total.ready == 2
    assert epoch_loop.batch_progress.total.processed == 2
    assert epoch_loop.batch_progress.total.completed == 1  # the checkpoint was saved on train_batch_end
    assert epoch_loop.batch_progress.current.ready == 2  # currents get set to the completed value
    assert epoch_loop.batch_progress.current.processed == 2
    assert epoch_loop.batch_progress.current.completed == 1

    fit_loop.reset()
    epoch_loop.reset()

    # resetting from a mid-of-epoch checkpoint SHOULD NOT reset the current counters to 0
    assert fit_loop.restarting
    assert fit_loop.epoch_progress.total.ready == 1
    assert fit_loop.epoch_progress.total.completed == 0  # the checkpoint was saved mid epoch
    assert fit_loop.epoch_progress.current.ready == 1
    assert fit_loop.epoch_progress.current.completed == 0

    # however it should increment completed batch progress, since it was saved immediately prior
    assert epoch_loop.restarting
    assert epoch_loop.batch_progress.total.ready == 2
    assert epoch_loop.batch_progress.total.processed == 2
    assert epoch_loop.batch_progress.total.completed == 2
    assert epoch_loop.batch_progress.current.ready == 2
    assert epoch_loop.batch_progress.current.processed == 2
    assert epoch_loop.batch_progress.current.completed == 2

    assert optimizer_loop.restarting

    # reset state loaded from a checkpoint from the end of an epoch
    end_of_epoch_ckpt = load("epoch=0-step=4.ckpt", 4)  # CHANGED: load(...), was torch.load(...)
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    fit_loop.restarting = False
    epoch_loop.restarting = False
    optimizer_loop.restarting = False

    # we load exactly what was saved - no reset yet
    fit_loop.load_state_dict(end_of_epoch_ckpt["loops"]["fit_loop"])

    assert fit_loop.restarting
    assert fit_loop.epoch_progress.total.ready == 1
    assert fit_loop.epoch_progress.total.completed == 0
    assert fit_loop.epoch_progress.current.ready == 1
    assert fit_loop.epoch_progress.current.completed == 0

    # resetting from a end-of-epoch checkpoint SHOULD reset the current counters to 0
    fit_loop.reset()
    epoch_loop.reset()

    # resetting from a mid-of-epoch checkpoint SHOULD NOT reset the current counters to 0
    # since we are restarting at the end of epoch, we need to see `completed` being updated after reset
    assert fit_loop.restarting
    assert fit_loop.epoch_progress.total.ready == 1
    assert fit_loop.epoch_progress.total.completed == 1
    assert fit_loop.epoch_progress.current.ready == 1
    assert fit_loop.epoch_progress.current.completed == 1

    # however it should increment completed batch progress, since it was saved immediately prior
    assert epoch_loop.restarting
    assert epoch_loop.batch_progress.total.ready == 4
    assert epoch_loop.batch_progress.total.processed == 4
    assert epoch_loop.batch_progress.total.completed == 4
    assert epoch_loop.batch_progress.current.ready == 0
    assert epoch_loop.batch_progress.current.processed == 0
    assert epoch_loop.batch_progress.current.completed == 0


def test_restart_from_last_parity(tmp_path, with_val=False):
    # CHANGED: test_restart_from_last_with_val_parity is this with `with_val=True` (its Trainers
    # have `limit_val_batches=2, val_check_interval=2` in addition; nothing else differs)
    val = dict(limit_val_batches=2, val_check_interval=2) if with_val else {}
    model = PredictableBoringModel()
    checkpoint_callback = ModelCheckpoint(
        dirpath=tmp_path,
        save_last=True,
        save_top_k=-1,
    )

    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=2,
        max_epochs=4,
        callbacks=[checkpoint_callback, _ours(tmp_path, "first")],  # CHANGED: ours added
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        **val,
    )
    # CHANGED (added): both fits draw the same random numbers, as the state our callback saves
    # for the train dataloader holds the global RNG at each epoch's start (`epoch_rng`)
    seed_everything(SEED)
    trainer.fit(model)

    last_ckpt_1 = torch.load(str(tmp_path / "last.ckpt"), weights_only=True)

    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=2,
        max_epochs=2,
        callbacks=[checkpoint_callback, _ours(tmp_path, "second")],  # CHANGED: ours added
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        **val,
    )
    # CHANGED (added): both fits draw the same random numbers, as the state our callback saves
    # for the train dataloader holds the global RNG at each epoch's start (`epoch_rng`)
    seed_everything(SEED)
    trainer.fit(model)

    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=2,
        max_epochs=4,
        callbacks=[checkpoint_callback, _ours(tmp_path, "second")],  # CHANGED: ours added
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        **val,
    )
    # CHANGED: `fit(model, ckpt_path=str(tmp_path / "last.ckpt"))` was: our callback resumes from
    # its checkpoint of the second fit's last step; a new model object, as a new Trainer fitting
    # the module a finished fit of ours trained is refused (docs/lightning.md, several fit() calls)
    trainer.fit(PredictableBoringModel())
    ours = next(c for c in trainer.callbacks if isinstance(c, ResilientCheckpoint))  # CHANGED (added)
    assert ours.restored_step == 4  # CHANGED (added)

    last_ckpt_2 = torch.load(str(tmp_path / "last.ckpt"), weights_only=True)

    assert compare_state_dicts(last_ckpt_1["loops"], last_ckpt_2["loops"]) == {}

if __name__ == "__main__":  # CHANGED (added): the child process of how="sigkill"
    torch.set_num_threads(1)
    _interrupted_fit(sys.argv[1], bool(int(sys.argv[2])), "sigkill")
