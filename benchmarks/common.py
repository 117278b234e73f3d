"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, which puts
this directory on ``sys.path``)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from typing import Any


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def round_robin(
    modes: tuple[str, ...], reps: int, run: Any, width: int = 13
) -> dict[str, list[dict[str, Any]]]:
    """``run(mode, rep)`` for every mode in every repetition, the order rotated by one each
    repetition (so slow drift of a shared machine hits the modes alike); the results by mode.
    Each result has ``"seconds"``, printed as it comes."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(reps):
        for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            res = run(mode, rep)
            runs[mode].append(res)
            print(f"rep {rep} {mode:{width}s} {res['seconds']:.2f} s", flush=True)
    return runs


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_stamp() -> dict[str, Any]:
    """When, where and with what a result was measured: UTC date and time, machine, CPU count,
    torch version (and the GPU's name where CUDA is in use) and the library commit."""
    import platform
    import sys
    import time

    stamp: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": None,
        "gpu": None,
        "library": library_version(),
    }
    torch = sys.modules.get("torch")  # not imported here by a script that did not need it
    if torch is not None:
        stamp["torch"] = torch.__version__
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stamp["gpu"] = torch.cuda.get_device_name()
    return stamp


def write_results(out: str, name: str, report: Any, md: str) -> None:
    """``<out>/<name>.json`` (the figures) and ``<out>/<name>.md`` (the tables), both stamped
    with :func:`run_stamp` (a dict report gains a ``"measured"`` key; the Markdown a last line),
    so no figure is written without its date, machine, torch version and library commit."""
    stamp = run_stamp()
    if isinstance(report, dict):
        report = {**report, "measured": stamp}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    line = (
        f"Measured {stamp['date']} on {stamp['machine']}, {stamp['cpus']} CPUs"
        + (f", {stamp['gpu']}" if stamp["gpu"] else "")
        + f", torch {stamp['torch'] or 'not imported'}, library {stamp['library']}."
    )
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md.rstrip("\n") + "\n\n" + line + "\n")


def library_version() -> str:
    """The commit of the working tree and whether src/ differs from it (results depend on it)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + (" (src/ modified)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def apply_quick(parser: Any, args: Any, **small: Any) -> None:
    """``--quick``: the ``small`` values for the options left at their defaults; an option
    given on the command line wins (``--quick --steps 4`` runs 4 steps)."""
    for name, value in small.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


def add_device_option(parser: Any) -> None:
    """``--device cpu|cuda``: where the model trains (issue 13's GPU mode)."""
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="train on the CPU (default) or the GPU; on cuda the snapshot's limit is the "
        "device-to-host copy into pinned buffers, and the goal is 0.1x (issue 13)",
    )


def device_missing(device: str) -> bool:
    """True (after saying so on stderr) when ``device`` is cuda and CUDA is not available."""
    import sys

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False here", file=sys.stderr)
        return True
    return False


def host_copies(tensors: list[Any], reps: int = 3) -> tuple[list[Any], float]:
    """Copies of ``tensors`` in host memory (pinned for CUDA tensors), and the fastest of
    ``reps`` copies into them: ``copy_``, or for CUDA tensors non-blocking device-to-host
    copies and a synchronize (the snapshot's limit)."""
    import time

    import torch

    cuda = any(t.is_cuda for t in tensors)
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    best = float("inf")
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors, strict=True):
            b.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return bufs, best


def per_size_main(
    doc: str, name: str, run: Any, labels: tuple[str, str], timed: str, reps_help: str
) -> int:
    """The command line, runs and report of a benchmark of what one step of each commit costs
    as the directory holds more checkpoints (``bench_best_decision``, ``bench_retention_pass``):
    ``run(work, sizes, window, reps, on)`` once with the step off (``labels[0]``, the baseline)
    and once on (``labels[1]``), each in a temporary folder of its own, returning
    ``{"save_ms": {n: ms}, f"{timed}_ms": {n: ms}}``; writes ``<name>.{json,md}`` into
    ``--out``."""
    import argparse
    import shutil
    import tempfile

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--sizes", default="10,100,500", help="checkpoints kept, comma-separated")
    ap.add_argument("--window", type=int, default=5, help="saves up to N whose median is taken")
    ap.add_argument("--reps", type=int, default=20, help=reps_help)
    ap.add_argument("--dir", default=None, help="where the runs write (a temporary folder)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    runs = {}
    for label, on in ((labels[0], False), (labels[1], True)):
        work = tempfile.mkdtemp(prefix=f"rc-{name}-", dir=args.dir)
        try:
            runs[label] = run(work, sizes, args.window, args.reps, on)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"# {name} (sizes {args.sizes}, median of {args.window} saves, "
        f"{args.reps} {reps_help.split()[0]}; library {library_version()}, {os.cpu_count()} cpus)",
        "",
        f"| checkpoints kept | save() {labels[0]}, ms | save() {labels[1]}, ms | {timed}, ms |",
        "|---:|---:|---:|---:|",
    ]
    for n in sizes:
        b, k = runs[labels[0]], runs[labels[1]]
        lines.append(
            f"| {n} | {b['save_ms'][n]:.2f} | {k['save_ms'][n]:.2f} | {k[f'{timed}_ms'][n]:.2f} |"
        )
    md = "\n".join(lines) + "\n"
    write_results(args.out, name, {"sizes": sizes, "runs": runs}, md)
    print()
    print(md)
    return 0
