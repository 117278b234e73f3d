"""FSDP2 (``fully_shard``) on CPU with gloo, resumable with one Checkpointer and ``Sharded``.

    .venv/bin/torchrun --nproc_per_node=2 examples/fsdp_resume.py --dir demo_output/fsdp

(The default 40 steps take a few seconds on CPU: add ``--steps 2000`` to have time to stop it.)
Stop it partway (Ctrl-C, or ``pkill -9 -f examples/fsdp_resume.py``), then run the same command
again: it resumes from the newest valid checkpoint. Run it with another number of processes
(``--nproc_per_node=1``) and it resumes too: the model and optimizer shards are resharded to the
new number of ranks.

Each rank writes its own shards (``parts/train/rank_NNNNN.safetensors``) in the background from
reused host buffers, plus its RNG states and data position (the loader is wrapped in
``PerRank``); the metadata is JSON and nothing is unpickled at restore.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

from resilient_callbacks import Checkpointer, PerRank, ResumableDataLoader
from resilient_callbacks.dcp import Sharded


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="demo_output/fsdp")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank, then sharded
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + rank)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    ds = TensorDataset(x, x.sum(1, keepdim=True))
    loader = ResumableDataLoader(ds, batch_size=16, seed=0, num_replicas=world, rank=rank)
    state = {"train": Sharded(model, opt), "data": PerRank(loader)}

    with Checkpointer(args.dir, every_n_steps=10, keep_last=2) as ckpt:
        step = ckpt.restore(state)  # reshards if the number of ranks changed
        if rank == 0:
            print(f"starting at step {step} on {world} rank(s)", flush=True)
        while step < args.steps:
            for xb, yb in loader:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                ckpt.step(step, state, metrics={"loss": loss.item()}, final=step == args.steps)
                if rank == 0 and step % 10 == 0:
                    print(f"step {step} loss {loss.item():.5f}", flush=True)
                if step >= args.steps:
                    break
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
