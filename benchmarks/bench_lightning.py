"""Training-time overhead of ``ResilientCheckpoint`` against Lightning's ``ModelCheckpoint`` at
the same interval, in one run.

    .venv/bin/python benchmarks/bench_lightning.py [--mb 300] [--steps 20] [--every 5] \
        [--reps 5] [--batch 16] [--threads 1] [--variants] [--out benchmarks/results] \
        [--dir DIR] [--quick]

Model: an MLP of square ``Linear`` layers (width 2048) with AdamW, about ``--mb`` MB of state
(parameters + ``exp_avg`` + ``exp_avg_sq``, fp32; the exact size is reported), trained by a real
``lightning.Trainer`` on CPU for ``--steps`` steps on random data, with ``--threads`` intra-op
threads (default 1: one core stays free for background work, as on a GPU node, where the
training loop's CPU threads mostly wait for the GPU; with every core busy training, a background
save competes with training for them, and OpenMP threads spin while it runs: pass ``--threads 2``
on 2 cores to see that case). Configurations, each a fresh Trainer and a freshly initialised
model:

- ``none``: no checkpointing (``enable_checkpointing=False``), the baseline;
- ``ModelCheckpoint``: ``ModelCheckpoint(every_n_train_steps=K, save_top_k=1)`` (keeps the
  newest ``.ckpt``, deletes the previous one: the incumbent's cheapest setting);
- ``ResilientCheckpoint``: ``ResilientCheckpoint(every_n_steps=K, keep_last=1)``, defaults
  otherwise (background save, snapshot overlapped with the next forward/backward);
- with ``--variants``, ``ResilientCheckpoint (no overlap)`` and ``ResilientCheckpoint (sync)``:
  ``overlap_snapshot=False`` and ``async_save=False``, to show where the gain comes from.

Time of a configuration = from ``on_train_start`` to ``fit()`` returning, so it includes the
wait for the last background save to be committed at the end of ``fit`` (our teardown flushes).
Overhead = that time minus the ``none`` time of the same repetition; every figure is the median
of ``--reps`` repetitions after one discarded warm-up round, configurations round-robin within
each repetition. Also reported: best against best (the fastest run of a configuration minus the
fastest run without checkpointing: other work on a shared machine only ever adds time) and the
process CPU time overhead (all threads). DESIGN.md, "Performance method": absolute times on a
shared 2-core machine are noise, ratios measured side by side are not. For scale, the same run also measures
``torch.save`` of the state, a raw write+fsync of its bytes (the disk's limit) and a ``copy_``
into preallocated buffers (the snapshot's limit).

On a GPU (issue 13), ``--device cuda --mb 1600 --batch 8192``: the model trains on the GPU, the
snapshot's limit is the device-to-host copy into pinned buffers, and the goal is 0.1x.

Goal (issue 6): overhead of ResilientCheckpoint <= 0.5x the overhead of ModelCheckpoint, state
>= 256 MB. Writes ``bench_lightning.json`` and ``bench_lightning.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import lightning as L
import torch
from common import (
    add_device_option,
    apply_quick,
    device_missing,
    host_copies,
    library_version,
    write_results,
)
from lightning.pytorch.callbacks import ModelCheckpoint

from resilient_callbacks.lightning import ResilientCheckpoint

WIDTH = 2048
GOAL = {"cpu": 0.5, "cuda": 0.1}  # issue 6 (CPU), issue 13 (GPU, state >= 1.5 GB)

warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
warnings.filterwarnings("ignore", message=r".*number of training batches.*")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("resilient_callbacks").setLevel(logging.ERROR)


class Net(L.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Clock(L.Callback):
    """Times the training loop (wall and process CPU time, all threads); reads our
    checkpointer's per-save blocking time at the end."""

    def __init__(self) -> None:
        self.t_start = 0.0
        self.last_batch_end = 0.0
        self.cpu_start = 0.0
        self.blocking: list[float] = []
        self.state_bytes = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.t_start = time.perf_counter()
        self.cpu_start = time.process_time()

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.last_batch_end = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.optimizers[0]
        tensors = list(pl_module.state_dict().values())
        tensors += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
        self.state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, ResilientCheckpoint) and cb.checkpointer is not None:
                self.blocking = list(cb.checkpointer.blocking_seconds)


