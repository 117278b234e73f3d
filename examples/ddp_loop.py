"""Several ranks: DDP on CPU with gloo, resumable with one Checkpointer.

    .venv/bin/torchrun --nproc_per_node=2 examples/ddp_loop.py --dir demo_output/ddp

Stop it partway, then run the same command again: it resumes from the newest checkpoint.

- Ctrl-C in its terminal: torchrun passes the signal on to both workers and waits for them.
- A crash, as a node failure would be: ``pkill -9 -f examples/ddp_loop.py`` kills the launcher
  and both workers at once.
- Not ``kill -9`` of the torchrun process alone: a SIGKILL of the launcher does not reach its
  workers, which keep training and keep the checkpoint directory locked, so the re-run is
  (rightly) refused with ``CheckpointLockedError`` until they exit.

Rank 0 writes the replicated model/optimizer once; every rank writes its own RNG states and its
data position (the loader is wrapped in PerRank).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from resilient_callbacks import Checkpointer, PerRank, ResumableDataLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="demo_output/ddp")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + rank)  # different dropout masks per rank, all restored exactly
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    ds = TensorDataset(x, x.sum(1, keepdim=True))
    loader = ResumableDataLoader(ds, batch_size=16, seed=0, num_replicas=world, rank=rank)
    state = {"model": model, "optimizer": opt, "data": PerRank(loader)}

    with Checkpointer(args.dir, every_n_steps=10, keep_last=2) as ckpt:
        step = ckpt.restore(state)
        if rank == 0:
            print(f"starting at step {step}", flush=True)
        while step < args.steps:
            for xb, yb in loader:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                # final=True on the last step: a re-run of the finished job trains nothing
                ckpt.step(step, state, metrics={"loss": loss.item()}, final=step == args.steps)
                if rank == 0 and step % 10 == 0:
                    print(f"step {step} loss {loss.item():.5f}", flush=True)
                if step >= args.steps:
                    break
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
