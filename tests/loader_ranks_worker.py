"""Worker script of the loader test on more ranks: one rank of 1 or 2.

``python loader_ranks_worker.py save ROOT OUT``: each rank takes epoch 0 and 3 batches of epoch 1
of a sharded ``ResumableDataLoader`` (batch size 4), saves it as ``PerRank(loader,
new_ranks="rank0")`` and writes the samples of epoch 1 it took to ``OUT.taken.rank<r>.json``.

``python loader_ranks_worker.py resume ROOT OUT [NEW]``: each rank (of more than saved) restores
the loader (batch size 2) as ``PerRank(loader, new_ranks=NEW)`` and writes the rest of epoch 1
it gets to ``OUT.rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import spawn_ranks
from resilient_callbacks import Checkpointer, PerRank, ResumableDataLoader


def main() -> None:
    mode, root, out = sys.argv[1:4]
    new = sys.argv[4] if len(sys.argv) > 4 else "rank0"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = TensorDataset(torch.arange(50))
    batch = 4 if mode == "save" else 2
    loader = ResumableDataLoader(ds, batch, seed=0, num_replicas=world, rank=rank)
    state = {"data": PerRank(loader, new_ranks=new)}
    with Checkpointer(root) as ck:
        if mode == "save":
            list(loader)  # epoch 0
            it = iter(loader)
            taken = [x for _ in range(3) for x in next(it)[0].tolist()]
            ck.save(1, state)
            with open(f"{out}.taken.rank{rank}.json", "w") as f:
                json.dump(taken, f)
        else:
            assert ck.restore(state) == 1
            rest = [x for b in loader for x in b[0].tolist()]
            with open(f"{out}.rank{rank}.json", "w") as f:
                json.dump(rest, f)
    spawn_ranks.leave_group()


if __name__ == "__main__":
    main()
