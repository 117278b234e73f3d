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
# tests/tests_pytorch/models/test_restore.py (see ORIGIN.md in this folder): one test of it.
# Not a test module: tests/test_upstream_lightning.py calls it. Every change to upstream's code
# is marked "CHANGED"; the rest is upstream's text.
import torch

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from resilient_callbacks.lightning import ResilientCheckpoint  # CHANGED: the one object added


def test_correct_step_and_epoch(tmp_path):
    model = BoringModel()
    first_max_epochs = 2
    train_batches = 2
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=first_max_epochs, limit_train_batches=train_batches, limit_val_batches=0,
        callbacks=[ResilientCheckpoint(tmp_path / "ours", every_n_steps=3)],  # CHANGED: ours added
    )
    assert trainer.current_epoch == 0
    assert trainer.global_step == 0

    trainer.fit(model)
    assert trainer.current_epoch == first_max_epochs
    assert trainer.global_step == first_max_epochs * train_batches

    # save checkpoint after loop ends, training end called, epoch count increased
    ckpt_path = str(tmp_path / "model.ckpt")
    trainer.save_checkpoint(ckpt_path)

    ckpt = torch.load(ckpt_path, weights_only=True)
    assert ckpt["epoch"] == first_max_epochs
    assert ckpt["global_step"] == first_max_epochs * train_batches

    max_epochs = first_max_epochs + 2
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=max_epochs, limit_train_batches=train_batches, limit_val_batches=0,
        callbacks=[ResilientCheckpoint(tmp_path / "ours", every_n_steps=3)],  # CHANGED: ours added
    )
    # the ckpt state is not loaded at this point
    assert trainer.current_epoch == 0
    assert trainer.global_step == 0

    class TestModel(BoringModel):
        def on_train_start(self) -> None:
            assert self.trainer.current_epoch == first_max_epochs
            assert self.trainer.global_step == first_max_epochs * train_batches
            # CHANGED: `- 1`. Ours saves the loop state of the step's on_train_batch_end, as
            # Lightning's ModelCheckpoint(every_n_train_steps=...) does, and Lightning's restart
            # adds the step's 1 later (epoch_loop.reset, after on_train_start): a resume from
            # Lightning's own step checkpoint "epoch=1-step=4.ckpt" shows 3 here too; the end
            # count below is upstream's
            assert self.trainer.fit_loop.epoch_loop._batches_that_stepped == first_max_epochs * train_batches - 1

    # CHANGED: `fit(TestModel(), ckpt_path=ckpt_path)` was: ours resumes from the checkpoint it
    # saved at the end of the first fit (step 4; its schedule, every 3 steps, saved step 3 only)
    trainer.fit(TestModel())
    assert trainer.checkpoint_callback.restored_step == first_max_epochs * train_batches  # CHANGED (added)
    assert trainer.current_epoch == max_epochs
    assert trainer.global_step == max_epochs * train_batches
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == max_epochs * train_batches
