"""A DeepSpeed training script for the tests: tiny model with dropout, gradient accumulation, a
warm-up LR scheduler, AdamW, our resumable loader; optionally SIGKILLs itself mid-run.

    python ds_train.py --dir D --out O --stage S [--dtype bf16] [--steps N] [--every K]
                       [--die-at STEP] [--launcher]

Run once per rank (RANK/WORLD_SIZE/MASTER_* in the environment; gloo on CPU; with
``DS_ACCELERATOR=cuda``, NCCL, each rank on its GPU, deterministic algorithms). Appends one line
per micro-step to ``O.rank<r>.losses`` (micro-step, loss as float.hex) and, at the end, writes
``O.rank0.final.json``: every full fp32 parameter and Adam moment (gathered), as hex floats;
after each optimizer step, ``O.rank<r>.buffers.jsonl``: the ZeRO part's host buffers.
With ``--launcher`` the script calls plain ``deepspeed.initialize`` with the section in its
config: run it through ``python -m resilient_callbacks.deepspeed.run``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (cuBLAS: deterministic on CUDA)

import torch
from torch import nn

CUDA = os.environ["DS_ACCELERATOR"] == "cuda"  # test_gpu_deepspeed.py: NCCL, a GPU a rank


def build(
    stage: int, dtype: str, dirpath: str, every: int, extra: dict | None, gas: int = 2
) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "gradient_clipping": 1.0,
        "resilient_checkpoint": {
            "dirpath": dirpath,
            "every_n_steps": every,
            "keep_last": 2,
            **(extra or {}),
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        # dynamic loss scaling that overflows now and then: skipped steps, a scale that halves
        # and grows again (window 3), so a resume must restore the scaler's whole state
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": 18,
            "loss_scale_window": 3,
            "hysteresis": 1,
            "min_loss_scale": 1,
        }
    return cfg


def allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator says fp16 is unsupported unless oneDNN has fp16 kernels for
    this CPU (it refuses fp16 at initialize). torch computes fp16 on any CPU, more slowly: the
    tests tell the accelerator so, and DeepSpeed's fp16 paths (ZeRO's loss scaler, overflow
    checks, skipped steps) run unchanged."""
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True  # type: ignore[method-assign]


def hold_deferred_copies(record: str) -> None:
    """Overlapped snapshots on the CPU: each deferred copy waits until the training thread
    orders what follows after it (``Snapshot.wait_device``: the optimizer's pre-step hook, or
    the final save), at most 20 s, so it reads the tensors as they are then, never earlier. A
    write to a deferred tensor before that point is in the checkpoint (the run is not exact);
    without the hook the copy reads the state after the next step. Appends the number of
    tensors each snapshot defers to ``record``, one line each."""
    import threading

    from resilient_callbacks import snapshot

    cls = snapshot.Snapshot
    real_init, real_later, real_wait = cls.__init__, cls._copy_later, cls.wait_device

    def init(self, tensors, buffers, **kw):
        self.released = threading.Event()
        real_init(self, tensors, buffers, **kw)

    def later(self, items, stream):
        with open(record, "a") as f:
            f.write(f"{len(items)}\n")
        self.released.wait(20.0)
        real_later(self, items, stream)

    def wait_device(self):
        self.released.set()
        real_wait(self)

    cls.__init__, cls._copy_later, cls.wait_device = init, later, wait_device


class RunningNorm(nn.Module):
    """Subtracts a running mean of its input: a buffer updated in training from each rank's
    own batches (DeepSpeed, unlike DDP, does not make the ranks' buffers equal again)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.float().mean(0))
        return x - self.mean.to(x.dtype)


def _hexes(t: torch.Tensor) -> list[str]:
    """Every element of ``t`` as float.hex (exact), on the CPU."""
    return [float(v).hex() for v in t.detach().float().cpu().flatten()]


def full_state(engine, stage: int) -> dict[str, list[str]]:
    """Every full fp32 master weight and Adam moment, gathered (a collective), the skipped-step
    count and, with fp16, the loss scaler's state."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, list[str]] = {"meta/skipped_steps": [str(engine.skipped_steps)]}
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if engine.fp16_enabled():
        for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
            value = getattr(scaler, key, None) if scaler is not None else None
            if value is None:  # ZeRO 0's FP16_Optimizer keeps them on itself
                value = getattr(engine.optimizer, key, None)
            out[f"meta/loss_scaler/{key}"] = [repr(value)]
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:  # frozen (--freeze-first): as it is, in no optimizer
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                out[f"frozen/{name}"] = _hexes(p)
            continue
        if stage == 0:
            out[f"param/{name}"] = _hexes(p)
            continue
        out[f"fp32/{name}"] = _hexes(safe_get_full_fp32_param(p))
        for key in ("exp_avg", "exp_avg_sq"):
            t = safe_get_full_optimizer_state(p, key)
            out[f"{key}/{name}"] = _hexes(t)
    return out


