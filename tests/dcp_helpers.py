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
    # each rank forked from a process that imported torch once, not on a GPU (CUDA runs stay
    # fresh interpreters)
    zygote = None if (env or {}).get("RC_DEVICE") else spawn_ranks.shared_zygote()
    return spawn_ranks.run(
        argv, nprocs, workdir, name, expect=expect, env=env, deadline=DEADLINE, zygote=zygote
    ).codes


# ----------------------------------------------------------------------------- the model


def build(seed: int = 0) -> tuple[Any, Any]:
    """A tiny MLP sharded on CPU and its AdamW. Odd sizes make the shards uneven (7 rows on 2
    ranks: 4 + 3). ``RC_SHARDING`` picks how: ``fsdp2`` (default: ``fully_shard`` each Linear,
    then the root; DTensor state), ``fsdp1`` (``FullyShardedDataParallel`` around each Linear,
    ``use_orig_params=True`` as Lightning and accelerate set it; ShardedTensor state, a rank may
    hold no piece of a small tensor), ``fsdp1-mesh`` (the same given a device mesh: DTensor
    state) or ``tp`` (tensor parallelism: the first Linear column-wise, the second row-wise --
    shards along dimension 0 and 1 -- the last one plain and replicated; every rank trains on
    rank 0's batch, as a real TP group is fed one batch: :func:`train_step`), ``hsdp`` (FSDP2
    on a 2-D mesh: replicated across pairs of ranks, sharded within each; 4 ranks) or
    ``fsdp1-hybrid`` (FSDP1's ``HYBRID_SHARD``, the same layout).
    ``RC_EXTRA_LAYER=1`` appends a layer: a model the checkpoints do not fit;
    ``RC_FREEZE_FIRST=1`` freezes the first Linear (the optimizer gets the others);
    ``RC_UNUSED_PARAM=1`` gives the second Linear a parameter its forward does not use;
    ``RC_FSDP1_BF16=1`` gives FSDP1 bf16 mixed precision; ``RC_FSDP2_POLICY``, a comma-separated
    list of ``mp`` (bf16 ``MixedPrecisionPolicy``), ``offload`` (``CPUOffloadPolicy``) and
    ``noreshard`` (``reshard_after_forward=False``), FSDP2's policies; ``RC_OPTIM=sgd`` plain SGD (no
    momentum: an optimizer without state) in place of AdamW. ``RC_DEVICE=cuda``
    puts it on the rank's GPU (the process group must then be NCCL: :func:`backend`)."""
    import os

    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 1))
    if os.environ.get("RC_EXTRA_LAYER"):  # another model: one more layer than was saved
        model.append(nn.Linear(1, 1))
    if os.environ.get("RC_FREEZE_FIRST"):  # a frozen layer, as PEFT/LoRA fine-tuning leaves them
        model[0].requires_grad_(False)
    if os.environ.get("RC_UNUSED_PARAM"):  # trained, but no forward uses it: no optimizer state
        model[2].register_parameter("spare", torch.nn.Parameter(torch.randn(4, 3)))
    device = _device()
    model = model.to(device)
    how = os.environ.get("RC_SHARDING", "fsdp2")
    if how in ("fsdp2", "hsdp"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        hsdp = None
        if how == "hsdp":  # replicated across pairs of ranks, sharded within each pair
            n = dist.get_world_size()
            hsdp = init_device_mesh(device.type, (n // 2, 2), mesh_dim_names=("rep", "shard"))
        kw = _fsdp2_policies()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=hsdp, **kw)
        fully_shard(model, mesh=hsdp, **kw)
    elif how == "fsdp1-hybrid":  # FSDP1's HYBRID_SHARD: the same replication and sharding
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        n = dist.get_world_size()
        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            device_id=device,
            device_mesh=init_device_mesh(device.type, (n // 2, 2)),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            use_orig_params=True,
        )
    elif how in ("fsdp1", "fsdp1-mesh"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mesh = None
        if how == "fsdp1-mesh":
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mixed = None
        if os.environ.get("RC_FSDP1_BF16"):  # compute in bf16, keep fp32 shards (FSDP1's AMP)
            from torch.distributed.fsdp import MixedPrecision

            mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            device_id=device,
            device_mesh=mesh,
            use_orig_params=True,
            mixed_precision=mixed,
        )
    elif how == "tp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        # even hidden width: TP hands the column shards to the row-wise layer as local tensors
        model = nn.Sequential(
            nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1)
        ).to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        raise ValueError(f"RC_SHARDING={how!r}")
    # RC_TENSOR_LR=1: the learning rate as a tensor (a tensor among the param_groups)
    lr: Any = torch.tensor(1e-2) if os.environ.get("RC_TENSOR_LR") else 1e-2
    trainable = [p for p in model.parameters() if p.requires_grad]
    if os.environ.get("RC_OPTIM") == "sgd":  # an optimizer that never has state
        return model, torch.optim.SGD(trainable, lr=0.1)
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    return model, opt


def _fsdp2_policies() -> dict[str, Any]:
    """``fully_shard``'s keyword arguments for ``RC_FSDP2_POLICY`` (see :func:`build`)."""
    import os

    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    chosen = set(filter(None, os.environ.get("RC_FSDP2_POLICY", "").split(",")))
    kw: dict[str, Any] = {}
    if "mp" in chosen:  # compute in bf16 from the fp32 shards, reduce in fp32
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if "offload" in chosen:  # the shards and the optimizer step on the CPU (no pinning on CPU)
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if "noreshard" in chosen:  # the parameters stay unsharded between forward and backward
        kw["reshard_after_forward"] = False
    return kw


def _device() -> Any:
    """``RC_DEVICE``: ``cpu`` (default) or ``cuda`` (this rank's GPU, ``LOCAL_RANK``)."""
    import os

    import torch

    if os.environ.get("RC_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend() -> str:
    """The process group's backend for ``RC_DEVICE`` (NCCL for GPUs, gloo otherwise); sets the
    rank's GPU as the current device."""
    import torch

    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True)  # (with CUBLAS_WORKSPACE_CONFIG set)
        return "nccl"
    return "gloo"


def train_step(model: Any, opt: Any) -> float:
    """One step on a batch drawn from the global (CPU) torch RNG, restored per rank on resume,
    on the model's device. Under tensor parallelism (``RC_SHARDING=tp``) every rank trains on
    rank 0's batch (each rank still draws its own, so the RNGs advance alike): the ranks of a
    TP group compute one batch together, and on batches of their own the replicated tensors
    diverged between ranks (the save warned of it; ``test_sharded_replicas`` tests that)."""
    import os

    import torch

    device = _device()
    x = torch.randn(8, 6).to(device)
    y = torch.randn(8, 1).to(device)
    if os.environ.get("RC_SHARDING") == "tp":
        import torch.distributed as dist

        dist.broadcast(x, 0)
        dist.broadcast(y, 0)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def full_tensors(model: Any, opt: Any) -> dict[str, Any]:
    """Every model and optimizer tensor as a full (unsharded) CPU tensor, whatever the sharding;
    collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.detach().cpu().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = v.detach().cpu().clone()
    return out
