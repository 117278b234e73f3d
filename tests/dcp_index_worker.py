"""Worker script of the chunk-index reuse test: one rank of 2.

``python dcp_index_worker.py ROOT OUT``: five saves of ``Sharded`` (FSDP2, gloo, CPU), counting
this rank's gathers of the chunk index:

1. before any optimizer step (no optimizer state: the layout has model tensors only);
2. after a step (the optimizer gained state: the layout changed on every rank);
3. after another step (nothing changed);
4. after rank 1 alone dropped its last index (as if its layout had changed): every rank must
   gather, or rank 0 would skip the collective rank 1 enters and the group would hang;
5. after another step (nothing changed).

Writes ``OUT.rank<r>.json``: the number of gathers after each save.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch.distributed as dist

import spawn_ranks
from dcp_helpers import build, train_step
from resilient_callbacks import Checkpointer
from resilient_callbacks.dcp import Sharded


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    model, opt = build()
    sharded = Sharded(model, opt)
    gathers = [0]
    from resilient_callbacks.dcp import sharded as sharded_module

    inner = sharded_module.index_of_ranks

    def counted(per_rank, r):  # type: ignore[no-untyped-def]
        gathers[0] += 1
        return inner(per_rank, r)

    sharded_module.index_of_ranks = counted  # type: ignore[assignment]
    after: list[int] = []
    with Checkpointer(root, preemption=False, async_save=False) as ck:
        ck.save(1, {"train": sharded})
        after.append(gathers[0])
        for step in (2, 3, 4, 5):
            train_step(model, opt)
            if step == 4 and rank == 1:
                sharded._index = None
            ck.save(step, {"train": sharded})
            after.append(gathers[0])
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(after, f)
    spawn_ranks.leave_group()


if __name__ == "__main__":
    main()
