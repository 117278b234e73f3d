"""A DeepSpeed MoE model whose experts are split over the ranks (``ep_size`` = world size), for
the test that expert parallelism is refused at initialize (one process per rank, gloo)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from torch import nn

from ds_noshm import skip_shm_op


def main() -> None:
    skip_shm_op()
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import resilient_callbacks.deepspeed as rcds

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8),
        MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=2, k=1, use_rts=False),
    )
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "p"}
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "resilient_checkpoint": {"dirpath": sys.argv[1], "every_n_steps": 2},
    }
    try:
        rcds.initialize(model=model, model_parameters=groups, config=cfg)
    except Exception as e:
        print(f"REFUSED {type(e).__name__}: {e}", flush=True)
    else:
        print("ACCEPTED", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
