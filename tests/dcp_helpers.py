"""Spawning N gloo ranks (one OS process each) for the DCP/FSDP2 tests, and the tiny FSDP2
model they train. Worker scripts import the model part; the tests import :func:`spawn`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import spawn_ranks

DEADLINE = 150.0  # seconds for one group of ranks, start to finish


def spawn(
    argv: list[str],
    nprocs: int,
    workdir: Path,
    name: str,
    *,
    expect_ok: bool = True,
    env: dict[str, str] | None = None,
) -> list[int]:
    """Run ``argv`` as ``nprocs`` ranks; return each rank's exit code. With ``expect_ok``, fail
    (with every rank's output) if any rank fails or the group misses the deadline; otherwise a
    rank that dies makes the others be killed (as a launcher would) and the codes are returned.
    """
    expect = 0 if expect_ok else None
    return spawn_ranks.run(
        argv, nprocs, workdir, name, expect=expect, env=env, deadline=DEADLINE
    ).codes


# ----------------------------------------------------------------------------- the model


def build(seed: int = 0) -> tuple[Any, Any]:
    """A tiny MLP sharded with FSDP2 (each Linear, then the root) and its AdamW, on CPU. Odd
    sizes make the shards uneven (7 rows on 2 ranks: 4 + 3)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def train_step(model: Any, opt: Any) -> float:
    """One step on a batch drawn from the global torch RNG (restored per rank on resume)."""
    import torch

    x = torch.randn(8, 6)
    y = torch.randn(8, 3)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def full_tensors(model: Any, opt: Any) -> dict[str, Any]:
    """Every model and optimizer tensor as a full (unsharded) CPU tensor; collective."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, opt)
    out = {}
    for k, v in msd.items():
        out[f"model/{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            t = v.full_tensor() if isinstance(v, DTensor) else v
            out[f"optim/{fqn}/{k}"] = t.detach().clone().reshape(t.shape)
    return out
