"""benchmarks/common.write_results stamps every result with when, where and with what it was
measured (the project's rule for performance figures), whichever script writes it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_write_results_stamps_date_machine_torch_and_library(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import common
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    common.write_results(str(tmp_path), "demo", {"median_s": 1.0}, "| a | b |\n")
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["median_s"] == 1.0
    stamp = report["measured"]
    for key in ("date", "machine", "cpus", "library"):
        assert stamp[key], key
    assert stamp["torch"] == torch.__version__
    md = (tmp_path / "demo.md").read_text()
    assert md.startswith("| a | b |\n")
    assert f"torch {torch.__version__}" in md and stamp["date"] in md and stamp["library"] in md

    # a list report (bench_compression's rows) keeps its shape; its Markdown is stamped
    common.write_results(str(tmp_path), "rows", [{"x": 1}], "rows\n")
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"x": 1}]
    assert stamp["machine"] in (tmp_path / "rows.md").read_text()
