"""Worker script of tests/test_sharded_tied.py: one rank of a run whose model ties its output
layer to its embedding (``head.weight is emb.weight``, as language models do), FSDP2 on gloo
(CPU), ``Sharded(model, optimizer)`` in a ``Checkpointer`` that saves every step.

``python dcp_tied_worker.py ROOT OUT TOTAL``: restore from ROOT (resharding to this world size),
write the full tensors right after the restore to ``OUT.restored.safetensors`` (rank 0), train
up to step TOTAL, write the final full tensors to ``OUT.final.safetensors`` (rank 0) and
whether the weights are still tied to ``OUT.tied``. With ``RC_PLAIN=1``: one process, no
process group, no FSDP (an evaluation or a debugging session on one machine).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import spawn_ranks
from dcp_helpers import full_tensors
from resilient_callbacks import Checkpointer
from resilient_callbacks.dcp import Sharded


class Tied(nn.Module):
    """An embedding, a layer, and an output layer that shares the embedding's weight (11 rows:
    uneven shards on 2 and 3 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def main() -> None:
    root, out, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    plain = os.environ.get("RC_PLAIN") == "1"
    if not plain:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = 0 if plain else dist.get_rank()
    torch.manual_seed(0)
    model = Tied()
    if not plain:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.mid)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    torch.manual_seed(1 + rank)  # each rank its own batches (the Checkpointer restores it)
    state = {"train": Sharded(model, opt)}
    with Checkpointer(root, every_n_steps=1) as ck:
        step = ck.restore(state)
        restored = full_tensors(model, opt)
        while step < total:
            x = torch.randint(0, 11, (4, 3))
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            ck.step(step, state, final=step == total)
    final = full_tensors(model, opt)
    if rank == 0:
        for name, tensors in (("restored", restored), ("final", final)):
            save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out}.{name}.safetensors")
        with open(f"{out}.tied", "w") as f:
            f.write(str(model.head.weight is model.emb.weight))
    if not plain:
        spawn_ranks.leave_group()


if __name__ == "__main__":
    main()
