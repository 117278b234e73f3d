"""Lightning's DeepSpeedStrategy (CPU, one rank, ZeRO STAGE) with ResilientCheckpoint saving
every 2 steps and a step-interval ``CosineAnnealingLR(T_max=T_MAX)`` from
``configure_optimizers``, to MAX_STEPS; prints each LR scheduler settings warning, then
``RESULT <step> <the scheduler's T_max>``.

    python tests/pl_ds_scheduler.py CKPT_DIR MAX_STEPS STAGE T_MAX
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning.pytorch as pl
import torch

import lightning_train


class Cosine(pl.LightningModule):
    def __init__(self, t_max: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self.t_max = t_max

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.t_max)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(ckpt_dir: str, max_steps: int, stage: int, t_max: int) -> None:
    trainer, caught = lightning_train.fit_deepspeed_one_rank(
        lambda: Cosine(t_max), ckpt_dir, max_steps, stage
    )
    for w in caught:
        if "LR scheduler settings" in str(w.message):
            print("WARNING " + str(w.message), flush=True)
    sched = trainer.lr_scheduler_configs[0].scheduler
    print(f"RESULT {trainer.global_step} {sched.T_max}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
