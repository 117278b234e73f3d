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

    .venv/bin/python benchmarks/bench_restore.py --big 200x4,1x1024 [--reps 7] [--threads 1]

``--big COUNTxMB,...`` measures instead a state of a few big tensors (a module of COUNT float32
parameters of MB each, no optimizer), where a restore's work is bytes, not objects: ours,
``torch.load(mmap=True)`` and ``torch.load`` (each + ``load_state_dict``) in fresh processes,
round-robin as above, page cache warm; every restore is checked bitwise (an xxh3 of each
parameter against the saved values'). Per method it gives wall and CPU seconds and the bytes
copied per restored byte: bytes written by ``copy_``/``clone``/``_to_copy`` (counted in one more
restore under a ``TorchDispatchMode``, which sees the calling thread's ops only) plus bytes ``read()`` from files (``/proc/self/io``
``rchar``); one copy into the live tensors is 1.0, a read buffer copied again 2.0.
``--threads N``: ``torch.set_num_threads(N)`` in the workers (on a loaded 2-core machine the
two intra-op threads of ``copy_`` wait on each other). Writes ``bench_restore_big.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import xxhash
from bench_async import bench_restores, build_state, nbytes_of, state_tensors
from common import fsync_path, library_version, med, write_results
from torch.utils._python_dispatch import TorchDispatchMode

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
    ap.add_argument("--big", default=None, help="states of big tensors: COUNTxMB,... (above)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in --big's workers")
    ap.add_argument("--big-worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.big_worker:
        method, work, count, mb, threads, copies = args.big_worker
        big_worker(method, work, int(count), int(mb), int(threads), copies == "1")
        return 0
    if args.big:
        return run_big(args)

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


# --------------------------------------------------------------------------- --big

BIG_METHODS = [
    ("ours", "ours"),
    ("torch.load(mmap)+load_state_dict", "torch_mmap"),
    ("torch.load+load_state_dict", "torch_load"),
]


def big_module(count: int, mb: int) -> torch.nn.Module:
    """A module of ``count`` float32 parameters of ``mb`` MB each, zeros."""
    m = torch.nn.Module()
    for i in range(count):
        m.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(mb << 18)))
    return m


def digests(m: torch.nn.Module) -> dict[str, str]:
    """An xxh3 of each tensor's bytes: a restore is bitwise equal when these are."""
    return {
        k: xxhash.xxh3_64_hexdigest(v.detach().contiguous().view(torch.uint8).numpy())
        for k, v in m.state_dict().items()
    }


def save_big(work: str, count: int, mb: int) -> int:
    """Saves the state by ours and by ``torch.save``, and its digests; returns its bytes."""
    torch.manual_seed(0)
    m = big_module(count, mb)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    with Checkpointer(os.path.join(work, "ours"), preemption=False, async_save=False) as ck:
        ck.save(1, {"model": m})
    path = os.path.join(work, "torch.pt")
    torch.save({"model": m.state_dict()}, path)
    fsync_path(path)
    with open(os.path.join(work, "digests.json"), "w") as f:
        json.dump(digests(m), f)
    return count * (mb << 20)


