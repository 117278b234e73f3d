"""The scripts under ``examples/`` run as their docstrings say, and resume.

Each runs as a user would start it (``torchrun`` for the multi-process ones), in a fresh working
directory (every example writes under ``./demo_output``). The self-checking examples (they kill
a run, resume it and compare with an uninterrupted one) must report bit-identical results; the
``torchrun`` loops are run to step 20, then run again to step 40, and must continue from step
20 with the same losses as a run that was never stopped.

All marked ``slow`` (about 3.5 minutes together; the paths they take are covered by the default
suite's own tests): ``scripts/test.sh -m slow tests/test_examples.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(argv: list[str], cwd: Path, timeout: float = 240.0) -> str:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    r = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{argv} exited {r.returncode}\n{out[-4000:]}"
    return out


def torchrun(script: str, nproc: int, cwd: Path, *args: str) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return run([*launcher, f"--nproc_per_node={nproc}", str(EXAMPLES / script), *args], cwd)


def losses(out: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("script", ["fsdp_resume.py", "ddp_loop.py"])
def test_torchrun_example_continues_where_it_stopped_with_the_same_losses(tmp_path, script):
    straight = torchrun(script, 2, tmp_path, "--dir", "straight", "--steps", "40")
    first = torchrun(script, 2, tmp_path, "--dir", "stopped", "--steps", "20")
    again = torchrun(script, 2, tmp_path, "--dir", "stopped", "--steps", "40")
    assert "starting at step 0" in first
    assert "starting at step 20" in again, again[-2000:]
    assert sorted(losses(again)) == [30, 40]
    assert {s: losses(straight)[s] for s in (30, 40)} == losses(again)
    if script == "ddp_loop.py":  # the DDP-wrapped model, evaluated in one plain process
        import torch

        from resilient_callbacks import Checkpointer

        models = []
        for d in ("straight", "stopped"):
            torch.manual_seed(1)
            net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
            )
            with Checkpointer(tmp_path / d, read_only=True) as ck:
                assert ck.restore({"model": net}) == 40
            models.append(net)
        for a, b in zip(*(m.state_dict().values() for m in models), strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_example_resumes_on_one_rank(tmp_path):
    torchrun("fsdp_resume.py", 2, tmp_path, "--dir", "ck", "--steps", "20")
    out = torchrun("fsdp_resume.py", 1, tmp_path, "--dir", "ck", "--steps", "30")
    assert "starting at step 20 on 1 rank(s)" in out, out[-2000:]
    assert sorted(losses(out)) == [30]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "verdict"),
    [
        (
            "deepspeed_resume.py",
            '"per-step losses identical": true, "final fp32 weights identical": true',
        ),
        ("lightning_resume.py", "final weights identical: True"),
        ("transformers_resume.py", "per-step losses and final weights bit-identical: True"),
        ("demo_resume.py", None),
    ],
)
def test_self_checking_example_reports_an_exact_resume(tmp_path, script, verdict):
    out = run([sys.executable, str(EXAMPLES / script)], tmp_path, timeout=400.0)
    if verdict is not None:
        assert verdict in out, out[-3000:]
    if script == "lightning_resume.py":
        assert re.search(r"all \d+ per-step losses identical: True", out), out[-3000:]
