"""Synchronous save/restore of the core Checkpointer against the incumbents, in one run.

    .venv/bin/python benchmarks/bench_core.py [--mb 256] [--reps 5] [--out benchmarks/results]

State: an MLP plus its AdamW state (parameters + exp_avg + exp_avg_sq, after one step), about
``--mb`` MB in all. Every method writes the same state to the same disk in the same run; each
figure is the median of ``--reps`` repetitions, and every ratio is against a baseline measured
right beside it:

- ``raw write+fsync``: the state's bytes written to one file and fsynced: the disk's limit;
- ``torch.save+fsync``: ``torch.save({"model": ..., "optimizer": ...})`` then fsync;
- ``safetensors.save_file+fsync``: model and optimizer tensors flattened into one file;
- ``ours (sync)``: ``Checkpointer.save``: encode, write + checksum, fsync, manifest, rename.

Restore, each repetition in a fresh process as at a real resume (files in the page cache; a new
model and an optimizer with empty state as targets; for every method, one byte per page of the
restored optimizer state is read afterwards, inside the timed span, so lazily mapped data is
really loaded and every method pays the same touch):
``torch.load(mmap=True, weights_only=True)`` + ``load_state_dict``,
``torch.load(weights_only=True)`` + ``load_state_dict``, and ``Checkpointer.restore`` (which also
verifies every checksum).

Writes ``bench_core.json`` and ``bench_core.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import fsync_path, library_version, write_results
from safetensors.torch import save_file

from resilient_callbacks import Checkpointer


def build_state(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # 3 tensors of state per parameter (param, exp_avg, exp_avg_sq), 4 bytes each
    n_params = mb * 1_000_000 // 12
    width = 2048
    layers = max(1, n_params // (width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return n


def timeit(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> list[float]:
    out = []
    for _ in range(reps):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def restore_worker(method: str, work: str, mb: int) -> None:
    model, _ = build_state(mb)  # same shapes; its values are overwritten by the restore
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # empty state, as at a real resume
    t0 = time.perf_counter()
    if method == "ours":
        with Checkpointer(os.path.join(work, "ours"), preemption=False) as ck:
            ck.restore({"model": model, "optimizer": opt})
    else:
        sd = torch.load(
            os.path.join(work, "torch.pt"), mmap=method == "torch_mmap", weights_only=True
        )
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
    # every method: touch one byte per page so lazily mapped optimizer state is really loaded
    # (ours keeps optimizer tensors that view its mapping too; timing the touch for the torch
    # methods alone charged them work that ours was not charged)
    touched = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel():
                v.reshape(-1)[:: max(1, 4096 // v.element_size())].sum()
                touched += v.numel() * v.element_size()
    print(json.dumps({"seconds": time.perf_counter() - t0, "touched_bytes": touched}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--restore-worker", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp)")
    args = ap.parse_args()
    if args.restore_worker:
        restore_worker(args.restore_worker[0], args.restore_worker[1], args.mb)
        return 0
    work = tempfile.mkdtemp(prefix="rc-bench-", dir=args.dir)
    model, opt = build_state(args.mb)
    nbytes = state_bytes(model, opt)
    print(f"state: {nbytes / 1e6:.0f} MB, {args.reps} reps, writing under {work}")
    results: dict[str, list[float]] = {}

    flat = {f"m.{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                flat[f"o.{i}.{k}"] = v.reshape(v.shape) if v.dim() else v.reshape(1)
    blob = torch.cat([t.reshape(-1).view(torch.uint8) for t in flat.values()])

    def raw() -> None:
        p = os.path.join(work, "raw.bin")
        with open(p, "wb", buffering=0) as f:
            mv = memoryview(blob.numpy())
            for i in range(0, len(mv), 16 << 20):
                f.write(mv[i : i + (16 << 20)])
            os.fsync(f.fileno())

    def tsave() -> None:
        p = os.path.join(work, "torch.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, p)
        fsync_path(p)

    def stsave() -> None:
        p = os.path.join(work, "st.safetensors")
        save_file(flat, p)
        fsync_path(p)

    state = {"model": model, "optimizer": opt}
    ck_dir = os.path.join(work, "ours")
    ck = Checkpointer(ck_dir, keep_last=1, async_save=False, preemption=False)
    counter = iter(range(1, 10_000))

    def ours() -> None:
        ck.save(next(counter), state)

    for name, fn in [
        ("raw write+fsync", raw),
        ("torch.save+fsync", tsave),
        ("safetensors.save_file+fsync", stsave),
        ("ours (sync save)", ours),
    ]:
        fn()  # warm-up: page allocation, first-touch
        results[name] = timeit(fn, args.reps)
        print(f"  {name:32} median {statistics.median(results[name]):.3f} s")

    ck.close()
    # Restore: each repetition in a fresh process (a real resume starts in a new process, where
    # every allocation is first-touched), files in the page cache, a freshly built model and
    # optimizer (empty state) as targets; the restore call and the same one-byte-per-page touch
    # of the restored optimizer state are timed for every method.
    touched: dict[str, int] = {}
    for name, method in [
        ("torch.load(mmap)+load_state_dict", "torch_mmap"),
        ("torch.load+load_state_dict", "torch"),
        ("ours (restore, verified)", "ours"),
    ]:
        times = []
        for _ in range(args.reps + 1):
            out = subprocess.run(
                [sys.executable, __file__, "--restore-worker", method, work, "--mb", str(args.mb)],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            times.append(r["seconds"])
            touched[name] = r["touched_bytes"]
        results[name] = times[1:]  # the first run warms the page cache
        print(f"  {name:32} median {statistics.median(results[name]):.3f} s")
    shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    raw_t = med["raw write+fsync"]
    report = {
        "state_bytes": nbytes,
        "reps": args.reps,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "library": library_version(),
        "restore_touched_bytes": touched,
        "median_seconds": med,
        "all_seconds": results,
        "ratios": {
            "ours_save / torch.save": med["ours (sync save)"] / med["torch.save+fsync"],
            "ours_save / safetensors.save_file": med["ours (sync save)"]
            / med["safetensors.save_file+fsync"],
            "ours_save / raw write+fsync": med["ours (sync save)"] / raw_t,
            "ours_restore / torch.load(mmap)": med["ours (restore, verified)"]
            / med["torch.load(mmap)+load_state_dict"],
            "ours_restore / torch.load": med["ours (restore, verified)"]
            / med["torch.load+load_state_dict"],
        },
    }
    lines = [
        f"State {nbytes / 1e6:.0f} MB (MLP + AdamW), medians of {args.reps}, "
        f"{os.cpu_count()} CPUs, {platform.platform()}, torch {torch.__version__}, "
        f"{report['date']}, library {report['library']}",
        "",
        "| method | median s | GB/s | vs raw write+fsync |",
        "|---|---|---|---|",
    ]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.3f} | {nbytes / v / 1e9:.2f} | {v / raw_t:.2f}x |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in report["ratios"].items()]
    md = "\n".join(lines) + "\n"
    write_results(args.out, "bench_core", report, md)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
