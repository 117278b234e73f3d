"""Smoke test of benchmarks/bench_scale.py (default suite: about a second): it drives the
node-local commit path's internals (an uploader without its thread), so a change of those
broke it silently (found by a probe: the stand-in counters lacked a field the uploader adds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_scale_runs_at_8_ranks(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]),
    }
    args = [sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--ranks", "8"]
    args += ["--per-node", "8", "--out", str(tmp_path / "scale")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "scale" / "bench_scale.json").read_text())
    (row,) = report["rows"]
    assert (row["ranks"], row["nodes"]) == (8, 1)
    assert row["requests"]["PUT"] > 0 and row["manifest_kb"] > 0  # it uploaded and committed
