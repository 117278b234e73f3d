"""Smoke test of benchmarks/bench_restore.py --big at a tiny size: every method restores the
state bitwise (the worker checks it and fails otherwise), each gets its ratios, and the bytes it
copies per restored byte are counted: one copy for ours and the mmap'd torch.load, the read
buffer's copy on top for torch.load. Deselected by default (``-m benchmark``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.benchmark
def test_bench_restore_big_tiny(tmp_path: Path) -> None:
    args = [sys.executable, str(ROOT / "benchmarks" / "bench_restore.py"), "--big", "3x1"]
    args += ["--reps", "1", "--threads", "1", "--dir", str(tmp_path)]
    args += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench_restore_big.json").read_text())
    (state,) = report["states"]
    assert state["state_bytes"] == 3 << 20
    assert set(state["median_s"]) == {
        "ours",
        "torch.load(mmap)+load_state_dict",
        "torch.load+load_state_dict",
    }
    copied = state["copied_per_byte"]
    assert 0.99 < copied["ours"] < 1.1, copied
    assert 0.99 < copied["torch.load(mmap)+load_state_dict"] < 1.1, copied
    assert 1.99 < copied["torch.load+load_state_dict"] < 2.1, copied
    md = (tmp_path / "out" / "bench_restore_big.md").read_text()
    assert "bytes copied / restored byte" in md and "| 3 x 1 MB | ours |" in md
