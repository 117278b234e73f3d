"""Background persist in a thread or in a process: which slows training less?

    .venv/bin/python benchmarks/thread_vs_process.py [--mb 256] [--steps 60] [--out benchmarks/results]

A training-like loop (a matmul-heavy step on one intra-op thread, plus Python overhead) runs
while the same persist work that ``Checkpointer`` does in the background (write the state as
safetensors with the xxh3 checksum, fsync) runs over and over:

- ``none``: no background work (the reference step time);
- ``thread``: in a thread of the training process (how ``Checkpointer`` does it);
- ``process``: in a separate process reading the same tensors from shared memory.

It reports the median step time of the loop (inflation vs ``none``) and the persist
throughput in each case. Writes ``thread_vs_process.json`` / ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import torch
from common import write_results

from resilient_callbacks.tensorfile import write_tensors


def make_state(mb: int) -> dict[str, torch.Tensor]:
    n = mb * 1_000_000 // 4 // 16
    return {f"t{i}": torch.randn(n) for i in range(16)}


def persist_loop(tensors: dict[str, torch.Tensor], path: str, stop: Any, out: Any) -> None:
    done, t0 = 0, time.perf_counter()
    while not stop.is_set():
        write_tensors(path, tensors)
        done += sum(t.numel() * t.element_size() for t in tensors.values())
    out.put((done, time.perf_counter() - t0))


def train(steps: int) -> list[float]:
    torch.set_num_threads(1)
    a = torch.randn(384, 384)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = a
        for _ in range(20):
            x = torch.tanh(x @ a) * 0.5
        sum(float(i) for i in range(20_000))  # Python-level work: sensitive to the GIL
        times.append(time.perf_counter() - t0)
    return times


def run(mode: str, tensors: dict[str, torch.Tensor], work: str, steps: int) -> dict[str, float]:
    path = os.path.join(work, f"{mode}.safetensors")
    ctx = mp.get_context("fork")
    stop: Any
    q: Any
    if mode == "thread":
        import queue

        stop, q = threading.Event(), queue.Queue()
        worker: Any = threading.Thread(target=persist_loop, args=(tensors, path, stop, q))
    elif mode == "process":
        stop, q = ctx.Event(), ctx.Queue()
        worker = ctx.Process(target=persist_loop, args=(tensors, path, stop, q))
    else:
        worker = None
    if worker is not None:
        worker.start()
        time.sleep(0.2)
    times = train(steps)
    res = {"median_step_s": statistics.median(times)}
    if worker is not None:
        stop.set()
        done, elapsed = q.get(timeout=120)
        worker.join()
        res["persist_GBps"] = done / elapsed / 1e9
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    tensors = make_state(args.mb)
    for t in tensors.values():
        t.share_memory_()
    results: dict[str, list[dict[str, float]]] = {"none": [], "thread": [], "process": []}
    with tempfile.TemporaryDirectory(prefix="rc-tvp-") as work:
        for _ in range(args.reps):
            for mode in results:  # interleaved, so drift hits every mode alike
                results[mode].append(run(mode, tensors, work, args.steps))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    base = med["none"]["median_step_s"]
    lines = [
        f"{args.mb} MB written over and over in the background, {os.cpu_count()} CPUs, "
        f"medians of {args.reps} runs of {args.steps} steps",
        "",
        "| background persist | median step s | step time vs none | persist GB/s |",
        "|---|---|---|---|",
    ]
    for m, r in med.items():
        gbps = f"{r['persist_GBps']:.2f}" if "persist_GBps" in r else "-"
        lines.append(
            f"| {m} | {r['median_step_s']:.4f} | {r['median_step_s'] / base:.2f}x | {gbps} |"
        )
    md = "\n".join(lines) + "\n"
    report = {"median": med, "runs": results, "cpus": os.cpu_count()}
    write_results(args.out, "thread_vs_process", report, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
