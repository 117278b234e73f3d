"""Per-save and per-restore overhead of a state with MANY tensors (a real LLM has 1-10 thousand,
an MoE more), against ``torch.save``/``torch.load`` and DCP measured in the same run.

    python benchmarks/bench_many_tensors.py [--counts 200,2000,20000] [--reps 3]
        [--small-numel 256] [--large 4] [--large-mb 8] [--profile] [--archives 20] [--out DIR]

The state: a module with ``count`` small fp32 parameters of ``--small-numel`` elements each
(LayerNorm weights, biases, an MoE's many experts) and ``--large`` parameters of ``--large-mb``
MB mixed in. Per count, round-robin over the methods (``common.round_robin``), ``--reps``
times, medians:

- ``ours``: ``Checkpointer.save`` (background save, the default; ``keep_last=1``, as in steady
  state): *blocking* = until ``save`` returns, *durable* = until ``flush()`` returns (written,
  fsynced, committed, retention applied); restore = ``Checkpointer(...)`` + ``restore(state)``
  (every checksum verified) into the live module;
- ``torch``: ``torch.save(module.state_dict())`` + fsync (blocking = durable);
  ``module.load_state_dict(torch.load(weights_only=True))``;
- ``dcp``: ``torch.distributed.checkpoint.save`` (one process, no process group; fsyncs its
  files) and ``async_save`` (blocking = until it returns, durable = until its future is done);
  ``dcp.load`` into the module's state dict (in place).

Restores run in this process with the files in the page cache (a fresh process adds the same
fixed cost to every method; ``bench_restore.py`` measures that). The ratios are the figures:
absolute times on a shared machine are noise. ``--profile``: a cProfile of one synchronous save
(the whole save path in one thread) and one restore at the largest count, the top functions by
own time printed and written to ``bench_many_tensors_profile.txt``. ``--archives N``:
retention's cost as a run keeps checkpoints (:func:`bench_archives`). Writes
``bench_many_tensors.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch
from common import apply_quick, fsync_path, library_version, med, round_robin, write_results

from resilient_callbacks import Checkpointer

MODES = ("ours", "torch", "dcp")


def build(count: int, small_numel: int, large: int, large_mb: int) -> torch.nn.Module:
    """A module of ``count`` small parameters and ``large`` big ones, in interleaved order."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    every = max(1, count // max(1, large))
    big = large_mb * (1 << 20) // 4
    n_large = 0
    for i in range(count):
        m.register_parameter(f"p{i:06d}", torch.nn.Parameter(torch.randn(small_numel)))
        if n_large < large and i % every == 0:
            m.register_parameter(f"big{n_large}", torch.nn.Parameter(torch.randn(big)))
            n_large += 1
    return m


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def bench_count(work: str, model: torch.nn.Module, reps: int) -> dict[str, list[dict[str, Any]]]:
    import torch.distributed.checkpoint as dcp

    state = {"model": model}
    ours_dir = os.path.join(work, "ours")
    ck = Checkpointer(ours_dir, keep_last=1, preemption=False)
    pt = os.path.join(work, "torch.pt")
    steps = iter(range(1, 1_000_000))

    def run(mode: str, rep: int) -> dict[str, Any]:
        gc.collect()
        if mode == "ours":
            t0 = time.perf_counter()
            ck.save(next(steps), state)
            t1 = time.perf_counter()
            ck.flush()
            t2 = time.perf_counter()
            r = Checkpointer(ours_dir, preemption=False, read_only=True)
            r.restore(state)
            t3 = time.perf_counter()
            r.close()
            return {"seconds": t2 - t0, "blocking": t1 - t0, "durable": t2 - t0, "restore": t3 - t2}
        if mode == "torch":
            t0 = time.perf_counter()
            torch.save(model.state_dict(), pt)
            fsync_path(pt)
            t1 = time.perf_counter()
            model.load_state_dict(torch.load(pt, weights_only=True))
            t2 = time.perf_counter()
            rm(pt)
            return {"seconds": t1 - t0, "blocking": t1 - t0, "durable": t1 - t0, "restore": t2 - t1}
        d, da = os.path.join(work, "dcp"), os.path.join(work, "dcp_async")
        t0 = time.perf_counter()
        dcp.save(model.state_dict(), checkpoint_id=d)
        t1 = time.perf_counter()
        sd = model.state_dict()
        t2 = time.perf_counter()
        dcp.load(sd, checkpoint_id=d)
        t3 = time.perf_counter()
        fut = dcp.async_save(model.state_dict(), checkpoint_id=da)
        t4 = time.perf_counter()
        fut.result()
        t5 = time.perf_counter()
        rm(d)
        rm(da)
        return {
            "seconds": t1 - t0,
            "blocking": t1 - t0,
            "durable": t1 - t0,
            "restore": t3 - t2,
            "async_blocking": t4 - t3,
            "async_durable": t5 - t3,
        }

    try:
        return round_robin(MODES, reps, run)
    finally:
        ck.close()


def profile(work: str, model: torch.nn.Module, top: int = 25) -> str:
    """cProfile of one synchronous save (after a first one, as in steady state) and of one
    restore; the top functions by own time, as text."""
    state = {"model": model}
    d = os.path.join(work, "profile")
    out = io.StringIO()
    with Checkpointer(d, keep_last=1, preemption=False, async_save=False) as ck:
        ck.save(1, state)
        pr = cProfile.Profile()
        pr.enable()
        ck.save(2, state)
        pr.disable()
    out.write("== one synchronous save (steady state) ==\n")
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    pr = cProfile.Profile()
    pr.enable()
    with Checkpointer(d, preemption=False, read_only=True) as r:
        r.restore(state)
    pr.disable()
    out.write("== one restore ==\n")
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    rm(d)
    return out.getvalue()


