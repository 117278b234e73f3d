"""Smoke test of benchmarks/bench_fixed_cost.py at a tiny size: two trees (the same src twice)
run round by round, every figure has its ratio, and the torch.save / torch.load baselines
measured beside ours give theirs. Deselected by default (``-m benchmark``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.benchmark
def test_bench_fixed_cost_tiny(tmp_path: Path) -> None:
    src = str(ROOT / "src")
    args = [sys.executable, str(ROOT / "benchmarks" / "bench_fixed_cost.py"), src, src]
    args += ["--count", "20", "--rounds", "2", "--saves", "2", "--dir", str(tmp_path)]
    args += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench_fixed_cost.json").read_text())
    assert report["measured"]["torch"]
    assert len(report["runs"][src]) == 4  # the same tree twice, two rounds each
    assert all(v > 0 for v in report["medians"][src].values())
    md = (tmp_path / "out" / "bench_fixed_cost.md").read_text()
    assert "restore cpu s" in md and "(1.00x)" in md
    # the torch.save / torch.load baselines, measured in the same worker, and the ratios to them
    assert all(report["medians"][src][k] > 0 for k in ("torch.save", "torch.load cpu"))
    assert set(report["ratios"][src]) == {
        "sync / torch.save",
        "sync cpu / torch.save cpu",
        "restore / torch.load",
        "restore cpu / torch.load cpu",
    }
    assert all(v > 0 for v in report["ratios"][src].values())
    assert "restore / torch.load" in md
