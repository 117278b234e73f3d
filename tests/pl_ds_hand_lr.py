"""Lightning's DeepSpeedStrategy (CPU, one rank, ZeRO STAGE) with ResilientCheckpoint saving
every 2 steps, and an lr warm-up set by hand in ``optimizer_step`` (as Lightning's docs show),
to MAX_STEPS; prints each hyper-parameter warning of the restore, then ``RESULT <step>``.

    python tests/pl_ds_hand_lr.py CKPT_DIR MAX_STEPS STAGE
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning.pytorch as pl
import torch

import lightning_train


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
    trainer, caught = lightning_train.fit_deepspeed_one_rank(HandWarmup, ckpt_dir, max_steps, stage)
    for w in caught:
        if "hyper-parameters" in str(w.message):
            print("WARNING " + str(w.message).splitlines()[0], flush=True)
    print(f"RESULT {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
