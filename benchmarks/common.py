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


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_results(out: str, name: str, report: Any, md: str) -> None:
    """``<out>/<name>.json`` (the figures) and ``<out>/<name>.md`` (the tables)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)


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