def record_buffers(ck, path: str, engine) -> None:
    """Append the ZeRO part's host buffers (name -> address) after an optimizer step: those
    made ahead of the first save must be the ones it copies into."""
    bufs = ck._saver.part_buffers._by_id.get("engine/zero")
    if bufs is not None:
        bufs.wait_allocated()
    ptrs = {k: b.data_ptr() for k, b in bufs._bufs.items()} if bufs is not None else {}
    with open(path, "a") as f:
        f.write(json.dumps({"step": engine.global_steps, "buffers": ptrs}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--term-at", type=int, default=None)
    ap.add_argument("--raise-at", type=int, default=None)  # + save_on_exception in the section
    ap.add_argument("--guard", action="store_true")  # the loop in `with handle:`
    ap.add_argument("--gas", type=int, default=2)  # gradient_accumulation_steps
    ap.add_argument("--teacher", action="store_true")  # --launcher: and an untrained engine
    ap.add_argument("--launcher", action="store_true")
    ap.add_argument("--no-pickle", action="store_true")
    ap.add_argument("--sync", action="store_true")  # async_save=False
    ap.add_argument("--overlap", action="store_true")  # overlap_snapshot=True
    ap.add_argument("--offload", action="store_true")  # offload_optimizer (+ param at stage 3)
    ap.add_argument("--remote", default=None)  # the remote tier's URL
    ap.add_argument("--dump-restored", action="store_true")  # the gathered state after restore
    ap.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher adds it
    ap.add_argument("--no-close", action="store_true")  # leave the end to the launcher
    # a loop unaware of resuming: `for epoch in range(N): for batch in loader` (no step bound)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--plain", action="store_true")  # no section: DeepSpeed's own loader
    # incremental=True, and a layer wide enough that each rank's ranges are blobs (>= 16 KiB)
    ap.add_argument("--incremental", action="store_true")
    # the first layer frozen (as a base model under LoRA), the optimizer given the rest
    ap.add_argument("--freeze-first", action="store_true")
    # a running normaliser in front: a buffer each rank updates from its own data
    ap.add_argument("--running-norm", action="store_true")
    # with --freeze-first: the frozen layer starts from other values (a restore must bring back
    # the saved ones; without one the run differs)
    ap.add_argument("--scramble-frozen", action="store_true")
    # the optimizer given the biases before the weights (ZeRO 1-2: another flat layout)
    ap.add_argument("--biases-first", action="store_true")
    args = ap.parse_args()

    if os.environ.get("RC_COUNT_COPIES"):  # the names each snapshot copies, one line each
        from resilient_callbacks import snapshot

        real_init = snapshot.Snapshot.__init__

        def counting(self, tensors, buffers, **kw):
            with open(f"{args.out}.rank{os.environ.get('RANK', '0')}.copies.jsonl", "a") as f:
                f.write(json.dumps(sorted(tensors)) + "\n")
            real_init(self, tensors, buffers, **kw)

        snapshot.Snapshot.__init__ = counting

    if os.environ.get("RC_HOLD_DEFERRED"):  # a path: the record, per rank
        hold_deferred_copies(f"{os.environ['RC_HOLD_DEFERRED']}.rank{os.environ.get('RANK', '0')}")

    if args.no_pickle:  # restore must never unpickle
        import pickle

        def refuse(*a, **k):
            raise AssertionError("pickle/torch.load called during a resilient_callbacks restore")

        pickle.load = pickle.loads = torch.load = refuse  # type: ignore[assignment]

    import deepspeed

    from ds_noshm import skip_shm_op

    skip_shm_op()
    if args.dtype == "fp16":
        allow_fp16_on_cpu()
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="nccl" if CUDA else "gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(1234)
    width = 4096 if args.incremental else 16
    model = nn.Sequential(nn.Linear(6, width), nn.Dropout(0.2), nn.ReLU(), nn.Linear(width, 1))
    if args.running_norm:
        model = nn.Sequential(RunningNorm(6), *model)
    if args.freeze_first:
        model[0].requires_grad_(False)
        if args.scramble_frozen:
            with torch.no_grad():
                model[0].weight.normal_(generator=torch.Generator().manual_seed(99))
    trainable = [p for p in model.parameters() if p.requires_grad]
    if args.biases_first:
        trainable = [p for p in trainable if p.dim() == 1] + [p for p in trainable if p.dim() > 1]
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g)
    )
    extra: dict = {"async_save": False} if args.sync else {}
    if args.overlap:
        extra["overlap_snapshot"] = True
    if args.remote:
        extra["remote"] = args.remote
    if args.incremental:
        extra["incremental"] = True
    if args.raise_at is not None:
        extra["save_on_exception"] = True
    cfg = build(args.stage, args.dtype, args.dir, args.every, extra, args.gas)
    if args.offload:  # ZeRO-Offload: fp32 masters and moments in host memory, torch's AdamW
        cfg["zero_force_ds_cpu_optimizer"] = False
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if args.stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    torch.manual_seed(100 + rank)  # per-rank dropout streams, restored on resume
    if args.plain:  # DeepSpeed alone: its own DeepSpeedDataLoader, no checkpoints
        del cfg["resilient_checkpoint"]
        engine, _, loader, _ = deepspeed.initialize(
            model=model, model_parameters=trainable, training_data=data, config=cfg
        )
        assert not hasattr(engine, "resilient_checkpoint")
    elif args.launcher:
        engine, _, loader, _ = deepspeed.initialize(
            model=model, model_parameters=trainable, training_data=data, config=cfg
        )
        assert hasattr(engine, "resilient_checkpoint"), "not run through the launcher"
        if args.teacher:  # an engine without an optimizer from the same config: left plain
            drop = ("optimizer", "scheduler", "zero_optimization")  # ZeRO 1-3 needs an optimizer
            frozen = {k: v for k, v in cfg.items() if k not in drop}
            teacher, *_ = deepspeed.initialize(model=nn.Linear(6, 1), config=frozen)
            assert not hasattr(teacher, "resilient_checkpoint")
    else:
        import resilient_callbacks.deepspeed as rcds

        engine, _, loader, _ = rcds.initialize(
            model=model, model_parameters=trainable, training_data=data, config=cfg
        )
    assert "resilient_checkpoint" not in engine.config, "the section reached DeepSpeed"
    if args.offload:  # the engine really offloads (its optimizer takes the offload code paths)
        assert engine.zero_cpu_offload(), "offload_optimizer did not reach the engine"
        assert getattr(engine.optimizer, "cpu_offload", None) or getattr(
            engine.optimizer, "offload_optimizer", None
        ), type(engine.optimizer).__name__
    handle = getattr(engine, "resilient_checkpoint", None)
    with open(f"{args.out}.rank{rank}.restored", "a") as f:
        f.write(
            json.dumps(
                {
                    "step": handle and handle.restored_step,
                    "path": handle and handle.checkpointer.restored_from,
                }
            )
            + "\n"
        )
    if args.dump_restored:
        restored_state = full_state(engine, args.stage)
        if rank == 0:
            with open(f"{args.out}.rank0.restored_state.json", "w") as f:
                json.dump(restored_state, f)
    dtype = next(engine.module.parameters()).dtype
    log = open(f"{args.out}.rank{rank}.losses", "a")  # noqa: SIM115
    # the micro-batches each optimizer step accumulated: "global_steps count" per line
    cycles = open(f"{args.out}.rank{rank}.cycles", "a")  # noqa: SIM115
    since = [0]

    def passes():
        if args.epochs is not None:
            yield from range(args.epochs)
        else:
            while engine.global_steps < args.steps:
                yield None

    def train() -> None:
        for _ in passes():
            for x, y in loader:
                micro = engine.micro_steps
                x, y = x.to(engine.device), y.to(engine.device)  # (the CPU's: as they are)
                loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
                engine.backward(loss)
                log.write(f"{micro} {float(loss.detach()).hex()}\n")  # before step(): may exit 75
                log.flush()
                before = engine.global_steps
                engine.step()
                since[0] += 1
                if engine.global_steps != before:
                    cycles.write(f"{engine.global_steps} {since[0]}\n")
                    cycles.flush()
                    since[0] = 0
                if handle is not None and micro % 2 == 1:  # an optimizer step (accumulation 2)
                    record_buffers(
                        handle.checkpointer, f"{args.out}.rank{rank}.buffers.jsonl", engine
                    )
                if args.die_at is not None and engine.global_steps == args.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if args.term_at is not None and engine.global_steps == args.term_at:
                    os.kill(os.getpid(), signal.SIGTERM)  # the next engine.step() saves, exits 75
                if args.raise_at is not None and engine.global_steps == args.raise_at:
                    raise RuntimeError(f"raised at step {args.raise_at}")
                if args.epochs is None and engine.global_steps >= args.steps:
                    return

    if args.guard:  # the loop inside `with engine.resilient_checkpoint:`, which sees exceptions
        with handle:
            train()
    else:
        train()
    state = full_state(engine, args.stage)
    if handle is not None and not args.no_close:
        handle.close()
    if rank == 0:
        with open(f"{args.out}.rank0.final.json", "w") as f:
            json.dump(state, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
