"""Whether the engine counters' refusal of an LR scheduler of another kind comes before
anything else of a Checkpointer state loads when the counters are NOT its first key (one rank,
CPU): the engine's module first, then its counters, as a user may build a state by hand.

    python ds_counters_first.py DIR

Saves ``{"module": engine.module, "counters": EngineCounters(engine)}`` of an engine with
DeepSpeed's WarmupLR, then restores it into an engine with torch's LambdaLR whose weights are
zeros, and prints one line ``RESULT {json}``: the error's type and text, and whether the module's
weights are still zeros.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from ds_noshm import skip_shm_op
from spawn_ranks import world_of_one


def engine(scheduler: str):  # (a DeepSpeedEngine)
    import deepspeed

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg: dict = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}}
    sched = None
    if scheduler == "WarmupLR":
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    e, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    return e


def main() -> None:
    world_of_one()
    skip_shm_op()
    import deepspeed

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.deepspeed.counters import EngineCounters

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    saved = engine("WarmupLR")
    with Checkpointer(sys.argv[1]) as ck:
        ck.save(1, {"module": saved.module, "counters": EngineCounters(saved)})
        ck.flush()
    live = engine("LambdaLR")
    with torch.no_grad():
        for p in live.module.parameters():
            p.zero_()
    error = None
    with Checkpointer(sys.argv[1]) as ck:
        try:
            ck.restore({"module": live.module, "counters": EngineCounters(live)})
        except Exception as e:  # (reported)
            error = f"{type(e).__name__}: {e}"
    zeros = all(not p.any() for p in live.module.parameters())
    print("RESULT " + json.dumps({"error": error, "module_untouched": zeros}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
