"""Training-time overhead and restore time of checkpointing a DeepSpeed engine: DeepSpeed's own
``engine.save_checkpoint`` every K steps (its default torch.save engine, and its decoupled
async engine where it runs) against ``resilient_callbacks.deepspeed.attach(every_n_steps=K)``,
on the same engine, in the same run.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_deepspeed.py [--mb 200] [--stage 2] \
        [--steps 24] [--every 6] [--reps 3] [--dtype fp32|bf16] [--out benchmarks/results]
    python benchmarks/bench_deepspeed.py --device cuda --dtype bf16 ...   # on a GPU (NCCL)

One process, one rank (gloo; NCCL with ``--device cuda``, which sets ``DS_ACCELERATOR=cuda``
unless it is set). Model: an MLP of ``--mb`` MB of fp32 parameters (with AdamW's two
moments and the fp32 masters, the saved state is about 3x that), trained on synthetic data.
Modes, run round-robin in each repetition on the same engine (so drift of a shared machine hits
them alike), medians over ``--reps``:

- ``no checkpointing``: the baseline;
- ``engine.save_checkpoint`` (DeepSpeed's default engine: torch.save of the ZeRO partitions and
  the module, synchronously) every K steps, keeping the last 2 tags;
- ``engine.save_checkpoint`` with DeepSpeed's decoupled engine (``"checkpoint": {"writer":
  {"decoupled": true}}``: a helper process writes), where it can be built here; otherwise its
  error is reported;
- ours: ``attach(engine, every_n_steps=K, keep_last=2)`` (background saving); time includes
  waiting at the end until the last checkpoint is committed;
- with ``--overlap``, ours with ``overlap_snapshot=True`` too (the ZeRO ranges copied while the
  next steps' forward and backward run).

Overhead = time - baseline time in the same repetition. Restore: ``engine.load_checkpoint`` of
DeepSpeed's newest tag against our ``restore`` of our newest checkpoint, same state. Writes
``bench_deepspeed.json`` and ``bench_deepspeed.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
# what DeepSpeed's launcher sets and its decoupled checkpoint engine reads
_ENV.update({"LOCAL_SIZE": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1"})
for k, v in _ENV.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402
from common import library_version, med, write_results  # noqa: E402
from torch import nn  # noqa: E402

OURS = ("ours", "ours_in_loop", "ours_overlap", "ours_overlap_in_loop")
ROWS = (  # the table's rows: label, mode
    ("engine.save_checkpoint (default engine)", "ds"),
    ("engine.save_checkpoint (decoupled engine)", "ds_decoupled"),
    ("ours, with the end wait", "ours"),
    ("ours, in the loop", "ours_in_loop"),
    ("ours overlapped, with the end wait", "ours_overlap"),
    ("ours overlapped, in the loop", "ours_overlap_in_loop"),
)


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def make_engine(mb: int, stage: int, dtype: str, decoupled: bool, batch: int = 8) -> Any:
    """The engine, its micro-batch ``batch`` rows (a GPU needs many more than the CPU's 8 for a
    step of realistic length); :func:`train` feeds it batches of that size."""
    import deepspeed

    width = 1024
    layers = max(1, int(mb * 2**20 / 4 / (width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if decoupled:
        # "data_parallel" set: without it DeepSpeed 0.19 reads a dp_rank its parallel info lacks
        cfg["checkpoint"] = {"writer": {"decoupled": True, "data_parallel": "socket"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, sum(p.numel() for p in model.parameters())


def sync() -> None:
    """Wait for the GPU's queued work, so a time covers it (nothing on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def train(engine: Any, steps: int, after_step: Any = None) -> float:
    p = next(engine.module.parameters())
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 1024, dtype=p.dtype, device=p.device)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if after_step is not None:
            after_step()
    sync()
    return time.perf_counter() - t0