def layers_for(mb: float) -> int:
    return max(1, round(mb * 1e6 / 12 / (WIDTH * WIDTH + WIDTH)))


def run_config(name: str, args: argparse.Namespace, work: str) -> dict[str, Any]:
    d = os.path.join(work, name.replace(" ", "_").replace("(", "").replace(")", ""))
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    callbacks: list[Any] = []
    enable_ckpt = False
    if name == "ModelCheckpoint":
        callbacks.append(ModelCheckpoint(dirpath=d, every_n_train_steps=args.every, save_top_k=1))
        enable_ckpt = True
    elif name.startswith("ResilientCheckpoint"):
        kw: dict[str, Any] = {"every_n_steps": args.every, "keep_last": 1}
        if "no overlap" in name:
            kw["overlap_snapshot"] = False
        if "sync" in name:
            kw["async_save"] = False
        callbacks.append(ResilientCheckpoint(d, **kw))
        enable_ckpt = True
    clock = Clock()
    callbacks.append(clock)
    saves: list[float] = []
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint):
            original = cb._save_checkpoint

            def timed(trainer: Any, filepath: str, _orig: Any = original) -> None:
                t0 = time.perf_counter()
                _orig(trainer, filepath)
                saves.append(time.perf_counter() - t0)

            cb._save_checkpoint = timed  # type: ignore[method-assign]
    model = Net(layers_for(args.mb), WIDTH)
    data = torch.utils.data.TensorDataset(torch.randn(args.batch * 8, WIDTH))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        callbacks=callbacks,
        enable_checkpointing=enable_ckpt,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=d,
    )
    gc.collect()
    trainer.fit(model, loader)
    end = time.perf_counter()
    total = end - clock.t_start
    cpu = time.process_time() - clock.cpu_start
    shutil.rmtree(d, ignore_errors=True)
    out: dict[str, Any] = {
        "total_s": total,
        # after the last batch until fit() returns: for ours, the wait for the last
        # checkpoint to become durable
        "tail_s": end - clock.last_batch_end,
        "cpu_s": cpu,
        "state_bytes": clock.state_bytes,
    }
    if saves:
        out["save_s"] = saves
    if clock.blocking:
        out["blocking_s"] = clock.blocking
    del trainer, model
    gc.collect()
    return out


