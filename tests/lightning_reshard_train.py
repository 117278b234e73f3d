"""Lightning DDP on the CPU for tests/test_lightning_reshard.py: 120 samples, batch 6, a
shuffled plain DataLoader (made resumable by the callback), 3 epochs; records the sample ids
each epoch trained in this process. ``python lightning_reshard_train.py CKPT DEVICES MAX_STEPS
OUT [stateful]`` (MAX_STEPS -1: to the end; ``stateful``: torchdata's ``StatefulDataLoader``
instead, which the callback leaves as it is); writes ``OUT.rank<R>`` (JSON)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from resilient_callbacks.lightning import ResilientCheckpoint


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(batch[2].tolist())
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main(ckpt: str, devices: int, max_steps: int, out: str, stateful: bool = False) -> None:
    L.seed_everything(0)
    x = torch.randn(120, 8)
    data = TensorDataset(x, x.sum(1, keepdim=True), torch.arange(120))
    loader = DataLoader(data, batch_size=6, shuffle=True)
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(data, batch_size=6, shuffle=True)
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        max_epochs=3,
        max_steps=max_steps,
        callbacks=[ResilientCheckpoint(ckpt, every_n_steps=1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader)
    record = {
        "seen": model.seen,
        "global_step": trainer.global_step,
        "batches": trainer.num_training_batches,
    }
    with open(f"{out}.rank{trainer.global_rank}", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], "stateful" in sys.argv[5:])
