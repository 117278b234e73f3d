"""``Sharded(model, [optimizer_a, optimizer_b])`` where the second optimizer starts stepping
later (a head trained after a warm-up, a GAN's second player): FSDP2 on 2 gloo ranks, the
gradients set to None after each step (so DCP would give a stateless optimizer state with a
zero step). Adding the Checkpointer changes nothing, and a run killed and re-run ends as the
one not stopped."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer
from torch_needs import needs_dcp

B_FROM = 5  # the second optimizer's first step


def worker(root: str, out: str, total: int, mode: str) -> None:
    """One rank. ``mode``: ``none`` (no Checkpointer), ``ckpt`` (a save every 2 steps),
    ``die`` (the same, SIGKILLed right after the save of step 6 is committed)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from dcp_helpers import full_tensors
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    a = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    b = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    state = {"train": Sharded(model, [a, b])}
    losses: dict[int, str] = {}
    ck = Checkpointer(root, every_n_steps=2, preemption=False) if mode != "none" else None
    start = ck.restore(state) if ck is not None else 0
    for step in range(start + 1, total + 1):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        a.step()
        if step >= B_FROM:
            b.step()
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
        losses[step] = float(loss).hex()
        if ck is not None and ck.step(step, state, final=step == total):
            ck.flush()
            if mode == "die" and step == 6:
                os.kill(os.getpid(), signal.SIGKILL)
    if ck is not None:
        ck.close()
    final = full_tensors(model, a)
    final.update({f"b/{k}": v for k, v in full_tensors(model, b).items() if "optim" in k})
    Path(f"{out}.rank{rank}.json").write_text(
        json.dumps(
            {
                "start": start,
                "losses": losses,
                "final": {k: v.flatten().tolist() for k, v in final.items()},
            }
        )
    )
    spawn_ranks.leave_group()


@needs_dcp
@pytest.mark.slow  # suite time budget
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_second_optimizer_that_starts_later_is_not_given_state_and_resumes_exactly(tmp_path):
    """Saved before the second optimizer's first step, the Checkpointer asked DCP for both
    optimizers' state, and DCP's zero step gave the second one state: its step count, and so
    its bias correction, differed from the run without the Checkpointer from step 5 on. Now
    the run with the Checkpointer is the run without it, and killed after step 6 and re-run it
    ends the same."""

    def run(name: str, mode: str, where: str, expect: int = 0) -> list[dict[str, Any]]:
        argv = [sys.executable, __file__, str(tmp_path / where), str(tmp_path / name), "8", mode]
        spawn_ranks.run(argv, 2, tmp_path, f"{name}-{mode}", expect=expect)
        if expect:
            return []
        return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]

    plain = run("plain", "none", "unused")
    with_ck = run("ck", "ckpt", "a")
    for p, c in zip(plain, with_ck, strict=True):
        assert c["losses"] == p["losses"]
        assert c["final"] == p["final"]
    run("killed", "die", "b", expect=-9)
    again = run("again", "ckpt", "b")
    assert again[0]["start"] == 6
    for p, c in zip(plain, again, strict=True):
        assert {s: v for s, v in p["losses"].items() if int(s) > 6} == c["losses"]
        assert c["final"] == p["final"]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
