"""The CLI is fast at first contact: only ``export``, which writes tensors, imports torch (~2 s).

Each command runs as a user runs it, the real ``resilient-ckpt`` executable in a subprocess, with
Python's import profiling on (``PYTHONPROFILEIMPORTTIME``): what it imported is read from that
list, not from a clock, so a loaded machine cannot make these fail.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import resilient_callbacks
from test_cli import make_run

EXE = os.path.join(os.path.dirname(sys.executable), "resilient-ckpt")
HEAVY = {"torch", "numpy", "safetensors", "transformers", "lightning", "deepspeed"}


def imported(*args: str) -> set[str]:
    """The top-level modules ``resilient-ckpt ARGS`` imported (it must succeed)."""
    src = os.path.dirname(os.path.dirname(resilient_callbacks.__file__))
    env = {
        **os.environ,
        "PYTHONPROFILEIMPORTTIME": "1",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert lines, "no import profile: PYTHONPROFILEIMPORTTIME had no effect"
    return {line.split("|")[-1].strip().split(".")[0] for line in lines}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("startup") / "ck")
    make_run(root, steps=(10, 20, 30), keep_last=2)
    return root


def test_help_list_verify_gc_import_no_torch(run_dir):
    for args in (
        ["--help"],
        ["ls", run_dir],
        ["ls", run_dir, "--fast", "--json"],
        ["verify", run_dir],
        ["verify", run_dir, "--all", "--json"],
        ["verify", os.path.join(run_dir, "step_000000030")],
        ["gc", run_dir, "--dry-run"],
    ):
        heavy = imported(*args) & HEAVY
        assert not heavy, f"resilient-ckpt {' '.join(args)} imported {sorted(heavy)}"


def test_push_pull_and_verify_of_a_remote_import_no_torch(run_dir, tmp_path):
    url = (tmp_path / "remote").as_uri()
    for args in (
        ["push", run_dir, url],
        ["verify", url, "--all"],
        ["ls", run_dir, "--remote", url],
        ["pull", url, str(tmp_path / "pulled")],
    ):
        heavy = imported(*args) & HEAVY
        assert not heavy, f"resilient-ckpt {' '.join(args)} imported {sorted(heavy)}"
    assert os.path.isdir(tmp_path / "pulled" / "step_000000030")


def test_inspect_imports_no_torch(run_dir, tmp_path):
    """``inspect`` names each tensor's dtype and shape from the safetensors headers, which
    need no torch (it imported torch, about 2 s, for a listing): a plain checkpoint, a
    compressed one (headers decompressed) and an incremental one (tensors in blobs)."""
    compressed, incremental = str(tmp_path / "zst"), str(tmp_path / "inc")
    pytest.importorskip("zstandard")
    make_run(compressed, steps=(10,), compression="zstd")
    make_run(incremental, steps=(10, 20), incremental=True)
    for args in (
        ["inspect", run_dir],
        ["inspect", run_dir, "--json"],
        ["inspect", run_dir, "--fast", "--step", "20"],
        ["inspect", os.path.join(run_dir, "step_000000030")],
        ["inspect", compressed],
        ["inspect", incremental, "--json"],
    ):
        heavy = imported(*args) & HEAVY
        assert not heavy, f"resilient-ckpt {' '.join(args)} imported {sorted(heavy)}"


def test_export_imports_torch_as_it_writes_tensors(run_dir, tmp_path):
    """The checks above see an import of torch where there is one."""
    assert "torch" in imported("export", run_dir, str(tmp_path / "out"))
