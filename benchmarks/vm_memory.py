"""How long does writing host memory take, by how recently it was touched? (Explains the spread
of snapshot blocking times in ``bench_async.py``'s round-robin on shared VMs.)

    .venv/bin/python benchmarks/vm_memory.py [--mb 1536] [--rounds 4] [--dir DIR]

No library code runs here; it measures the machine:

1. first write of fresh buffers, then rewrites of the same buffers;
2. rounds of memory churn like the save round-robin's (allocate, fill and free a buffer of the
   same size; write the same bytes to a file, fsync, delete). After each churn round it copies
   the state into an "idle" buffer that is otherwise untouched and into a "busy" buffer that
   was also rewritten right before the churn. If the idle copy is much slower than the busy one,
   benchmarks that touch a buffer once a round see the machine's memory, not the code under
   test.

Prints a Markdown table and writes ``vm_memory.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from common import med, write_results


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--mb", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the churn files go (default: /tmp)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    n = args.mb * (1 << 20) // 4
    src = torch.ones(n)
    fresh = [torch.empty(n) for _ in range(3)]
    first = [timed_copy(b, src) for b in fresh]
    again = [timed_copy(b, src) for b in fresh for _ in range(2)]
    idle, busy = fresh[0], fresh[1]
    del fresh
    work = tempfile.mkdtemp(prefix="rc-vm-memory-", dir=args.dir)
    idle_t: list[float] = []
    busy_t: list[float] = []
    try:
        for _ in range(args.rounds):
            timed_copy(busy, src)
            tmp = torch.empty(n)  # churn: fresh memory, filled and freed
            tmp.fill_(2.0)
            del tmp
            p = os.path.join(work, "churn.bin")
            mv = memoryview(src.view(torch.uint8).numpy())
            with open(p, "wb", buffering=0) as f:
                for i in range(0, len(mv), 16 << 20):
                    f.write(mv[i : i + (16 << 20)])
                os.fsync(f.fileno())
            os.remove(p)
            busy_t.append(timed_copy(busy, src))
            idle_t.append(timed_copy(idle, src))
    finally:
        os.rmdir(work)
    report = {
        "mb": args.mb,
        "first_write_s": first,
        "rewrite_s": again,
        "after_churn_busy_buffer_s": busy_t,
        "after_churn_idle_buffer_s": idle_t,
    }

    def fmt(xs: list[float]) -> str:
        return f"{med(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    md = "\n".join(
        [
            f"| copy of {args.mb} MB into | median s (min-max) |",
            "|---|---|",
            f"| a fresh buffer (first write) | {fmt(first)} |",
            f"| the same buffers again | {fmt(again)} |",
            f"| a buffer also rewritten before each churn round | {fmt(busy_t)} |",
            f"| a buffer untouched since (idle through the churn) | {fmt(idle_t)} |",
        ]
    )
    write_results(args.out, "vm_memory", report, md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