def ds_saving(engine: Any, root: str, every: int, blocking: list[float]) -> Any:
    tags: list[str] = []

    def after() -> None:
        if engine.global_steps % every == 0:
            tag = f"step{engine.global_steps}"
            t0 = time.perf_counter()
            engine.save_checkpoint(root, tag=tag)
            blocking.append(time.perf_counter() - t0)
            tags.append(tag)
            while len(tags) > 2:
                shutil.rmtree(os.path.join(root, tags.pop(0)), ignore_errors=True)

    return after


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    ap.add_argument("--no-decoupled", action="store_true", help="skip DeepSpeed's decoupled engine")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--overlap", action="store_true", help="also ours with overlap_snapshot=True")
    ap.add_argument(
        "--batch", type=int, default=8, help="rows per step (on a GPU: 65536 for ~0.1 s)"
    )
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", args.device)  # read when deepspeed is imported
    os.environ.setdefault("MASTER_PORT", free_port())
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")

    import deepspeed

    import resilient_callbacks.deepspeed as rcds

    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    root = tempfile.mkdtemp(prefix="bench_ds_", dir=args.dir)
    engine, n = make_engine(args.mb, args.stage, args.dtype, decoupled=False, batch=args.batch)
    dec_engine, dec_error = None, None
    if not args.no_decoupled:
        try:
            dec_engine, _ = make_engine(
                args.mb, args.stage, args.dtype, decoupled=True, batch=args.batch
            )
            dec_engine.save_checkpoint(os.path.join(root, "probe"), tag="probe")
            shutil.rmtree(os.path.join(root, "probe"), ignore_errors=True)
        except Exception as e:  # not buildable on this machine (it needs DeepSpeed's aio op)
            writer = getattr(dec_engine, "checkpoint_engine", None)
            if writer is not None and hasattr(writer, "cleanup"):
                try:  # stop its writer process now (left alone, it died at exit, noisily)
                    writer.cleanup()
                except Exception as stop_error:
                    print(f"decoupled engine's cleanup failed: {stop_error}", file=sys.stderr)
            dec_engine, dec_error = None, f"{type(e).__name__}: {str(e)[:300]}"
    train(engine, 2)  # warm-up
    results: dict[str, list[float]] = {
        "none": [],
        "ds": [],
        "ds_decoupled": [],
        "ours": [],
        "ours_in_loop": [],
        "ours_overlap": [],
        "ours_overlap_in_loop": [],
    }
    restore: dict[str, list[float]] = {"ds": [], "ours": []}
    blocking: dict[str, list[float]] = {
        "ds": [],
        "ds_decoupled": [],
        "ours": [],
        "ours_overlap": [],
    }

    def ours(key: str, where: str, overlap: bool) -> None:
        """A run with our checkpointing attached; its directory is left for the restore."""
        t0 = time.perf_counter()
        handle = rcds.attach(
            engine,
            dirpath=where,
            every_n_steps=args.every,
            keep_last=2,
            restore=False,
            preemption=False,
            overlap_snapshot=overlap,
        )
        in_loop = train(engine, args.steps)
        handle.checkpointer.flush()
        sync()
        results[key].append(time.perf_counter() - t0)
        results[f"{key}_in_loop"].append(in_loop)
        blocking[key] += list(handle.checkpointer.blocking_seconds)
        handle.close()

    for rep in range(args.reps):
        results["none"].append(train(engine, args.steps))
        ds_dir = os.path.join(root, f"ds{rep}")
        results["ds"].append(
            train(engine, args.steps, ds_saving(engine, ds_dir, args.every, blocking["ds"]))
        )
        if dec_engine is not None:
            dd = os.path.join(root, f"dec{rep}")
            results["ds_decoupled"].append(
                train(
                    dec_engine,
                    args.steps,
                    ds_saving(dec_engine, dd, args.every, blocking["ds_decoupled"]),
                )
            )
        ours_dir = os.path.join(root, f"ours{rep}")
        ours("ours", ours_dir, overlap=False)
        if args.overlap:
            overlap_dir = os.path.join(root, f"overlap{rep}")
            ours("ours_overlap", overlap_dir, overlap=True)
            shutil.rmtree(overlap_dir, ignore_errors=True)
        # Restore: DeepSpeed's newest tag vs our newest checkpoint, into the same engine.
        tag = sorted(os.listdir(ds_dir), key=lambda t: int(t[4:]) if t.startswith("step") else -1)[
            -1
        ]
        sync()
        t0 = time.perf_counter()
        engine.load_checkpoint(ds_dir, tag=tag)
        sync()
        restore["ds"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        h = rcds.attach(engine, dirpath=ours_dir, restore=True, preemption=False)
        sync()
        restore["ours"].append(time.perf_counter() - t0)
        h.close()
        for d in (ds_dir, ours_dir):
            shutil.rmtree(d, ignore_errors=True)
        print(
            f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in results.items() if v),
            file=sys.stderr,
        )
    shutil.rmtree(root, ignore_errors=True)
    base = med(results["none"])
    over = {k: med(v) - base for k, v in results.items() if v and k != "none"}
    saves = args.steps // args.every

    def vs(key: str, base: str) -> float | None:
        """``key``'s overhead over ``base``'s, where both ran."""
        return over[key] / over[base] if over.get(base) and key in over else None

    report = {
        "library": library_version(),
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "params": n,
        # fp32: the weights (the masters) and two moments; bf16: bf16 weights besides
        "state_mb": round(n * (12 if args.dtype == "fp32" else 14) / 2**20),
        "args": vars(args),
        "times_s": results,
        "overhead_s": over,
        "restore_s": restore,
        "blocking_per_save_s": blocking,
        "decoupled_error": dec_error,
        "ratios": {
            **{f"{k}_vs_ds": vs(k, "ds") for k in OURS},
            "ours_vs_ds_decoupled": vs("ours", "ds_decoupled"),
            "restore_ours_vs_ds": med(restore["ours"]) / med(restore["ds"]),
            "blocking_ours_vs_ds": med(blocking["ours"]) / med(blocking["ds"]),
        },
    }
    r = report["ratios"]

    def row(label: str, key: str) -> str:
        o = over[key]
        return f"| {label} | {o:.2f} | {o / saves:.2f} | {o / over['ds']:.2f}x |\n"

    md = (
        f"# bench_deepspeed ({report['library']}, DeepSpeed {report['deepspeed']}, torch "
        f"{report['torch']}, {report['device']})\n\nZeRO {args.stage}, {args.dtype}, {n / 1e6:.0f} M parameters "
        f"(~{report['state_mb']} MB of weights, fp32 masters and AdamW moments), batch "
        f"{args.batch}, {args.steps} steps, a save "
        f"every {args.every} ({saves} saves), medians of {args.reps}.\n\n"
        "| mode | overhead (s) | per save (s) | vs engine.save_checkpoint |\n|---|---|---|---|\n"
    )
    for label, key in ROWS:
        if key in over:
            md += row(label, key)
    md += (
        "\n"
        f"Restore: engine.load_checkpoint {med(restore['ds']):.2f} s, ours {med(restore['ours']):.2f} s "
        f"({r['restore_ours_vs_ds']:.2f}x).\n"
    )
    blocked = [f"engine.save_checkpoint {med(blocking['ds']):.3f} s"]
    blocked.append(f"ours {med(blocking['ours']):.3f} s ({r['blocking_ours_vs_ds']:.2f}x)")
    for label, key in (("decoupled engine", "ds_decoupled"), ("ours overlapped", "ours_overlap")):
        if blocking[key]:
            blocked.append(f"{label} {med(blocking[key]):.3f} s")
    md += f"\nTraining thread blocked per save (median): {', '.join(blocked)}.\n"
    if dec_error:
        md += f"\nDeepSpeed's decoupled engine did not run here: {dec_error}\n"
    write_results(args.out, "bench_deepspeed", report, md)
    print(md)


if __name__ == "__main__":
    main()
