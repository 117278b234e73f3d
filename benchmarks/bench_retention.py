"""Does a background save wait for retention to delete an older checkpoint's files?

    .venv/bin/python benchmarks/bench_retention.py [--mb 600] [--saves 7] [--pairs 3]

A ``Checkpointer(keep_last=1)`` in the default background mode saves ``--mb`` MB of fp32
tensors ``--saves`` times, 0.5 s apart: faster than this disk persists them, so each ``save()``
first waits for the previous save's slot. Every persist commits and then applies retention,
which removes the checkpoint before. Two ways to remove it, alternating in ``--pairs`` pairs
(each run in a fresh process):

- ``inline``: the persist deletes the files itself (how it was before trash.py);
- ``trash bin``: the persist renames the checkpoint out of sight and rank 0's TrashBin thread
  deletes the files.

Per run, the median time of ``save()`` (its slot wait and its copy) over saves 3 to N. Writes
``bench_retention.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import library_version, med, write_results


def worker(mode: str, root: str, mb: int, saves: int) -> None:
    import torch

    import resilient_callbacks.directory as directory
    from resilient_callbacks import Checkpointer

    if mode == "inline":
        keep = directory.apply_retention

        def inline(*args, **kwargs):  # type: ignore[no-untyped-def]
            kwargs["discard"] = None
            return keep(*args[:5], **kwargs)

        directory.apply_retention = inline  # type: ignore[assignment]
    n = mb * 250_000 // 6
    state = {"w": [torch.randn(n) for _ in range(6)]}
    times = []
    with Checkpointer(root, keep_last=1, preemption=False, capture_rng=False) as ck:
        for step in range(1, saves + 1):
            t0 = time.perf_counter()
            ck.save(step, state)
            times.append(time.perf_counter() - t0)
            time.sleep(0.5)
    print(json.dumps({"mode": mode, "save_s": times}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=600)
    ap.add_argument("--saves", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, os.path.join(args.dir, "ck"), args.mb, args.saves)
        return 0
    runs: dict[str, list[float]] = {"inline": [], "trash bin": []}
    for i in range(args.pairs):
        order = ["inline", "bin"] if i % 2 == 0 else ["bin", "inline"]
        for mode in order:
            work = tempfile.mkdtemp(prefix="rc-bench-retention-", dir=args.dir)
            try:
                out = subprocess.run(
                    [
                        *(sys.executable, __file__, "--worker", mode, "--dir", work),
                        *("--mb", str(args.mb), "--saves", str(args.saves)),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
            finally:
                shutil.rmtree(work, ignore_errors=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            label = "inline" if mode == "inline" else "trash bin"
            runs[label].append(statistics.median(r["save_s"][2:]))
            print(f"pair {i + 1}: {label:9} save() median {runs[label][-1]:.3f} s", flush=True)
    lines = [
        f"# bench_retention ({args.mb} MB, keep_last=1, {args.saves} saves 0.5 s apart, "
        f"{args.pairs} pairs; library {library_version()}, {os.cpu_count()} cpus)",
        "",
        "| retention deletes | save() per run (median of saves 3-N), s | median of runs, s |",
        "|---|---|---:|",
    ]
    for label, v in runs.items():
        lines.append(f"| {label} | {', '.join(f'{x:.2f}' for x in v)} | {med(v):.3f} |")
    md = "\n".join(lines) + "\n"
    write_results(args.out, "bench_retention", {"mb": args.mb, "runs": runs}, md)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
