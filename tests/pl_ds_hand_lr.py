"""Lightning's DeepSpeedStrategy (CPU, one rank, ZeRO STAGE) with ResilientCheckpoint saving
every 2 steps, and an lr warm-up set by hand in ``optimizer_step`` (as Lightning's docs show),
to MAX_STEPS; prints each hyper-parameter warning of the restore, then ``RESULT <step>``.

    python tests/pl_ds_hand_lr.py CKPT_DIR MAX_STEPS STAGE
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning.pytorch as pl
import torch

import lightning_train
from resilient_callbacks.lightning import ResilientCheckpoint
from spawn_ranks import world_of_one


class HandWarmup(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):  # type: ignore[no-untyped-def]
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * min(1.0, (self.trainer.global_step + 1) / 10)
        optimizer.step(closure=optimizer_closure)


def main(ckpt_dir: str, max_steps: int, stage: int) -> None:
    world_of_one()
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(256, 8)), batch_size=8
    )
    trainer = pl.Trainer(
        strategy=lightning_train.cpu_deepspeed_strategy(stage, ckpt_dir),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[ResilientCheckpoint(every_n_steps=2)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(HandWarmup(), data)
    for w in caught:
        if "hyper-parameters" in str(w.message):
            print("WARNING " + str(w.message).splitlines()[0], flush=True)
    print(f"RESULT {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
