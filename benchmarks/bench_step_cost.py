"""What a ``Checkpointer.step()`` that does not save costs the training loop, per step, for one
or more library trees side by side in one run: did a change make the steps between saves dearer?

    .venv/bin/python benchmarks/bench_step_cost.py [SRC ...] [--count 2000] [--rounds 4]
        [--steps 60] [--out DIR]

    # against an older commit: a worktree of it, its src/ beside this one's
    git worktree add /tmp/old <commit>
    .venv/bin/python benchmarks/bench_step_cost.py /tmp/old/src src

The state: a module of ``--count`` parameter tensors (``count / 2`` ``Linear(8, 8)``) and its
SGD optimizer; one intra-op thread (``torch.set_num_threads(1)``: the figures are Python work
per tensor, which threads do not share). Each SRC tree runs in a fresh process per round
(``PYTHONPATH=SRC``), the trees' order reversed every other round. Per round and tree, for each
setting (the default ``Checkpointer`` and ``save_on_exception=True``, both with
``every_n_steps`` past the run's end, so no step saves): ``--steps`` training steps (forward,
backward, ``optimizer.step()``) each followed by ``ck.step(i, state)``; the first 10 are
discarded (hooks, first calls). Medians per round, then over rounds, of the time
``ck.step()`` took (``step ms``, and its CPU time ``step cpu ms``) and of the training step
before it (``train ms``, the baseline measured in the same loop): ``step / train`` is what the
library adds to each step between saves. ``micro_batch``: the default ``Checkpointer`` with
``step()`` called per micro-batch of gradient accumulation windows of 4 (``optimizer.step()``
and ``zero_grad()`` after every 4th backward pass), only the 3 micro-batch calls of each
window timed (``train ms``: their forward and backward); ``step mean ms`` is the mean where the
calls of a window differ. Writes ``bench_step_cost.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = ("default", "save_on_exception", "micro_batch")
KEYS = ("step ms", "step mean ms", "step cpu ms", "train ms")

WORKER = r"""
import json, statistics, sys, tempfile, time
import torch
from resilient_callbacks import Checkpointer

count, steps, setting = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(max(1, count // 2))])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 8)
kw = {"save_on_exception": True} if setting == "save_on_exception" else {}
window = 4 if setting == "micro_batch" else 1
step_s, step_cpu_s, train_s = [], [], []
with tempfile.TemporaryDirectory() as d:
    with Checkpointer(d, every_n_steps=10**9, **kw) as ck:
        state = {"model": model, "opt": opt}
        ck.restore(state)
        for i in range(steps):
            t0 = time.perf_counter()
            update = (i + 1) % window == 0
            if window == 1:
                opt.zero_grad()
            model(x).sum().backward()
            if update:
                opt.step()
                if window > 1:
                    opt.zero_grad()
            t1, c1 = time.perf_counter(), time.thread_time()
            ck.step(i + 1, state)
            t2, c2 = time.perf_counter(), time.thread_time()
            if i >= 10 and (window == 1 or not update):
                train_s.append(t1 - t0)
                step_s.append(t2 - t1)
                step_cpu_s.append(c2 - c1)
med = statistics.median
print(json.dumps({"step ms": med(step_s) * 1e3, "step mean ms": statistics.mean(step_s) * 1e3,
                  "step cpu ms": med(step_cpu_s) * 1e3, "train ms": med(train_s) * 1e3}))
"""


def run_one(src: str, count: int, steps: int, setting: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(count), str(steps), setting],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker failed for {src} ({setting}):\n{proc.stderr[-3000:]}")
    out: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    sys.path.insert(0, HERE)
    import torch  # noqa: F401  (the results' stamp names the version the workers ran)
    from common import write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("srcs", nargs="*", default=[os.path.join(os.path.dirname(HERE), "src")])
    p.add_argument("--count", type=int, default=2000, help="parameter tensors in the model")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="training steps per run (10 discarded)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    if args.steps <= 10:
        p.error("--steps must be more than 10 (the first 10 are discarded)")
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        s: {k: [] for k in SETTINGS} for s in args.srcs
    }
    for r in range(args.rounds):
        order = args.srcs if r % 2 == 0 else list(reversed(args.srcs))
        for src in order:
            for setting in SETTINGS:
                res = run_one(src, args.count, args.steps, setting)
                runs[src][setting].append(res)
                print(f"round {r} {src} {setting}: {res}", flush=True)
    medians = {
        src: {
            setting: {k: statistics.median(x[k] for x in runs[src][setting]) for k in KEYS}
            for setting in SETTINGS
        }
        for src in args.srcs
    }
    lines = [
        f"`ck.step()` that does not save, {args.count} parameter tensors, one intra-op thread, "
        f"medians of {args.rounds} rounds of {args.steps - 10} steps",
        "",
        "| tree | setting | step ms | step mean ms | step cpu ms | train ms | step / train |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for src in args.srcs:
        for setting in SETTINGS:
            m = medians[src][setting]
            lines.append(
                f"| {src} | {setting} | {m['step ms']:.2f} | {m['step mean ms']:.2f} | "
                f"{m['step cpu ms']:.2f} | "
                f"{m['train ms']:.2f} | {m['step ms'] / m['train ms']:.3f} |"
            )
    report = {"args": vars(args), "runs": runs, "medians": medians}
    write_results(args.out, "bench_step_cost", report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
