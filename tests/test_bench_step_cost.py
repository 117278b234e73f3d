"""Smoke test of benchmarks/bench_step_cost.py at a tiny size: two trees (the same src twice),
both settings, every median positive and the table written. Deselected by default
(``-m benchmark``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.benchmark
def test_bench_step_cost_tiny(tmp_path: Path) -> None:
    src = str(ROOT / "src")
    args = [sys.executable, str(ROOT / "benchmarks" / "bench_step_cost.py"), src, src]
    args += ["--count", "20", "--rounds", "1", "--steps", "18", "--out", str(tmp_path / "out")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench_step_cost.json").read_text())
    assert report["measured"]["torch"]
    for setting in ("default", "save_on_exception", "micro_batch"):
        assert len(report["runs"][src][setting]) == 2  # the same tree twice, one round each
        assert all(v > 0 for v in report["medians"][src][setting].values())
    md = (tmp_path / "out" / "bench_step_cost.md").read_text()
    assert "| save_on_exception |" in md and "step / train" in md
