"""Lightning's DeepSpeedStrategy (CPU, one rank, ZeRO STAGE) with ResilientCheckpoint saving
every 2 steps and a step-interval ``CosineAnnealingLR(T_max=T_MAX)`` from
``configure_optimizers``, to MAX_STEPS; prints each LR scheduler settings warning, then
``RESULT <step> <the scheduler's T_max>``.

    python tests/pl_ds_scheduler.py CKPT_DIR MAX_STEPS STAGE T_MAX
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
        trainer.fit(Cosine(t_max), data)
    for w in caught:
        if "LR scheduler settings" in str(w.message):
            print("WARNING " + str(w.message), flush=True)
    sched = trainer.lr_scheduler_configs[0].scheduler
    print(f"RESULT {trainer.global_step} {sched.T_max}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
