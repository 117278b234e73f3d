"""The fixed cost per save and per restore of a state of many small tensors, for one or more
library trees side by side in one run: did a change slow the save path or the restore down?

    .venv/bin/python benchmarks/bench_fixed_cost.py [SRC ...] [--count 5000] [--rounds 4]
        [--saves 6] [--numel 64] [--out DIR]

    # against an older commit: a worktree of it, its src/ beside this one's
    git worktree add /tmp/old <commit>
    .venv/bin/python benchmarks/bench_fixed_cost.py /tmp/old/src src

The state: a module of ``--count`` fp32 parameters of ``--numel`` elements each and its AdamW
state after one step (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter: 4 x ``count``
tensors, a few MB), where what a save or a restore costs is Python work per tensor and per
save, not bytes. Each SRC tree (default: this repository's ``src``) runs in a fresh process per
round (``PYTHONPATH=SRC``), the trees' order reversed every other round, so the load of a shared
machine hits them alike. Per round and tree: ``--saves`` background saves (``keep_last=1``)
and as many synchronous ones, the first of each discarded (buffers, files); then 3 restores
(``Checkpointer(...).restore(state)``, every checksum verified) of the last synchronous one.
Medians per round, then the median over rounds:

- ``async blocking``: until ``save`` returns (what the training loop waits for);
  ``async durable``: until ``flush()`` returns; ``sync``: a synchronous save, all of it;
- ``restore``: the constructor and the restore;
- ``... cpu``: the CPU time of the training thread alone in the same span
  (``time.thread_time``): on a loaded machine it varies far less than the wall clock, and it
  is what the Python work costs (the background writer's and the hashing threads' time is not
  in it);
- the baselines, in the same process, each beside one of ours with the order alternating:
  ``torch.save``: ``torch.save`` of the model's and the optimizer's state dicts + fsync, beside
  each synchronous save; ``torch.load``: ``torch.load(weights_only=True)`` of that file +
  both ``load_state_dict``, beside each restore.

The first table's ratios are against the first SRC; the second gives each tree's sync and
restore against its baselines (per round, then the median over rounds). Writes ``bench_fixed_cost.{json,md}`` into ``--out``.
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
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = (
    "async blocking",
    "async blocking cpu",
    "async durable",
    "sync",
    "sync cpu",
    "restore",
    "restore cpu",
    "torch.save",
    "torch.save cpu",
    "torch.load",
    "torch.load cpu",
)
# (ours, its baseline measured beside it in the same worker)
RATIOS = (
    ("sync", "torch.save"),
    ("sync cpu", "torch.save cpu"),
    ("restore", "torch.load"),
    ("restore cpu", "torch.load cpu"),
)


def worker(count: int, numel: int, saves: int, where: str | None) -> dict[str, float]:
    """One round of one tree, in this process (the tree is on ``sys.path``)."""
    import gc
    import inspect
    import warnings

    import torch

    from resilient_callbacks import Checkpointer

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Module()
    for i in range(count):
        model.register_parameter(f"p{i:06d}", torch.nn.Parameter(torch.randn(numel)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = {"model": model, "optimizer": opt}
    out: dict[str, float] = {}
    work = tempfile.mkdtemp(prefix="rc-fixed-", dir=where)
    pt = os.path.join(work, "torch.pt")
    baseline: dict[str, list[float]] = {k: [] for k in KEYS if k.startswith("torch.")}

    def timed(fn: Any, key: str) -> None:
        gc.collect()
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        baseline[key].append(time.perf_counter() - t0)
        baseline[key + " cpu"].append(time.thread_time() - c0)

    def torch_save() -> None:  # the baseline of a synchronous save: torch.save + fsync
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
        fd = os.open(pt, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_load() -> None:  # the baseline of a restore: torch.load + load_state_dict
        sd = torch.load(pt, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])

    try:
        for mode in ("async", "sync"):
            blocking, durable, cpu = [], [], []
            ck = Checkpointer(
                os.path.join(work, mode), keep_last=1, preemption=False, async_save=mode == "async"
            )
            for step in range(1, saves + 1):
                if mode == "sync" and step % 2 == 0:  # torch.save beside it, order alternating
                    timed(torch_save, "torch.save")
                gc.collect()
                c0, t0 = time.thread_time(), time.perf_counter()
                ck.save(step, state)
                t1, c1 = time.perf_counter(), time.thread_time()
                ck.flush()
                t2 = time.perf_counter()
                if step > 1:
                    blocking.append(t1 - t0)
                    durable.append(t2 - t0)
                    cpu.append(c1 - c0)
                if mode == "sync" and step % 2 == 1:
                    timed(torch_save, "torch.save")
            ck.close()
            if mode == "async":
                out["async blocking"] = statistics.median(blocking)
                out["async blocking cpu"] = statistics.median(cpu)
                out["async durable"] = statistics.median(durable)
            else:
                out["sync"] = statistics.median(durable)
                out["sync cpu"] = statistics.median(cpu)
        # (an older tree may lack read_only)
        ro = (
            {"read_only": True} if "read_only" in inspect.signature(Checkpointer).parameters else {}
        )
        wall, cpu = [], []
        for i in range(3):
            if i % 2:  # torch.load beside it, order alternating
                timed(torch_load, "torch.load")
            gc.collect()
            c0, t0 = time.thread_time(), time.perf_counter()
            r = Checkpointer(os.path.join(work, "sync"), preemption=False, **ro)
            r.restore(state)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            r.close()
            if i % 2 == 0:
                timed(torch_load, "torch.load")
        out["restore"] = statistics.median(wall)
        out["restore cpu"] = statistics.median(cpu)
        out.update({k: statistics.median(v) for k, v in baseline.items()})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("srcs", nargs="*", help="library src/ trees (default: this repository's)")
    ap.add_argument("--count", type=int, default=5000, help="parameters (4 tensors each)")
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        res = worker(args.count, args.numel, args.saves, args.dir)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    srcs = [os.path.abspath(s) for s in args.srcs] or [os.path.join(os.path.dirname(HERE), "src")]
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in srcs}
    for rnd in range(args.rounds):
        for src in srcs if rnd % 2 == 0 else srcs[::-1]:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
            cmd += ["--count", str(args.count), "--numel", str(args.numel)]
            cmd += ["--saves", str(args.saves)] + (["--dir", args.dir] if args.dir else [])
            env = {**os.environ, "PYTHONPATH": src}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs[src].append(json.loads(lines[-1][len("RESULT ") :]))
            shown = ", ".join(f"{k} {v:.3f}" for k, v in runs[src][-1].items())
            print(f"round {rnd} {src}: {shown}", flush=True)
    medians = {s: {k: statistics.median(r[k] for r in runs[s]) for k in KEYS} for s in srcs}
    base = medians[srcs[0]]
    lines = [
        f"# bench_fixed_cost ({args.count} parameters of {args.numel} fp32 + AdamW state: "
        f"{4 * args.count} tensors; medians of {args.rounds} rounds, {args.saves - 1} saves "
        f"and 3 restores each; load average at the end {os.getloadavg()[0]:.1f})",
        "",
        "| tree | " + " | ".join(f"{k} s" for k in KEYS) + " |",
        "|---|" + "---:|" * len(KEYS),
    ]
    for s in srcs:
        m = medians[s]
        cells = [f"{m[k]:.3f} ({m[k] / base[k]:.2f}x)" if base[k] else f"{m[k]:.3f}" for k in KEYS]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    # each round's ratio to the baseline measured in the same process, then their median
    ratios = {
        s: {f"{a} / {b}": statistics.median(r[a] / r[b] for r in runs[s]) for a, b in RATIOS}
        for s in srcs
    }
    lines += [
        "",
        "Against `torch.save` + fsync and `torch.load` + `load_state_dict` of the same state in "
        "the same process (median of the rounds' ratios):",
        "",
        "| tree | " + " | ".join(f"{a} / {b}" for a, b in RATIOS) + " |",
        "|---|" + "---:|" * len(RATIOS),
    ]
    for s in srcs:
        lines.append(f"| {s} | " + " | ".join(f"{v:.2f}x" for v in ratios[s].values()) + " |")
    md = "\n".join(lines) + "\n"
    sys.path.insert(0, HERE)
    import torch  # noqa: F401  (imported: the results name its version)
    from common import write_results

    report = {"args": vars(args), "srcs": srcs, "medians": medians, "ratios": ratios, "runs": runs}
    write_results(args.out, "bench_fixed_cost", report, md)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
