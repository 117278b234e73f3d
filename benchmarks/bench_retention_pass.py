"""What does the retention pass after every commit cost, as the directory holds more
checkpoints?

    .venv/bin/python benchmarks/bench_retention_pass.py [--sizes 10,100,500] [--reps 20]

With ``keep_last`` set, each commit is followed by a retention pass (the coordinator's;
node-local, each node's leader once the commit is broadcast) that decides which checkpoints to
delete. A run that keeps many checkpoints (archive points over a long run) gives it more to
look at. Two runs in this process, each saving every step synchronously (a state of two small
tensors: 5 files a checkpoint):

- ``baseline``: ``keep_last=None`` (no retention pass: every checkpoint stays);
- ``retention``: ``keep_last=3, keep_every_n_steps=1`` (every checkpoint stays too, as an
  archive point, and every commit runs the pass).

At each size N of ``--sizes``: the median ``save()`` of the last ``--window`` saves up to N
(the whole commit), and, in the ``retention`` run, the pass alone
(``Directory.apply_retention`` protecting the newest checkpoint, as the commit calls it) timed
``--reps`` times. Writes ``bench_retention_pass.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from common import per_size_main


def run(root: str, sizes: list[int], window: int, reps: int, retention: bool) -> dict[str, Any]:
    import torch

    from resilient_callbacks import Checkpointer

    opts: dict[str, Any] = {"keep_last": None, "async_save": False, "preemption": False}
    opts |= {"capture_rng": False}
    if retention:
        opts |= {"keep_last": 3, "keep_every_n_steps": 1}
    state = {"a": torch.zeros(4), "b": torch.zeros(8)}
    saves: list[float] = []
    out: dict[str, Any] = {"save_ms": {}, "pass_ms": {}}
    with Checkpointer(os.path.join(root, "ck"), **opts) as ck:
        for step in range(1, max(sizes) + 1):
            t0 = time.perf_counter()
            ck.save(step, state)
            saves.append(time.perf_counter() - t0)
            if step not in sizes:
                continue
            out["save_ms"][step] = 1e3 * statistics.median(saves[-window:])
            if retention:
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    ck._dir.apply_retention(protect=f"step_{step:09d}")
                    times.append(time.perf_counter() - t0)
                out["pass_ms"][step] = 1e3 * statistics.median(times)
            extra = f", pass {out['pass_ms'][step]:.2f} ms" if retention else ""
            label = "retention" if retention else "baseline"
            print(f"{label:9} N={step:4d}: save {out['save_ms'][step]:.2f} ms{extra}", flush=True)
        kept = len(ck.checkpoints())
    assert kept == max(sizes), f"{kept} checkpoints kept, not {max(sizes)}"
    return out


def main() -> int:
    return per_size_main(
        __doc__,
        "bench_retention_pass",
        run,
        ("baseline", "retention"),
        "pass",
        "passes timed at each N",
    )


if __name__ == "__main__":
    raise SystemExit(main())
