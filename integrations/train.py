"""Example training script that the orchestrator recipes in integrations/ launch.

A plain PyTorch loop made resumable with one ``Checkpointer`` and a ``ResumableDataLoader``: run
the same command again after a crash, a ``kill -9``, a preemption or a requeue and it continues
from the newest valid checkpoint, bit for bit. It is small and CPU-friendly on purpose; replace
the model and data with yours and keep the three Checkpointer lines.

    python integrations/train.py --ckpt-dir ckpts/run1 --steps 200 --out out/run1
    torchrun --nproc_per_node=2 integrations/train.py --ckpt-dir ckpts/run1 --out out/run1
    srun python integrations/train.py ...   (MASTER_ADDR / MASTER_PORT exported by the sbatch)

One process, or several: the rank and world size are read from ``RANK`` / ``WORLD_SIZE``
(torchrun, Kubeflow's PyTorchJob) or ``SLURM_PROCID`` / ``SLURM_NTASKS`` (srun); with more than
one process it joins a gloo process group (``MASTER_ADDR`` / ``MASTER_PORT`` from the
environment) and trains a DDP model, each rank on its own shard of the data.

Exit codes, as the recipes read them: 0 when all ``--steps`` are done; 75
(``RESUMABLE_EXIT_CODE``, EX_TEMPFAIL) when the Checkpointer was asked to stop by SIGTERM /
SIGUSR1 and saved an emergency checkpoint (the Checkpointer exits by itself; nothing in this
script handles signals); anything else is a crash. Re-running the same command is the right
reaction to 75 and to a crash alike.

``--out DIR`` (optional) records what the tests compare: ``losses.rank<R>.jsonl`` gets one line
per completed step, ``{"step": N, "loss": "<float.hex()>"}``, appended with a single
``write(2)`` so a kill never leaves half a line (a replayed step appears again; the last line
for a step wins), and rank 0 writes the final weights to ``weights.safetensors`` at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from resilient_callbacks import Checkpointer, PerRank, ResumableDataLoader


def dist_env() -> tuple[int, int]:
    """(rank, world size) from torchrun/Kubeflow variables, else from srun's, else (0, 1)."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    return int(rank), int(world)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(512, 4, generator=g))


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4)
    )  # dropout: the torch RNG stream must be restored exactly too


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Resumable example training loop.")
    p.add_argument(
        "--ckpt-dir",
        required=True,
        help="checkpoint directory: shared by all ranks, or node-local with --remote",
    )
    p.add_argument("--remote", default=None, help="durable tier, e.g. s3://bucket/run1")
    p.add_argument(
        "--remote-every-n-saves", type=int, default=None, help="upload every Nth checkpoint"
    )
    p.add_argument("--replicas", type=int, default=0, help="node-local: copies on peer nodes")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=3, help="keep the N newest checkpoints")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", help="directory for per-step losses and the final weights")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of fake work per step")
    p.add_argument(
        "--dist-timeout", type=float, default=120.0, help="seconds a collective may wait for a peer"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = dist_env()
    torch.set_num_threads(1)  # small CPU ops are then deterministic, and 2 ranks fit 2 cores

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",  # CPU; use "nccl" (and move model/batches to cuda:LOCAL_RANK) on GPUs
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.dist_timeout),
        )

    torch.manual_seed(0)  # the same initial weights on every rank ...
    net = make_model()
    model: nn.Module = net
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
    torch.manual_seed(1000 + rank)  # ... then rank-specific dropout masks, all restored exactly
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.7)
    loader = ResumableDataLoader(
        make_data(), batch_size=args.batch_size, shuffle=True, seed=7, num_replicas=world, rank=rank
    )
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "data": PerRank(loader) if world > 1 else loader,
    }

    log_fd = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log_path = os.path.join(args.out, f"losses.rank{rank}.jsonl")
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    tiers: dict = {}
    if args.remote:
        tiers = {"remote": args.remote, "remote_every_n_saves": args.remote_every_n_saves}
        if os.environ.get("AWS_ENDPOINT_URL"):  # MinIO, Ceph, ...
            tiers["remote_options"] = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    if args.replicas:
        tiers["replicas"] = args.replicas
    with Checkpointer(
        args.ckpt_dir, every_n_steps=args.every, keep_last=args.keep_last, **tiers
    ) as ckpt:
        step = ckpt.restore(state)  # newest valid checkpoint, 0 if none
        how = "resumed" if step else "fresh start"
        print(f"[rank {rank}/{world}] starting at step {step} ({how})", file=sys.stderr, flush=True)
        while step < args.steps:
            for xb, yb in loader:  # after a resume: continues mid-epoch, no batch replayed
                loss = nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                if log_fd is not None:
                    line = json.dumps({"step": step, "loss": float(loss.item()).hex()}) + "\n"
                    os.write(log_fd, line.encode())
                ckpt.step(step, state, metrics={"loss": loss.item()})  # saves when due
                if args.sleep:
                    time.sleep(args.sleep)
                if step >= args.steps:
                    break
        # The final state too (a no-op when the last step was just saved), so re-running a
        # finished job only restores and exits.
        ckpt.save(step, state)

    if log_fd is not None:
        os.close(log_fd)
    if args.out and rank == 0:
        from safetensors.torch import save_file

        weights = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
        tmp = os.path.join(args.out, f".weights.{os.getpid()}.tmp")
        save_file(weights, tmp)
        os.replace(tmp, os.path.join(args.out, "weights.safetensors"))
    print(f"[rank {rank}/{world}] finished at step {step}", file=sys.stderr, flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
