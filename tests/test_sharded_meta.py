"""``Sharded`` restored into an FSDP2 model built on the meta device (``torch.device("meta")``,
then ``fully_shard``, as torchtitan builds large models) that was not allocated yet: refused on
every rank before anything loads, as the core refuses a plain module on the meta device. It
reported the restored step and loaded nothing: a run that allocated and initialised the model
afterwards (``to_empty`` + ``reset_parameters``) trained on from fresh weights at that step.
Two gloo ranks on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import spawn_ranks
from torch_needs import needs_dcp


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def worker(root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded
    from resilient_callbacks.errors import CheckpointMismatchError

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def build(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        with torch.device(device):
            m = nn.Sequential(nn.Linear(6, 7), nn.BatchNorm1d(7), nn.Linear(7, 1))
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        return m, torch.optim.AdamW(m.parameters(), lr=0.1)

    model, opt = build("cpu")
    with Checkpointer(root, preemption=False) as ck:
        for _ in (1, 2):
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        ck.save(2, {"train": Sharded(model, opt)})
    res: dict[str, object] = {}
    fresh, fresh_opt = build("meta")
    try:
        with Checkpointer(root, preemption=False) as ck:
            res["step"] = ck.restore({"train": Sharded(fresh, fresh_opt)})
    except CheckpointMismatchError as e:
        res["error"] = str(e)
    try:  # (after a restore that loaded nothing, the optimizer holds meta tensors)
        fresh.to_empty(device="cpu")  # allocated: the same restore loads the checkpoint
        with Checkpointer(root, preemption=False) as ck:
            res["then"] = ck.restore({"train": Sharded(fresh, fresh_opt)})
        pairs = zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
        res["same"] = all(torch.equal(_full(a), _full(b)) for a, b in pairs)
    except Exception as e:
        res["then"] = f"{type(e).__name__}: {e}"
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(res))
    spawn_ranks.leave_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
@needs_dcp
def test_a_model_on_the_meta_device_is_refused_not_restored_in_silence(tmp_path):
    root, out = tmp_path / "ck", tmp_path / "out"
    argv = [sys.executable, __file__, str(root), str(out)]
    spawn_ranks.run(argv, 2, tmp_path, "meta", zygote=spawn_ranks.shared_zygote())
    for rank in (0, 1):
        res = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert "step" not in res, res  # it said 2 and loaded nothing
        assert "0.weight" in res["error"] and "on the meta device" in res["error"], res
        assert "(and 4 more)" in res["error"] and "to_empty" in res["error"], res  # the buffers
        assert res["then"] == 2 and res["same"], res


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