def scale_baselines(mb: float, work: str, device: str = "cpu") -> dict[str, float]:
    """torch.save and raw write+fsync of a state of the same size (median of 3), and copy_ into
    preallocated buffers (fastest of 3; on CUDA the device-to-host copy into pinned buffers, the
    snapshot's floor)."""
    model = Net(layers_for(mb), WIDTH).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.net(torch.randn(2, WIDTH, device=device)).square().mean().backward()
    opt.step()
    tensors = list(model.state_dict().values())
    tensors += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    bufs, copy_s = host_copies(tensors)
    path = os.path.join(work, "baseline.bin")
    res: dict[str, list[float]] = {"torch.save": [], "raw write+fsync": [], "copy_": [copy_s]}
    for _ in range(3):
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        res["torch.save"].append(time.perf_counter() - t0)
        os.remove(path)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for t in bufs:
                f.write(memoryview(t.detach().contiguous().view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        res["raw write+fsync"].append(time.perf_counter() - t0)
        os.remove(path)
    return {k: statistics.median(v) for k, v in res.items()}


CONFIGS = ["none", "ModelCheckpoint", "ResilientCheckpoint"]
VARIANTS = ["ResilientCheckpoint (no overlap)", "ResilientCheckpoint (sync)"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=300.0, help="state size in MB (>= 256)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for training (default 1: a core stays free for background "
        "work, as on a GPU node whose training loop mostly waits for the GPU)",
    )
    add_device_option(p)
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument(
        "--variants",
        action="store_true",
        help="also measure ours with overlap_snapshot=False and with async_save=False",
    )
    p.add_argument(
        "--quick", action="store_true", help="small state, 1 repetition (smoke; options given win)"
    )
    args = p.parse_args()
    if device_missing(args.device):
        return 2
    if args.quick:
        apply_quick(p, args, mb=24, steps=12, every=4, reps=1, batch=16)
    configs = CONFIGS + (VARIANTS if args.variants else [])
    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="bench_lightning-", dir=args.dir)
    t_begin = time.time()
    meta: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
        "library": library_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "args": vars(args),
    }
    try:
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for rep in range(args.reps + 1):  # round 0 is a discarded warm-up
            for c in configs:
                r = run_config(c, args, work)
                # (the split in the log too: a run stopped at a time limit keeps it)
                print(
                    f"rep {rep} {c}: {r['total_s']:.2f} s (after the last step "
                    f"{r['tail_s']:.2f} s)",
                    flush=True,
                )
                if rep > 0:
                    runs[c].append(r)
        scale = scale_baselines(args.mb, work, args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["runtime_s"] = round(time.time() - t_begin, 1)

    base = [r["total_s"] for r in runs["none"]]
    base_tail = [r["tail_s"] for r in runs["none"]]
    base_cpu = [r["cpu_s"] for r in runs["none"]]
    report: dict[str, Any] = {"meta": meta, "configs": {}, "scale": scale}
    for c in configs:
        totals = [r["total_s"] for r in runs[c]]
        cpus = [r["cpu_s"] for r in runs[c]]
        overheads = [t - b for t, b in zip(totals, base, strict=True)]
        entry: dict[str, Any] = {
            "total_s": statistics.median(totals),
            # the median of the overheads paired within each repetition ...
            "overhead_s": statistics.median(overheads),
            "overhead_pct": 100
            * statistics.median([o / b for o, b in zip(overheads, base, strict=True)]),
            # ... and best against best (noise from other work on the machine only adds time)
            "overhead_min_s": min(totals) - min(base),
            "cpu_overhead_s": statistics.median(
                [x - b for x, b in zip(cpus, base_cpu, strict=True)]
            ),
            # split: inside the training loop, and the wait at the end of fit()
            "loop_overhead_s": statistics.median(
                [
                    (r["total_s"] - r["tail_s"]) - (b - bt)
                    for r, b, bt in zip(runs[c], base, base_tail, strict=True)
                ]
            ),
            "end_wait_s": statistics.median(
                [r["tail_s"] - bt for r, bt in zip(runs[c], base_tail, strict=True)]
            ),
            "totals_s": totals,
            "cpu_s": cpus,
        }
        per_save = [x for r in runs[c] for x in r.get("save_s", [])]
        blocking = [x for r in runs[c] for x in r.get("blocking_s", [])]
        if per_save:
            entry["save_call_s"] = statistics.median(per_save)
        if blocking:
            entry["blocking_s"] = statistics.median(blocking)
        report["configs"][c] = entry
    state_bytes = runs["none"][0]["state_bytes"]
    ours_e, theirs_e = (
        report["configs"]["ResilientCheckpoint"],
        report["configs"]["ModelCheckpoint"],
    )

    def rel(key: str) -> float:
        return ours_e[key] / theirs_e[key] if theirs_e[key] > 0 else float("nan")

    ratio = rel("overhead_s")
    saves = args.steps // args.every
    report["state_bytes"] = state_bytes
    report["saves_per_run"] = saves
    report["step_s"] = statistics.median(base) / args.steps
    report["goal"] = {
        "ratio": ratio,
        # per save inside the loop (the end-of-training wait for durability is reported apart)
        "ratio_loop": ours_e["loop_overhead_s"] / theirs_e["overhead_s"],
        "ratio_min": rel("overhead_min_s"),
        "ratio_cpu": rel("cpu_overhead_s"),
        "target": GOAL[args.device],
        "met": bool(ratio <= GOAL[args.device] and state_bytes >= 256e6),
        "state_ge_256MB": state_bytes >= 256e6,
    }

    md = render(report)
    write_results(args.out, "bench_lightning", report, md)
    print(md)
    return 0


def _x(ratio: float) -> str:
    """A ratio to ModelCheckpoint's figure; n/a where that figure was not above 0 (noise)."""
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "n/a (ModelCheckpoint's figure <= 0)"


def render(report: dict[str, Any]) -> str:
    meta, args = report["meta"], report["meta"]["args"]
    lines = [
        f"# bench_lightning: {meta.get('device_name', 'CPU')}, {meta['cpus']} CPUs, torch {meta['torch']}, lightning "
        f"{meta['lightning']}, medians of {args['reps']} (load average at start "
        f"{meta['loadavg_start']}, end {meta['loadavg_end']}), library {meta['library']}, "
        f"runtime {meta['runtime_s']} s",
        "",
        f"State {report['state_bytes'] / 1e6:.0f} MB (parameters + AdamW state, fp32); "
        f"{args['steps']} steps of {report['step_s']:.3f} s (batch {args['batch']}, "
        f"{args.get('threads', 1)} intra-op thread(s)), a checkpoint "
        f"every {args['every']} steps ({report['saves_per_run']} per run); time = on_train_start "
        "to fit() returning (includes waiting for the last background save).",
        "",
        "| configuration | time s (runs) | overhead s (paired median) | overhead % | overhead s "
        "(best vs best) | CPU overhead s | per save, s | vs ModelCheckpoint (median / best / CPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    th = report["configs"]["ModelCheckpoint"]

    def rel(e: dict[str, Any], key: str) -> str:
        return f"{e[key] / th[key]:.2f}x" if th[key] > 0 else "-"

    for c, e in report["configs"].items():
        if c == "none":
            per = ""
        elif "save_call_s" in e:
            per = f"{e['save_call_s']:.3f} (save call)"
        elif "blocking_s" in e:
            per = f"{e['blocking_s']:.3f} (blocking snapshot)"
        else:
            per = ""
        vs = (
            ""
            if c == "none"
            else " / ".join(rel(e, k) for k in ("overhead_s", "overhead_min_s", "cpu_overhead_s"))
        )
        name = f"**{c}**" if c == "ResilientCheckpoint" else c
        runs = ", ".join(f"{t:.1f}" for t in e["totals_s"])
        lines.append(
            f"| {name} | {e['total_s']:.2f} ({runs}) | {e['overhead_s']:+.3f} | "
            f"{e['overhead_pct']:+.1f}% | {e['overhead_min_s']:+.3f} | "
            f"{e['cpu_overhead_s']:+.3f} | {per} | {vs} |"
        )
    s = report["scale"]
    g = report["goal"]
    lines += [
        "",
        f"Scale, same state: torch.save {s['torch.save']:.3f} s, raw write+fsync "
        f"{s['raw write+fsync']:.3f} s (disk limit), copy_ into preallocated buffers "
        f"{s['copy_']:.3f} s (snapshot limit). CPU overhead: process CPU time (all threads) "
        "minus that of the run without checkpointing; other work on the machine barely moves it.",
        "",
        "In-loop overhead / end wait (s): "
        + ", ".join(
            f"{c} {e['loop_overhead_s']:+.3f} / {e['end_wait_s']:+.3f}"
            for c, e in report["configs"].items()
            if c != "none"
        )
        + f"; ours in the loop / ModelCheckpoint's overhead: {g['ratio_loop']:.3f}x (the end "
        "wait is the last checkpoint becoming durable, once per run).",
        "",
        f"Goal: overhead of ResilientCheckpoint <= {g['target']}x that of ModelCheckpoint at the "
        f"same interval, state >= 256 MB: **{_x(g['ratio'])} (paired medians), "
        f"{'met' if g['met'] else 'missed'}**; best vs best {_x(g['ratio_min'])}, CPU time "
        f"{_x(g['ratio_cpu'])}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