def bench_archives(work: str, count: int, saves: int) -> dict[str, float]:
    """Retention's cost as a run keeps checkpoints: ``incremental=True``, ``keep_last=1``,
    ``keep_every_n_steps=1`` (every save an archive, each naming ``count`` blobs of 16 KiB),
    synchronous saves; the CPU time of a save at the start and at the end."""
    state = {f"p{i}": torch.randn(4096) for i in range(count)}
    cpu: list[float] = []
    opts: dict[str, Any] = {"keep_last": 1, "keep_every_n_steps": 1, "incremental": True}
    with Checkpointer(os.path.join(work, "arch"), async_save=False, preemption=False, **opts) as ck:
        for step in range(1, saves + 1):
            state["p0"].add_(1)  # one tensor changes: one new blob a save
            t0 = time.process_time()
            ck.save(step, state)
            cpu.append(time.process_time() - t0)
    return {"first_cpu_s": med(cpu[1:4]), "last_cpu_s": med(cpu[-3:]), "saves": saves}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="200,2000,20000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small-numel", type=int, default=256)
    ap.add_argument("--large", type=int, default=4)
    ap.add_argument("--large-mb", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--archives",
        type=int,
        default=0,
        help="also N incremental saves all kept as archives (2,000 tensors): CPU per save "
        "at saves 2-4 and the last 3 (retention's cost as checkpoints accumulate)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one rep (the smoke test)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        apply_quick(ap, args, counts="50,200", reps=1, large=1, large_mb=1)
    warnings.filterwarnings("ignore", message=".*(process group|ProcessGroup|dist).*")
    counts = [int(x) for x in args.counts.split(",")]
    rows: list[dict[str, Any]] = []
    prof = ""
    t_start = time.perf_counter()
    for count in counts:
        work = tempfile.mkdtemp(prefix="rc-many-", dir=args.dir)
        try:
            model = build(count, args.small_numel, args.large, args.large_mb)
            nbytes = sum(p.numel() * 4 for p in model.parameters())
            n = len(model.state_dict())
            print(f"== {n} tensors, {nbytes / 1e6:.1f} MB", flush=True)
            runs = bench_count(work, model, args.reps)
            if args.profile and count == counts[-1]:
                prof = profile(work, model)
        finally:
            rm(work)
        m = {
            f"{mode} {k}": med([r[k] for r in runs[mode]])
            for mode in MODES
            for k in runs[mode][0]
            if k != "seconds"
        }
        rows.append({"tensors": n, "bytes": nbytes, "median_s": m, "runs": runs})
    archives = None
    if args.archives:
        work = tempfile.mkdtemp(prefix="rc-many-", dir=args.dir)
        try:
            archives = bench_archives(work, 2000, args.archives)
        finally:
            rm(work)
    lines = [
        f"# bench_many_tensors (medians of {args.reps}; library {library_version()}, torch "
        f"{torch.__version__}, {os.cpu_count()} cpus; small tensors of {args.small_numel} fp32 "
        f"+ {args.large} of {args.large_mb} MB)",
        "",
        "| tensors | MB | ours blocking s | ours durable s | torch.save s | DCP save s | "
        "DCP async blocking s | ours restore s | torch.load s | dcp.load s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["median_s"]
        lines.append(
            f"| {r['tensors']} | {r['bytes'] / 1e6:.1f} | {m['ours blocking']:.3f} | "
            f"{m['ours durable']:.3f} | {m['torch durable']:.3f} | {m['dcp durable']:.3f} | "
            f"{m['dcp async_blocking']:.3f} | {m['ours restore']:.3f} | "
            f"{m['torch restore']:.3f} | {m['dcp restore']:.3f} |"
        )
    lines += [
        "",
        "| tensors | blocking / torch.save | blocking / DCP async blocking | durable / torch.save "
        "| durable / DCP save | restore / torch.load | restore / dcp.load | ours µs per tensor "
        "(blocking, durable, restore) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        m = r["median_s"]
        ratios = {
            "blocking/torch.save": m["ours blocking"] / m["torch durable"],
            "blocking/dcp_async_blocking": m["ours blocking"] / m["dcp async_blocking"],
            "durable/torch.save": m["ours durable"] / m["torch durable"],
            "durable/dcp.save": m["ours durable"] / m["dcp durable"],
            "restore/torch.load": m["ours restore"] / m["torch restore"],
            "restore/dcp.load": m["ours restore"] / m["dcp restore"],
        }
        r["ratios"] = ratios
        per = [1e6 * m[f"ours {k}"] / r["tensors"] for k in ("blocking", "durable", "restore")]
        lines.append(
            f"| {r['tensors']} | "
            + " | ".join(f"{v:.2f}" for v in ratios.values())
            + f" | {per[0]:.0f}, {per[1]:.0f}, {per[2]:.0f} |"
        )
    if archives is not None:
        lines += [
            "",
            f"{archives['saves']} incremental saves kept as archives (2,000 tensors): CPU per "
            f"save {archives['first_cpu_s']:.3f} s at saves 2-4, {archives['last_cpu_s']:.3f} s "
            "at the last 3",
        ]
    md = "\n".join(lines) + "\n"
    report = {
        "archives": archives,
        "args": vars(args),
        "library": library_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "rows": rows,
        "runtime_s": time.perf_counter() - t_start,
    }
    write_results(args.out, "bench_many_tensors", report, md)
    if prof:
        with open(os.path.join(args.out, "bench_many_tensors_profile.txt"), "w") as f:
            f.write(prof)
        print(prof)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