class CopyCounter(TorchDispatchMode):
    """The bytes written by the aten ops that copy tensor data, as they are dispatched (an op a
    kernel calls inside another, a clone's own copy, is not seen twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name == "copy_":
            self.bytes += args[0].nbytes
        elif name in ("clone", "_to_copy"):
            self.bytes += out.nbytes
        return out


def _rchar() -> int:
    """Bytes this process has read with read() and its kin so far (not through mappings)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def big_worker(method: str, work: str, count: int, mb: int, threads: int, copies: bool) -> None:
    """One restore in this fresh process, timed, then checked bitwise; with ``copies``, its
    copied bytes counted (a restore not to be timed: the dispatch mode costs per op)."""
    if threads:
        torch.set_num_threads(threads)
    model = big_module(count, mb)
    gc.collect()
    counter = CopyCounter() if copies else None
    r0, c0, t0 = _rchar(), time.process_time(), time.perf_counter()
    with counter if counter is not None else contextlib.nullcontext():
        if method == "ours":  # (opening and closing the Checkpointer included)
            with Checkpointer(os.path.join(work, "ours"), preemption=False) as ck:
                if ck.restore({"model": model}) != 1:
                    raise SystemExit("ours: nothing restored")
        else:
            mmap = method == "torch_mmap"
            sd = torch.load(os.path.join(work, "torch.pt"), mmap=mmap, weights_only=True)
            model.load_state_dict(sd["model"])
            del sd
    t1, c1, r1 = time.perf_counter(), time.process_time(), _rchar()
    with open(os.path.join(work, "digests.json")) as f:
        if digests(model) != json.load(f):
            raise SystemExit(f"{method}: the restored values differ from the saved ones")
    out = {"seconds": t1 - t0, "cpu": c1 - c0, "read_bytes": r1 - r0}
    if counter is not None:
        out["copied_bytes"] = counter.bytes
    print(json.dumps(out))


def _big_run(work: str, method: str, count: int, mb: int, threads: int, copies: bool) -> Any:
    args = [sys.executable, __file__, "--big-worker", method, work, str(count), str(mb)]
    args += [str(threads), "1" if copies else "0"]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"big restore worker {method} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_big(args: Any) -> int:
    """``--big``: each state saved once, then restored by every method (module docstring)."""
    specs = [tuple(int(x) for x in spec.split("x")) for spec in args.big.split(",")]
    threads = args.threads or torch.get_num_threads()
    states: list[dict[str, Any]] = []
    lines = [
        f"# bench_restore --big ({args.reps} reps, medians, page cache warm; torch threads "
        f"{threads}; library {library_version()}, torch {torch.__version__}, "
        f"{os.cpu_count()} cpus)",
        "",
        "| state | method | wall s | vs mmap | vs torch.load | CPU s | CPU vs mmap "
        "| CPU vs torch.load | bytes copied / restored byte (copy ops + read) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for count, mb in specs:
        work = tempfile.mkdtemp(prefix="rc-bench-restore-big-", dir=args.dir)
        try:
            nb = save_big(work, count, mb)
            gc.collect()
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in BIG_METHODS}
            for i in range(args.reps + 1):  # the first round is discarded (a warm-up)
                k = i % len(BIG_METHODS)
                for label, method in BIG_METHODS[k:] + BIG_METHODS[:k]:
                    r = _big_run(work, method, count, mb, args.threads, False)
                    if i:
                        runs[label].append(r)
            counted = {
                label: _big_run(work, method, count, mb, args.threads, True)
                for label, method in BIG_METHODS
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)
        wall = {k: med([r["seconds"] for r in v]) for k, v in runs.items()}
        cpu = {k: med([r["cpu"] for r in v]) for k, v in runs.items()}
        copied = {
            k: (c["copied_bytes"] + med([r["read_bytes"] for r in runs[k]])) / nb
            for k, c in counted.items()
        }
        name = f"{count} x {mb} MB"
        mm, tl = BIG_METHODS[1][0], BIG_METHODS[2][0]
        for label, _ in BIG_METHODS:
            lines.append(
                f"| {name} | {label} | {wall[label]:.3f} | {wall[label] / wall[mm]:.2f}x "
                f"| {wall[label] / wall[tl]:.2f}x | {cpu[label]:.3f} | {cpu[label] / cpu[mm]:.2f}x "
                f"| {cpu[label] / cpu[tl]:.2f}x | {copied[label]:.2f} |"
            )
        states.append(
            {
                "count": count,
                "mb": mb,
                "state_bytes": nb,
                "runs": runs,
                "counted": counted,
                "median_s": wall,
                "median_cpu_s": cpu,
                "copied_per_byte": copied,
            }
        )
        print("\n".join(lines[-len(BIG_METHODS) :]), flush=True)
    md = "\n".join(lines) + "\n"
    report = {"reps": args.reps, "threads": threads, "cpus": os.cpu_count(), "states": states}
    write_results(args.out, "bench_restore_big", report, md)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
