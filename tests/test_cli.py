"""The resilient-ckpt CLI, run as a user would: a real subprocess on real checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.cli import main


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in-process (fast); one test below runs the real executable."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse usage errors
            code = int(e.code or 0)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_real_executable_and_module_entry_points(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    exe = os.path.join(os.path.dirname(sys.executable), "resilient-ckpt")
    for cmd in ([exe], [sys.executable, "-m", "resilient_callbacks"]):
        r = subprocess.run(
            [*cmd, "ls", root, "--json"], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
        assert [row["step"] for row in json.loads(r.stdout)] == [10, 20, 30]


def make_run(root: str, steps=(10, 20, 30), **kw) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = {"model": model, "extra": {"epoch": 1, "name": "run"}}
    with Checkpointer(root, **kw) as ck:
        for s in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(s, state, metrics={"loss": 1.0 / s})
    return state


def flip_byte(path: str, offset: int = -5) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_ls_json_lists_steps_status_and_reasons(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, keep_last=2)
    r = cli("ls", root, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["step"] for row in rows] == [20, 30]
    assert all(row["status"] == "valid" for row in rows)
    assert "newest" in rows[-1]["kept"] and "last 2" in rows[0]["kept"]
    human = cli("ls", root)
    assert human.returncode == 0 and "STATUS" in human.stdout and "newest" in human.stdout


def test_ls_shows_corrupt_and_incomplete(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    flip_byte(os.path.join(root, "step_000000020", "shared.safetensors"))
    os.makedirs(os.path.join(root, "step_000000040"))  # torn: no manifest
    rows = {row["name"]: row for row in json.loads(cli("ls", root, "--json").stdout)}
    assert rows["step_000000020"]["status"] == "corrupt"
    assert "checksum" in rows["step_000000020"]["problem"]
    assert rows["step_000000040"]["status"] == "incomplete"
    assert rows["step_000000010"]["status"] == rows["step_000000030"]["status"] == "valid"
    # --fast checks sizes only: the flipped byte is not seen, a truncation is
    fast = {row["name"]: row for row in json.loads(cli("ls", root, "--json", "--fast").stdout)}
    assert fast["step_000000020"]["status"] == "valid"


def test_verify_exit_codes_name_the_bad_file(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    ok = cli("verify", root)
    assert ok.returncode == 0 and ok.stdout.count("ok") == 3
    flip_byte(os.path.join(root, "step_000000030", "rank_00000.safetensors"))
    bad = cli("verify", root)
    assert bad.returncode == 1
    assert "rank_00000.safetensors" in bad.stdout and "step_000000030" in bad.stdout
    assert cli("verify", root, "--step", "20").returncode == 0
    assert cli("verify", root, "--step", "30").returncode == 1
    missing = cli("verify", root, "--step", "99")
    assert missing.returncode == 1 and "no checkpoint of step 99" in missing.stderr
    assert cli("verify", str(tmp_path / "empty")).returncode == 1


def test_inspect_shows_keys_shapes_dtypes_metrics(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    r = cli("inspect", root, "--step", "20")
    assert r.returncode == 0, r.stderr
    assert "model.weight" in r.stdout and "float32" in r.stdout and "[3, 4]" in r.stdout
    assert "loss" in r.stdout and "extra.epoch" in r.stdout
    info = json.loads(cli("inspect", root, "--step", "20", "--json").stdout)
    assert info["step"] == 20 and info["metrics"] == {"loss": 0.05}
    keys = {k["key"]: k for k in info["keys"]}
    assert keys["model.weight"]["shape"] == [3, 4] and keys["model.weight"]["dtype"] == "float32"
    assert cli("inspect", root, "--step", "5").returncode == 1


def test_gc_dry_run_then_delete(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20, 30, 40), keep_last=None)
    os.makedirs(os.path.join(root, ".staging-step_000000050-abc"))
    dry = cli("gc", root, "--dry-run", "--keep-last", "2")
    assert dry.returncode == 0
    assert (
        "would delete step_000000010" in dry.stdout and "would delete step_000000020" in dry.stdout
    )
    assert ".staging-step_000000050-abc" in dry.stdout
    assert len(os.listdir(root)) >= 5  # nothing deleted
    done = cli("gc", root, "--keep-last", "2")
    assert done.returncode == 0, done.stderr
    left = sorted(n for n in os.listdir(root) if n.startswith(("step_", ".staging")))
    assert left == ["step_000000030", "step_000000040"]


def test_gc_keeps_corrupt_unless_asked_and_refuses_beside_a_writer(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, keep_last=None)
    flip_byte(os.path.join(root, "step_000000010", "shared.safetensors"))
    cli("gc", root)
    assert os.path.isdir(os.path.join(root, "step_000000010"))
    r = cli("gc", root, "--remove-corrupt")
    assert r.returncode == 0 and "corrupt" in r.stdout
    assert not os.path.exists(os.path.join(root, "step_000000010"))
    with Checkpointer(root):
        locked = cli("gc", root)
        assert locked.returncode == 1 and "open Checkpointer" in locked.stderr


@pytest.mark.parametrize("args", [["ls"], ["frobnicate", "x"], ["inspect", "x"]])
def test_usage_errors_exit_2(args):
    assert cli(*args).returncode == 2
