"""Replicated DTensors whose copies differ between ranks, said at the save
(:mod:`resilient_callbacks.dcp.replicated`).

A chunk several ranks hold (a ``Replicate`` placement: tensor parallelism's row-wise bias) is
written once, by the lowest rank. Found 2026-12-07: a rank that changed its copy alone (here
rank 1 adds 1 to its local bias) was saved with rank 0's copy in silence, and a restore gave
rank 0's to every rank. Now rank 0 warns at that save, naming the tensor and its ranks; equal
copies say nothing, and the same divergence is said once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import spawn_ranks
from torch_needs import needs_dcp

pytestmark = [pytest.mark.timeout(300), needs_dcp]


def test_replicated_chunks_are_found_from_every_rank_layout():
    from resilient_callbacks.dcp.replicated import Replicas

    per_rank = [
        {
            "model/w": ["F32", [4, 2], [[[0, 0], [2, 2], "model/w"]]],
            "model/b": ["F32", [3], [[[0], [3], "model/b"]]],
            "optim/state/b/step": ["F32", [], [[[], [], "optim/state/b/step"]]],
        },
        {
            "model/w": ["F32", [4, 2], [[[2, 0], [2, 2], "model/w"]]],
            "model/b": ["F32", [3], [[[0], [3], "model/b"]]],
            "optim/state/b/step": ["F32", [], [[[], [], "optim/state/b/step"]]],
        },
    ]
    one = Replicas.of(per_rank, 1)
    assert one.chunks == [("model/b", (0, 1))]  # the model's only: not the shards, nor the step
    assert one.mine == [(0, "model/b")]


def test_a_sample_of_a_large_tensor_reads_evenly_spaced_elements():
    from resilient_callbacks.dcp.replicated import SAMPLE, _sample

    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100).t()  # (not contiguous)
    got = _sample(t).view(torch.float32)
    assert got.numel() == SAMPLE
    assert got[0] == t.reshape(-1)[0] and got[-1] == t.reshape(-1)[-1]
    assert _sample(torch.tensor(3.0)).view(torch.float32).tolist() == [3.0]


@pytest.mark.distributed
def test_replicas_that_differ_are_said_at_the_save(tmp_path):
    argv = [sys.executable, __file__, str(tmp_path)]
    spawn_ranks.run(argv, 2, tmp_path, "replicas", zygote=spawn_ranks.shared_zygote())
    r0, r1 = (json.loads((tmp_path / f"said.{r}.json").read_text()) for r in range(2))
    assert r0["equal"] == [] and r1["equal"] == []  # copies that are equal: nothing said
    (said,) = r0["diverged"]
    assert "replicated tensors differ between the ranks holding them" in said
    assert "model/1.bias (ranks 0, 1)" in said and "model/0" not in said
    assert "lowest rank" in said
    assert r1["diverged"] == []  # (rank 0 says it; the others log it)
    assert r0["again"] == []  # the same divergence at the next save: said once
    assert r0["steps"] == r1["steps"] == [1, 2, 3]  # the saves committed all the same


def worker(tmp: str) -> None:
    import warnings

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # the row-wise layer's bias (300 elements: more than the sample) is replicated
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 300))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    said: dict = {}
    state = {"train": Sharded(model)}
    with Checkpointer(Path(tmp) / "ck", every_n_steps=1, preemption=False) as ck:
        for step, case in ((1, "equal"), (2, "diverged"), (3, "again")):
            if case == "diverged" and rank == 1:
                with torch.no_grad():
                    model[1].bias.to_local().add_(1.0)  # this rank's copy alone
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ck.step(step, state)
                ck.flush()
            said[case] = [str(w.message) for w in caught if "replicated" in str(w.message)]
        said["steps"] = [c.step for c in ck.checkpoints()]
    (Path(tmp) / f"said.{rank}.json").write_text(json.dumps(said))
    spawn_ranks.leave_group()


if __name__ == "__main__":
    worker(sys.argv[1])
