"""What does a background save take from the training thread while it persists? (Explains the
in-loop overhead of background saves on a machine without spare cores, e.g. the DeepSpeed
benchmark on the 2-core development VM.)

    .venv/bin/python benchmarks/writer_interference.py [--mb 600] [--rounds 3] [--dir DIR]

For ``--mb`` MB of fp32 tensors, each round measures, for one second each, the throughput of a
2-thread matmul (``torch`` intra-op threads, standing in for a training step's compute) and of a
pure-Python loop (standing in for a framework's Python per step, which needs the GIL):

- **idle**: nothing else running;
- **ours persisting**: right after ``Checkpointer.save`` returned, while the background writer
  writes, hashes and fsyncs the snapshot;
- **raw write**: while a plain thread writes the same bytes to a file with ``os.write`` from
  one buffer and fsyncs it, no library code (what any durable write of these bytes costs the
  machine).

``--nice 0,10,19``: also, for each value, the 2-thread matmul's rate over the *whole* persist
(from ``save`` returning until the checkpoint is durable) with the background writer thread at
that nice value, and the probe's lost work (``(1 - rate / idle) * persist seconds``): whether a
lower-priority writer takes less from training, or only spreads the same over a longer time.

It also reports the CPU time of the whole process (user and system, ``getrusage``) spent in
each persist while the main thread only waits: the writer's own work. Time the kernel and the
hypervisor spend on the I/O outside this process is not in it, and shows only as the slowdown
of the probes.

Prints a Markdown table and writes ``writer_interference.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import threading
import time
from typing import Any

import torch
from common import library_version, med, write_results


def matmul_rate(seconds: float) -> float:
    a = torch.randn(512, 512)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        n += 1
    return n / seconds


def python_rate(seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += 1
    return n / seconds


def matmul_until(done: threading.Event) -> tuple[float, float]:
    """The 2-thread matmul's rate while ``done`` is not set, and for how long it ran."""
    a = torch.randn(512, 512)
    n, t0 = 0, time.perf_counter()
    while not done.is_set():
        a @ a
        n += 1
    seconds = time.perf_counter() - t0
    return n / seconds, seconds


def renice_writer(value: int) -> None:
    """Set the nice value of the background writer thread(s) of this process."""
    for t in threading.enumerate():
        if t.name.startswith("rc-persist") and t.native_id is not None:
            os.setpriority(os.PRIO_PROCESS, t.native_id, value)


def whole_persist(ck: Any, step: int, state: dict) -> tuple[float, float]:
    """Save, then probe until the checkpoint is durable: (matmul rate, persist seconds)."""
    ck.save(step, state)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ck.flush(), done.set()))
    waiter.start()
    rate = matmul_until(done)
    waiter.join()
    return rate


def cpu_seconds() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def raw_write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        step = 16 << 20
        for off in range(0, len(view), step):
            os.write(fd, view[off : off + step])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--mb", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--nice", default="", help="writer nice values to compare, e.g. 0,10,19")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    from resilient_callbacks import Checkpointer

    torch.set_num_threads(2)
    work = tempfile.mkdtemp(prefix="writer_interference_", dir=args.dir)
    n = args.mb * 250_000 // 6
    state = {"w": [torch.randn(n) for _ in range(6)]}
    raw = torch.cat(state["w"]).numpy().tobytes()
    probes: dict[str, dict[str, list[float]]] = {
        k: {"matmul": [], "python": []} for k in ("idle", "ours persisting", "raw write")
    }
    writer_cpu: list[tuple[float, float]] = []
    nices = [int(v) for v in args.nice.split(",") if v.strip()]
    niced: dict[int, list[tuple[float, float]]] = {v: [] for v in nices}
    try:
        with Checkpointer(
            os.path.join(work, "ck"), keep_last=1, preemption=False, capture_rng=False
        ) as ck:
            ck.save(0, state)  # buffers allocated, first write done
            ck.flush()
            for r in range(1, args.rounds + 1):
                for t in state["w"]:
                    t.add_(1.0)
                probes["idle"]["matmul"].append(matmul_rate(1.0))
                probes["idle"]["python"].append(python_rate(1.0))

                ck.save(2 * r - 1, state)
                probes["ours persisting"]["matmul"].append(matmul_rate(1.0))
                probes["ours persisting"]["python"].append(python_rate(1.0))
                ck.flush()

                u0, s0 = cpu_seconds()
                ck.save(2 * r, state)
                ck.flush()  # the main thread only waits: the CPU time is the save's
                u1, s1 = cpu_seconds()
                writer_cpu.append((u1 - u0, s1 - s0))

                for i, value in enumerate(nices):
                    renice_writer(value)
                    for t in state["w"]:
                        t.add_(1.0)
                    niced[value].append(whole_persist(ck, 1000 * r + i, state))
                renice_writer(0)

                th = threading.Thread(target=raw_write, args=(os.path.join(work, "raw"), raw))
                th.start()
                probes["raw write"]["matmul"].append(matmul_rate(1.0))
                probes["raw write"]["python"].append(python_rate(1.0))
                th.join()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    idle = {k: med(v) for k, v in probes["idle"].items()}
    report: dict[str, Any] = {
        "mb": args.mb,
        "rounds": args.rounds,
        "library": library_version(),
        "torch": torch.__version__,
        "probes": probes,
        "relative": {
            mode: {k: med(v) / idle[k] for k, v in rates.items()} for mode, rates in probes.items()
        },
        "save_cpu_user_s": med([u for u, _ in writer_cpu]),
        "save_cpu_sys_s": med([s for _, s in writer_cpu]),
        "niced": {
            str(v): {
                "matmul": med([rate / idle["matmul"] for rate, _ in got]),
                "persist_s": med([sec for _, sec in got]),
                "lost_s": med([(1 - rate / idle["matmul"]) * sec for rate, sec in got]),
            }
            for v, got in niced.items()
        },
    }
    lines = [
        f"# writer_interference ({args.mb} MB, {args.rounds} rounds, medians; library "
        f"{report['library']}, torch {report['torch']}, {os.cpu_count()} cpus)",
        "",
        "| while | 2-thread matmul rate | Python loop rate |",
        "|---|---:|---:|",
    ]
    for mode, rel in report["relative"].items():
        lines.append(f"| {mode} | {rel['matmul']:.2f}x | {rel['python']:.2f}x |")
    lines += [
        "",
        f"CPU time of one whole save (snapshot + persist, main thread waiting): user "
        f"{report['save_cpu_user_s']:.3f} s, system {report['save_cpu_sys_s']:.3f} s.",
    ]
    if nices:
        lines += [
            "",
            "Over the whole persist, the writer thread at each nice value:",
            "",
            "| writer nice | 2-thread matmul rate | persist s | matmul work lost, s |",
            "|---:|---:|---:|---:|",
        ]
        for v, got in report["niced"].items():
            lines.append(
                f"| {v} | {got['matmul']:.2f}x | {got['persist_s']:.2f} | {got['lost_s']:.3f} |"
            )
    md = "\n".join(lines) + "\n"
    write_results(args.out, "writer_interference", report, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
