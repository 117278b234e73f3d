"""Worker of test_scheduler_settings_ranks: one rank of 2 (gloo).

``python sched_settings_worker.py DIRPATH T_MAX``: a model, SGD and a CosineAnnealingLR with
``T_MAX``; restores from DIRPATH (warnings printed as Python prints them, no logging set up),
then trains 3 steps, saving the third (``every_n_steps=3``). Prints ``restored <step> T_max=<t>``.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as tdist

from resilient_callbacks import Checkpointer


def lightning(dirpath: str, t_max: int) -> None:
    import lightning.pytorch as L

    from resilient_callbacks.lightning import ResilientCheckpoint

    class Cosine(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 4))
    cb = ResilientCheckpoint(dirpath, every_n_steps=3, async_save=False)
    trainer = L.Trainer(
        max_steps=6 if os.path.exists(dirpath) else 3,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(dirpath),
    )
    trainer.fit(Cosine(), torch.utils.data.DataLoader(ds, batch_size=4))
    sched = trainer.lr_scheduler_configs[0].scheduler
    print(f"restored {cb.restored_step or 0} T_max={sched.T_max}", flush=True)


def main() -> None:
    dirpath, t_max = sys.argv[1], int(sys.argv[2])
    if "--lightning" in sys.argv:
        lightning(dirpath, t_max)
        return
    tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
    state = {"model": model, "opt": opt, "sched": sched}
    with Checkpointer(dirpath, async_save=False, every_n_steps=3) as ck:
        step = ck.restore(state)
        print(f"restored {step} T_max={sched.T_max}", flush=True)
        for s in range(step + 1, step + 4):
            opt.step()
            sched.step()
            ck.step(s, state)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
