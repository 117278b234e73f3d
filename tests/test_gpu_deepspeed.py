"""DeepSpeed engines on CUDA (``pytest -m gpu``; CUDA and DeepSpeed needed).

The DeepSpeed tests of tests/test_deepspeed.py run on the CPU (``DS_ACCELERATOR=cpu``, gloo).
Here the same script, tests/ds_train.py, runs with ``DS_ACCELERATOR=cuda``: NCCL, one GPU a rank
(two ranks where two GPUs are, else one), deterministic algorithms. The ZeRO partitions, fp32
masters and moments are then CUDA tensors, copied to pinned host buffers by the snapshot.
Killed between two saves and run again: every rank's per-micro-step losses and every gathered
fp32 weight and Adam moment equal the uninterrupted run's (float.hex).

Skipped where CUDA or DeepSpeed is absent, deselected by default (the ``gpu`` marker). The GPU
machines lent to this project have no DeepSpeed: ``scripts/gpu_wheels.sh`` gathers its wheels
here, and ``scripts/gpu_check.sh`` installs them there (see docs/deepspeed.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCRIPT = Path(__file__).with_name("ds_train.py")


def _run(args: list[str], world: int, workdir: Path, name: str, expect: int = 0) -> None:
    spawn_ranks.run(
        [sys.executable, str(SCRIPT), *args],
        world,
        workdir,
        name,
        expect=expect,
        env={"DS_ACCELERATOR": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        deadline=300.0,
        log_name="{name}.rank{rank}.log",
        tail=6000,
    )


@pytest.mark.parametrize(
    ("stage", "dtype", "overlap"),
    [
        pytest.param(s, d, o, id=f"zero{s}-{d}{'-overlapped' if o else ''}")
        for s, d, o in [
            (1, "bf16", False),
            (2, "fp32", False),
            (2, "fp16", False),
            (3, "bf16", False),
            (3, "fp32", False),
            (2, "bf16", True),
            (3, "fp32", True),
        ]
    ],
)
def test_deepspeed_on_cuda_sigkill_then_rerun_is_exact(tmp_path, stage, dtype, overlap):
    """``overlapped``: the killed and resumed runs with ``overlap_snapshot=True`` (the ZeRO
    ranges copied on the side stream while the next micro-steps run, DeepSpeed's optimizer
    step ordered after the copy on the GPU) against the uninterrupted run without it."""
    pytest.importorskip("deepspeed")
    from test_deepspeed import assert_same_run, restored

    world = min(2, torch.cuda.device_count())
    opts = ["--stage", str(stage), "--dtype", dtype, "--steps", "10", "--every", "3"]
    full = ["--dir", str(tmp_path / "a"), "--out", str(tmp_path / "full"), *opts]
    killed = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "kill"), *opts]
    killed += ["--overlap"] if overlap else []
    _run(full, world, tmp_path, "full")
    _run([*killed, "--die-at", "7"], world, tmp_path, "die", expect=-9)
    _run([*killed, "--no-pickle"], world, tmp_path, "resume")
    step = restored(tmp_path / "kill")["step"]
    assert step in (3, 6), step  # saves every 3 steps; killed at 7
    # every rank's per-micro-step losses, every gathered fp32 weight and Adam moment
    assert_same_run(tmp_path / "full", tmp_path / "kill", world)
