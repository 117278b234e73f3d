"""``Sharded`` with tied weights (an output layer sharing the embedding's weight) under FSDP2 on
gloo ranks (CPU): a run stopped and resumed ends bit-identical to one that was not stopped,
and a checkpoint reshards onto 3 ranks (uneven shards), back onto 2, and into one process
without FSDP, every full tensor of the model and the optimizer equal to what was saved and the
weights still tied. (Resharding of untied models: tests/test_dcp_sharded.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_helpers import spawn
from torch_needs import needs_dcp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600), needs_dcp]
WORKER = str(Path(__file__).with_name("dcp_tied_worker.py"))


def _run(tmp_path: Path, nprocs: int, root: str, out: str, total: int) -> None:
    argv = [sys.executable, WORKER, str(tmp_path / root), str(tmp_path / out), str(total)]
    if nprocs:
        spawn(argv, nprocs, tmp_path, out)
        return
    env = {**os.environ, "RC_PLAIN": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


def _assert_same(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    assert sorted(x) == sorted(y)
    assert any(k.startswith("optim/") for k in x)  # the optimizer's moments are compared too
    assert [k for k in x if not torch.equal(x[k], y[k])] == []


@pytest.mark.slow
def test_tied_weights_resume_exactly_and_reshard_between_numbers_of_ranks(tmp_path):
    _run(tmp_path, 2, "whole", "whole", 4)
    _run(tmp_path, 2, "ck", "first", 2)  # stopped at step 2 ...
    _run(tmp_path, 2, "ck", "second", 4)  # ... and resumed: as if never stopped
    _assert_same(tmp_path / "whole.final.safetensors", tmp_path / "second.final.safetensors")
    _run(tmp_path, 3, "ck", "three", 5)  # 2 -> 3 ranks
    _assert_same(tmp_path / "second.final.safetensors", tmp_path / "three.restored.safetensors")
    _run(tmp_path, 2, "ck", "back", 6)  # 3 -> 2 ranks
    _assert_same(tmp_path / "three.final.safetensors", tmp_path / "back.restored.safetensors")
    _run(tmp_path, 0, "ck", "plain", 6)  # 2 ranks -> one process, no FSDP
    _assert_same(tmp_path / "back.final.safetensors", tmp_path / "plain.restored.safetensors")
    for out in ("second", "three", "back", "plain"):
        assert (tmp_path / f"{out}.tied").read_text() == "True", out
