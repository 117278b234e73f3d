"""``Sharded`` restored again in the same process (going back to the newest checkpoint after a
loss spike, say) from a checkpoint whose optimizer had no state yet (saved before its first
step): the optimizer comes back without state, as ``Optimizer.load_state_dict`` leaves a plain
optimizer restored by the core. It kept the moments of the steps taken since, and the steps
after the restore differed from those of a process that restored the same checkpoint fresh.
Two gloo ranks on CPU, FSDP2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import spawn_ranks
from torch_needs import needs_dcp


def worker(root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 1))
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        return m, torch.optim.AdamW(m.parameters(), lr=0.1)

    def train(m: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            g = torch.Generator().manual_seed(100 * step + rank)
            loss = m(torch.randn(4, 6, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    model, opt = build()
    state = {"train": Sharded(model, opt)}
    res: dict[str, object] = {}
    with Checkpointer(root, preemption=False) as ck:
        ck.save(1, state)  # before the optimizer's first step: saved without its state
        train(model, opt, range(2, 4))
        res["again"] = ck.restore(state)
        res["state_after"] = len(opt.state)
        res["losses"] = train(model, opt, range(2, 5))
    fresh, fresh_opt = build()
    with Checkpointer(root, resume=1, read_only=True) as ck:
        ck.restore({"train": Sharded(fresh, fresh_opt)})
    res["fresh_losses"] = train(fresh, fresh_opt, range(2, 5))
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(res))
    spawn_ranks.leave_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
@needs_dcp
def test_restoring_again_a_checkpoint_saved_before_the_first_step_drops_the_state(tmp_path):
    root, out = tmp_path / "ck", tmp_path / "out"
    argv = [sys.executable, __file__, str(root), str(out)]
    spawn_ranks.run(argv, 2, tmp_path, "again", zygote=spawn_ranks.shared_zygote())
    for rank in (0, 1):
        res = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert res["again"] == 1 and res["state_after"] == 0, res
        assert res["losses"] == res["fresh_losses"], res


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
