"""What does deciding "is this save one of the run's best" cost at every commit, as the directory
holds more checkpoints?

    .venv/bin/python benchmarks/bench_best_decision.py [--sizes 10,100,500] [--reps 20]

With ``remote_every_n_saves`` > 1, each commit asks whether the save ranks among the best the
remote retention keeps (``keep_best``: :mod:`resilient_callbacks.remote_best`); node-local,
rank 0 decides while every other rank waits for its broadcast. A run that keeps many
checkpoints (archive points over a long run) gives it more to rank. Two runs in this process,
each saving every step synchronously (a state of two small tensors: 5 files a checkpoint) with
``keep_last=None`` (every checkpoint stays) and a remote tier (a local folder) that takes every
``10**6``-th save:

- ``baseline``: no ``keep_best`` (the decision asks nothing of the directory);
- ``keep_best``: ``keep_best=1, monitor='loss'`` (every save after the first ranks below it).

At each size N of ``--sizes``: the median ``save()`` of the last ``--window`` saves up to N
(the whole commit), and, in the ``keep_best`` run, the decision alone (``Directory.is_best`` of
the newest checkpoint, as the commit calls it) timed ``--reps`` times. Writes
``bench_best_decision.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from common import per_size_main


def run(root: str, sizes: list[int], window: int, reps: int, best: bool) -> dict[str, Any]:
    import torch

    from resilient_callbacks import Checkpointer

    opts: dict[str, Any] = {"keep_last": None, "async_save": False, "preemption": False}
    opts |= {"capture_rng": False, "remote": f"file://{root}/remote"}
    opts |= {"remote_every_n_saves": 10**6}
    if best:
        opts |= {"keep_best": 1, "monitor": "loss"}
    state = {"a": torch.zeros(4), "b": torch.zeros(8)}
    saves: list[float] = []
    out: dict[str, Any] = {"save_ms": {}, "decision_ms": {}}
    with Checkpointer(os.path.join(root, "ck"), **opts) as ck:
        for step in range(1, max(sizes) + 1):
            t0 = time.perf_counter()
            ck.save(step, state, metrics={"loss": float(step)})
            saves.append(time.perf_counter() - t0)
            if step not in sizes:
                continue
            out["save_ms"][step] = 1e3 * statistics.median(saves[-window:])
            if best:
                d = ck._dir
                assert d.sync is not None
                name, policy = f"step_{step:09d}", d.sync.policy
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    d.is_best(name, policy)
                    times.append(time.perf_counter() - t0)
                out["decision_ms"][step] = 1e3 * statistics.median(times)
            extra = f", decision {out['decision_ms'][step]:.2f} ms" if best else ""
            label = "keep_best" if best else "baseline"
            print(f"{label:9} N={step:4d}: save {out['save_ms'][step]:.2f} ms{extra}", flush=True)
    return out


def main() -> int:
    return per_size_main(
        __doc__,
        "bench_best_decision",
        run,
        ("baseline", "keep_best"),
        "decision",
        "decisions timed at each N",
    )


if __name__ == "__main__":
    raise SystemExit(main())
