"""Smoke test of benchmarks/bench_core.py at a tiny size: every restore method is timed with the
same post-load work, and the report says when, where and with which library it was measured.

Deselected by default (``-m benchmark`` runs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_core.py"


@pytest.mark.benchmark
def test_bench_core_tiny(tmp_path: Path) -> None:
    args = [sys.executable, str(SCRIPT), "--mb", "8", "--reps", "1"]
    args += ["--out", str(tmp_path / "out"), "--dir", str(tmp_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    report = json.loads((tmp_path / "out" / "bench_core.json").read_text())
    for key in ("date", "library", "machine", "torch", "state_bytes"):
        assert report.get(key), key
    touched = report["restore_touched_bytes"]
    # every restore method pays the same touch of the restored optimizer state (ours was not
    # charged it before): the same bytes for all three, about two thirds of the state
    assert set(touched) == {
        "torch.load(mmap)+load_state_dict",
        "torch.load+load_state_dict",
        "ours (restore, verified)",
    }
    assert len(set(touched.values())) == 1, touched
    assert next(iter(touched.values())) > report["state_bytes"] // 2
    md = (tmp_path / "out" / "bench_core.md").read_text()
    assert report["date"] in md and report["torch"] in md
