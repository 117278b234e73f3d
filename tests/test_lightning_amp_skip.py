"""Lightning with a ``GradScaler`` (``16-mixed``): a step whose update the scaler skipped for an
inf gradient is a completed step (``global_step`` moved, and the next step's ``zero_grad``
drops its gradients), not a micro-batch of an accumulation window: a save due there is made
there, and no accumulation-window notice meant for plain loops is said."""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from resilient_callbacks.lightning import ResilientCheckpoint
from test_exceptions_in_training import _committed

SKIPPED = 4  # the step whose loss is inf: the scaler skips its update


class _Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.lin(batch[0]).pow(2).mean()
        return loss * float("inf") if self.global_step + 1 == SKIPPED else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_step_the_grad_scaler_skipped_is_saved_when_due(tmp_path, caplog):
    """Step 4, its update skipped, looked like a micro-batch (no optimizer step, gradients in
    .grad, weights unchanged): its periodic save was made at step 5, and Lightning's log said
    step() was called inside gradient accumulation windows."""
    L.seed_everything(0, verbose=False)
    scaler = torch.amp.GradScaler("cpu")
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2, preemption=False, async_save=False)
    trainer = L.Trainer(
        max_steps=6,
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        callbacks=[rc],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(0)))
    with caplog.at_level(logging.INFO, logger="resilient_callbacks"):
        trainer.fit(_Model(), DataLoader(data, batch_size=2))
    assert scaler.get_scale() < 65536.0  # (the update of step 4 was skipped: the scale backed off)
    assert _committed(tmp_path / "ck") == [(2, "periodic"), (4, "periodic"), (6, "final")]
    assert "accumulation window" not in caplog.text
