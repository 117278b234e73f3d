"""Smoke test of benchmarks/bench_best_decision.py at a tiny size: both runs time their saves at
each size, the keep_best run its decision too, and the report says when and where it was
measured.

Deselected by default (``-m benchmark`` runs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_best_decision.py"


@pytest.mark.benchmark
def test_bench_best_decision_tiny(tmp_path: Path) -> None:
    args = [sys.executable, str(SCRIPT), "--sizes", "3,6", "--window", "2", "--reps", "2"]
    args += ["--out", str(tmp_path / "out"), "--dir", str(tmp_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    report = json.loads((tmp_path / "out" / "bench_best_decision.json").read_text())
    assert report["measured"]["date"] and report["sizes"] == [3, 6]
    runs = report["runs"]
    assert set(runs["baseline"]["save_ms"]) == set(runs["keep_best"]["save_ms"]) == {"3", "6"}
    assert runs["baseline"]["decision_ms"] == {}
    assert set(runs["keep_best"]["decision_ms"]) == {"3", "6"}
    md = (tmp_path / "out" / "bench_best_decision.md").read_text()
    assert "| 6 |" in md and "decision, ms" in md
