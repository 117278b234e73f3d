"""A plain PyTorch training loop checkpointed with resilient_callbacks (helper for the tests).

Not a test module. Used by test_exact_resume.py (killed with SIGKILL and resumed) and by
test_distributed.py (``--distributed``: gloo, one process per rank, reading RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT from the environment).

The loop is written the way a user would write it: restore at start, then ``for batch in
loader`` over epochs, ``ckpt.step(step + 1, ...)`` after every optimizer step. The model has
dropout (so the torch RNG matters), AdamW and a StepLR scheduler; the data is a synthetic,
fixed-seed dataset shuffled by a ResumableSampler through ``DataLoader(batch_size=8,
num_workers=0)`` (``--loader plain``, the default) or by the library's ResumableDataLoader
(``--loader resumable``). Python's and NumPy's global RNGs also feed the loss, so their restore
matters as well.

Outputs:
  --out-jsonl   one line per completed step: {"step", "loss" (float.hex), "epoch", "rank"},
                flushed and fsynced before the next step starts;
  --out-params  at the end, a safetensors file with the final model parameters.
With --distributed each rank appends ``.rank<r>`` to both paths.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from resilient_callbacks import Checkpointer, PerRank, ResumableDataLoader, ResumableSampler

NUM_SAMPLES = 100  # 12 full batches of 8 and one of 4 per epoch (single process)
IN_DIM, HIDDEN, OUT_DIM = 16, 32, 4


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, IN_DIM, generator=g)
    w = torch.randn(IN_DIM, OUT_DIM, generator=g)
    y = x @ w + 0.1 * torch.randn(NUM_SAMPLES, OUT_DIM, generator=g)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(HIDDEN, OUT_DIM),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir")
    p.add_argument("--total-steps", type=int, default=60)
    p.add_argument("--every-n-steps", type=int, default=5)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--resume", default="auto", help="'auto', 'never' or a step number")
    p.add_argument("--out-jsonl", required=True)
    p.add_argument("--out-params", required=True)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument(
        "--hold-at",
        type=int,
        default=None,
        help="after step N (logged and ckpt.step'ed), wait until a preemption signal arrives "
        "(a SIGKILL ends the wait too): a test's signal then lands at this step however slow "
        "the machine; no signal within --hold-timeout: exit 3",
    )
    p.add_argument("--hold-rank", type=int, default=None, help="with --distributed: hold only here")
    p.add_argument("--hold-timeout", type=float, default=300.0)
    p.add_argument("--distributed", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda (deterministic algorithms on)")
    p.add_argument(
        "--overlap-snapshot", action="store_true", help="Checkpointer(overlap_snapshot=True)"
    )
    p.add_argument("--remote", default=None, help="fsspec URL of the remote tier")
    p.add_argument("--remote-options", default=None, help="JSON dict of fsspec options")
    p.add_argument("--shared-dirpath", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--replicas", type=int, default=0)
    p.add_argument("--remote-every-n-saves", type=int, default=None)
    p.add_argument(
        "--loader",
        choices=["plain", "resumable", "plain-global-rng"],
        default="plain",
        help="plain: DataLoader(sampler=ResumableSampler, generator=torch.Generator()); "
        "resumable: ResumableDataLoader; plain-global-rng: DataLoader without a "
        "generator (documented to diverge after resume)",
    )
    return p.parse_args(argv)


def fsync_append(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _mark(what: str) -> None:
    if os.environ.get("RC_LOG"):
        print(
            f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {what}",
            file=sys.stderr,
            flush=True,
        )


def hold(ckpt: Checkpointer | None, step: int, timeout: float = 300.0) -> None:
    """Wait at ``step`` for the test's signal (``--hold-at``; also of tests/hf_train.py and
    tests/lightning_train.py): until ``ckpt``'s preemption watcher sees one, or a SIGKILL
    ends the wait; none within ``timeout``: exit 3. The line on stderr says where."""
    print(f"HOLD at step {step}", file=sys.stderr, flush=True)
    if ckpt is not None and ckpt.watcher is not None:
        got = ckpt.watcher.wait(timeout)
    else:  # no preemption handling: only a SIGKILL ends the wait
        time.sleep(timeout)
        got = False
    if not got:
        print(f"HOLD at step {step}: no signal came in {timeout} s", file=sys.stderr, flush=True)
        sys.exit(3)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("RC_LOG"):
        import logging

        logging.basicConfig(
            level=os.environ["RC_LOG"], format="%(asctime)s %(threadName)s %(message)s"
        )
    _mark("started")
    rank, world = 0, 1
    if args.distributed:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=60),
        )
        rank, world = dist.get_rank(), dist.get_world_size()
        _mark("process group")
    suffix = f".rank{rank}" if args.distributed else ""

    # One intra-op thread: the ops of this tiny model are then deterministic on CPU.
    # (torch.use_deterministic_algorithms is not called: it imports torch._inductor, ~1 s.)
    torch.set_num_threads(1)

    device = torch.device(args.device)
    if device.type == "cuda":
        # cuBLAS needs a fixed workspace to be deterministic; dropout draws from the CUDA RNG,
        # which the checkpoint restores.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)

    # The same initial weights on every rank ...
    torch.manual_seed(0)
    model = make_model().to(device)
    # ... and then rank-specific random streams (dropout masks differ between ranks).
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
    sampler = ResumableSampler(NUM_SAMPLES, shuffle=True, seed=42, num_replicas=world, rank=rank)
    if args.loader == "resumable":
        # The library's loader: position counted in batches handed to the loop, private seed.
        loader = ResumableDataLoader(
            make_dataset(),
            batch_size=8,
            shuffle=True,
            seed=42,
            num_replicas=world,
            rank=rank,
            num_workers=args.num_workers,
        )
        position = loader
    else:
        # A plain DataLoader over a ResumableSampler. It gets its own generator, as data.py
        # documents: a plain DataLoader otherwise draws a seed from the *global* torch RNG every
        # time an iterator is created, which a resumed run does at a different point.
        loader = DataLoader(
            make_dataset(),
            batch_size=8,
            sampler=sampler,
            num_workers=args.num_workers,
            generator=None if args.loader == "plain-global-rng" else torch.Generator(),
        )
        position = sampler

    extra = {"epoch": 0, "samples_seen": 0}
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "data": PerRank(position) if args.distributed else position,
        "extra": PerRank(extra) if args.distributed else extra,
    }
    resume: str | int = int(args.resume) if args.resume.isdigit() else args.resume
    remote_kw = {}
    if args.remote:
        remote_kw = {
            "remote": args.remote,
            "remote_options": json.loads(args.remote_options or "{}"),
        }
        if args.remote_every_n_saves:
            remote_kw["remote_every_n_saves"] = args.remote_every_n_saves
    if args.shared_dirpath != "auto":
        remote_kw["shared_dirpath"] = args.shared_dirpath == "yes"
    if args.replicas:
        remote_kw["replicas"] = args.replicas
    ckpt = Checkpointer(
        args.ckpt_dir,
        every_n_steps=args.every_n_steps,
        keep_last=args.keep_last,
        resume=resume,
        overlap_snapshot=args.overlap_snapshot,
        **remote_kw,
    )
    _mark("constructed")
    step = ckpt.restore(state)
    _mark("restored")
    print(f"[rank {rank}] restored step {step}", file=sys.stderr, flush=True)
    rep = ckpt.last_restore
    if rep is not None:  # machine-readable, for the tests
        # one write: print() writes the line and its end separately, and a log line of the
        # upload thread could land between them (seen once under load)
        sys.stderr.write(
            "RESTORE "
            + json.dumps(
                {
                    "rank": rank,
                    "step": rep.step,
                    "tier": rep.tier,
                    "downloaded_files": rep.downloaded_files,
                    "path": rep.path,
                }
            )
            + "\n"
        )
        sys.stderr.flush()

    with open(args.out_jsonl + suffix, "a") as log:
        if log.tell() > 0:
            with open(args.out_jsonl + suffix, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a previous run was killed mid-line
                    log.write("\n")
        while step < args.total_steps:
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                model.train()
                # Python and NumPy randomness feed the loss too, so their restore matters.
                noise = torch.tensor(
                    np.random.normal(size=(1,)).item() * 1e-3 + random.random() * 1e-3,
                    dtype=torch.float32,
                    device=device,
                )
                out = model(x)
                loss = nn.functional.mse_loss(out, y) + noise
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if world > 1:
                    import torch.distributed as dist

                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.div_(world)
                opt.step()
                sched.step()
                step += 1
                extra["samples_seen"] += int(x.shape[0])
                fsync_append(
                    log,
                    {
                        "step": step,
                        "loss": float(loss.item()).hex(),
                        "epoch": extra["epoch"],
                        "rank": rank,
                    },
                )
                ckpt.step(step, state, metrics={"loss": loss.item()})
                if step == args.hold_at and args.hold_rank in (None, rank):
                    hold(ckpt, step, args.hold_timeout)
                if args.sleep:
                    time.sleep(args.sleep)
                if step >= args.total_steps:
                    break
            else:
                extra["epoch"] += 1
    _mark("training done")
    ckpt.close()
    _mark("closed")

    params = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tmp = args.out_params + suffix + ".tmp"
    save_file(params, tmp)
    os.replace(tmp, args.out_params + suffix)
    if args.distributed:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        _mark("destroyed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
