"""Smoke test of benchmarks/bench_async.py: ``--quick`` runs end to end and reports every section.

Deselected by default (``-m benchmark`` runs it); it takes a few minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_async.py"


@pytest.mark.benchmark
def test_bench_async_quick(tmp_path: Path) -> None:
    pytest.importorskip("psutil")
    args = [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "out")]
    args += ["--dir", str(tmp_path)]
    plot = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot = False
    if plot:
        args.append("--plot")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    report = json.loads((tmp_path / "out" / "bench_async.json").read_text())
    for section in ("meta", "sizes", "loop", "rss", "goals"):
        assert section in report, section
    assert len(report["sizes"]) == 2
    for size in report["sizes"].values():
        m = size["median_s"]
        for key in (
            "raw write+fsync",
            "copy_ floor",
            "torch.save+fsync",
            "safetensors.save_file+fsync",
            "DCP save",
            "DCP async_save (blocking)",
            "DCP async_save (total)",
            "ours sync save",
            "ours async save (blocking)",
            "ours async save (total)",
            "ours overlapped save (blocking)",
            "ours overlapped save (total)",
            "ours restore (verified)",
            "torch.load(mmap)+load_state_dict",
            "DCP load (+get/set_state_dict)",
            "ours restore (verified) [cold]",
            "torch.load(mmap)+load_state_dict [cold]",
            "DCP load (+get/set_state_dict) [cold]",
            "pairs: copy_ floor",
            "pairs: ours async save",
        ):
            assert m[key] > 0, key
    assert set(report["loop"]["summary"]) == {
        "torch.save",
        "DCP async_save",
        "ours async",
        "ours async +metrics",
        "ours overlapped",
    }
    for name in ("ours async", "DCP async_save"):
        assert len(report["rss"][name]["rss_after_each_save"]) == report["rss"]["saves"]
    assert len(report["goals"]) == 9  # restore twice: page cache warm and cold
    assert all(isinstance(g["met"], bool) for g in report["goals"])
    md = (tmp_path / "out" / "bench_async.md").read_text()
    assert "| goal |" in md and "Training loop" in md
    if plot:
        assert (tmp_path / "out" / "bench_async.png").stat().st_size > 0
    # everything written under --dir was cleaned up
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
