"""Smoke test of benchmarks/bench_lightning.py: ``--quick`` runs end to end and reports every
configuration. Deselected by default (``-m benchmark`` runs it); about a minute on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_lightning.py"


@pytest.mark.benchmark
def test_bench_lightning_quick(tmp_path: Path) -> None:
    args = [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "out")]
    args += ["--dir", str(tmp_path), "--variants"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "bench_lightning.json").read_text())
    assert set(report["configs"]) == {
        "none",
        "ModelCheckpoint",
        "ResilientCheckpoint",
        "ResilientCheckpoint (no overlap)",
        "ResilientCheckpoint (sync)",
    }
    assert report["configs"]["ModelCheckpoint"]["save_call_s"] > 0
    assert report["configs"]["ResilientCheckpoint"]["blocking_s"] >= 0
    assert report["state_bytes"] > 20e6
    assert "ratio" in report["goal"]
    assert (tmp_path / "out" / "bench_lightning.md").read_text().startswith("# bench_lightning")
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]  # scratch files removed
