"""Restore alone, against ``torch.load(mmap=True)`` + ``load_state_dict``, in one run: what the
checksum verification costs, and what verifying segments in parallel (checksum.py) recovers.

    .venv/bin/python benchmarks/bench_restore.py [--mb 1536] [--reps 5] [--no-cold] [--dir DIR]

The state is ``bench_async.py``'s (square Linear layers + AdamW state, ``--mb`` MB), saved once
by ours and by ``torch.save``. Each restore runs in a fresh process (``bench_async.py``'s
restore worker: a fresh model and optimizer, the restore, then every element of every
restored tensor written once, as the first optimizer step writes them), round-robin over the methods, after one discarded warm-up round:

- ``ours``: ``Checkpointer.restore``, every checksum verified, segments by several threads;
- ``ours, 1 verify thread``: the same with the verification limited to one thread (the control:
  how restore verified before segmented checksums);
- ``torch.load(mmap)+load_state_dict``: verifies nothing.

Warm (files in the page cache, as when a process restarts on the same node) and, unless
``--no-cold``, cold (every file dropped from the page cache before each restore). Goal (issue
13): warm restore <= 1.2x ``torch.load(mmap)``. Writes ``bench_restore.{json,md}`` into
``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time

import torch
from bench_async import bench_restores, build_state, nbytes_of, state_tensors
from common import fsync_path, library_version, med, write_results

from resilient_callbacks import Checkpointer

METHODS = [
    ("ours", "ours"),
    ("ours, 1 verify thread", "ours_1thread"),
    ("torch.load(mmap)+load_state_dict", "torch_mmap"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--mb", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="rc-bench-restore-", dir=args.dir)
    t_start = time.perf_counter()
    try:
        model, opt = build_state(args.mb)
        nb = nbytes_of(state_tensors(model, opt))
        with Checkpointer(os.path.join(work, "ours"), preemption=False, async_save=False) as ck:
            ck.save(1, {"model": model, "optimizer": opt})
        p = os.path.join(work, "torch.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, p)
        fsync_path(p)
        del model, opt
        gc.collect()
        print(f"bench_restore: {nb / 1e9:.2f} GB, {args.reps} reps, {os.cpu_count()} cpus")
        times, parts = bench_restores(work, args.mb, args.reps, methods=METHODS)
        if not args.no_cold and hasattr(os, "posix_fadvise"):
            cold, cparts = bench_restores(work, args.mb, args.reps, cold=True, methods=METHODS)
            times.update(cold)
            parts.update(cparts)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    medians = {k: med(v) for k, v in times.items()}
    base = "torch.load(mmap)+load_state_dict"
    lines = [
        f"# bench_restore ({nb / 1e9:.2f} GB, {args.reps} reps, medians; library "
        f"{library_version()}, torch {torch.__version__}, {os.cpu_count()} cpus)",
        "",
        "| method | page cache warm s | vs torch.load(mmap) | cold s | vs torch.load(mmap) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, _ in METHODS:
        row = f"| {label} | {medians[label]:.3f} | {medians[label] / medians[base]:.2f}x |"
        c = label + " [cold]"
        if c in medians:
            row += f" {medians[c]:.3f} | {medians[c] / medians[base + ' [cold]']:.2f}x |"
        else:
            row += " | |"
        lines.append(row)
    ratio = medians["ours"] / medians[base]
    lines += [
        "",
        f"Goal: warm restore <= 1.2x torch.load(mmap): {ratio:.2f}x, "
        + ("met" if ratio <= 1.2 else "MISSED"),
    ]
    md = "\n".join(lines) + "\n"
    report = {
        "mb": args.mb,
        "state_bytes": nb,
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "library": library_version(),
        "torch": torch.__version__,
        "seconds": times,
        "median_s": medians,
        "parts_median_s": parts,
        "runtime_s": time.perf_counter() - t_start,
    }
    write_results(args.out, "bench_restore", report, md)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
