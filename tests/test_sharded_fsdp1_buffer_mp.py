"""``dcp.Sharded`` under FSDP1 read directly, with mixed precision that casts the buffers
(``MixedPrecision(buffer_dtype=torch.bfloat16)``; 2 gloo ranks run this file's :func:`worker`).

FSDP1 casts the buffers to ``buffer_dtype`` when it first runs (a forward, or its state dict),
and its sharded state dict -- what DCP saves, and what the direct read reads -- holds them in
that dtype. Found 2026-12-07: such a run resumed in a fresh process, whose buffers FSDP1 has
not cast yet, was refused when read directly -- "model/scale: saved BF16 [3], this model has
F32 [3] (the dtype changed since the save ...)" -- although the model was the one saved. Both
dtypes of such a buffer now fit (the copy casts, as FSDP1 would); through FSDP1's state dict
(``use_orig_params=False``) it already resumed.

Moved to FSDP2 (docs/fsdp.md: a checkpoint moves between FSDP1 and FSDP2), whose buffers stay
as built (F32), the same checkpoint was refused too, since a233d4c checked the dtypes of the
tensors saved whole: "model/scale: saved BF16 [3], this model has F32 [3]". A buffer saved BF16
or F16 now loads into a live F32 or F64 one of the same shape by a cast (logged); a narrowing
change (BF16 saved, F16 now) is still refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import spawn_ranks
from torch_needs import needs_dcp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300), needs_dcp]


@pytest.mark.parametrize("orig_params", ["1", "0"])  # read directly; FSDP1's state dict
def test_fsdp1_buffers_cast_by_mixed_precision_resume(tmp_path, orig_params):
    argv = [sys.executable, __file__, str(tmp_path), orig_params]
    spawn_ranks.run(argv, 2, tmp_path, "buffer_mp", zygote=spawn_ranks.shared_zygote())
    for r in range(2):
        res = json.loads((tmp_path / f"result.{r}.json").read_text())
        assert res["live_dtype"] == "torch.bfloat16"  # (FSDP1 did cast the buffer)
        assert res["saved_dtypes"] == ["BF16", "BF16"], res  # (FSDP1's state dict casts first)
        for case in ("fresh", "again", "early_fresh", "early_again"):
            assert res[case]["error"] is None, res[case]
            step, scale = (1, [2.0] * 3) if case.startswith("early") else (3, res["scale"])
            assert res[case]["step"] == step and res[case]["scale"] == scale, res[case]
        # FSDP1 -> FSDP2: the BF16 buffer into FSDP2's F32 one (cast), or a F16 one (refused)
        assert res["fsdp2"] == {"error": None, "step": 3, "scale": res["scale"]}, res["fsdp2"]
        assert res["fsdp2_dtype"] == "torch.float32"
        said = res["fsdp2_f16"]["error"]
        assert said.startswith("CheckpointMismatchError: "), said
        assert "model/scale: saved BF16 [3], this model has F16 [3] (the dtype changed" in said
        assert res["fsdp2_f16"]["scale"] == [2.0] * 3  # (nothing loaded)


_ORIG_PARAMS = [True]


def _model(fsdp2: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP1 with buffer mixed precision; ``fsdp2``: the same model under FSDP2, its buffer
    built in that dtype."""
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class Scaled(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.scale.mul_(1.5)  # (a buffer that training changes, in bf16)
            return super().forward(x) * self.scale.sum()

    torch.manual_seed(0)
    m = Scaled(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5))
    m.register_buffer("scale", torch.full((3,), 2.0, dtype=fsdp2 or torch.float32))
    if fsdp2 is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(m[0])
        fully_shard(m[2])
        return fully_shard(m)
    mixed = MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
    )
    return FSDP(
        m,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        device_id=torch.device("cpu"),
        use_orig_params=_ORIG_PARAMS[0],
        mixed_precision=mixed,
    )


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    m(torch.randn(8, 6)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _restore(root: Path, m: torch.nn.Module, opt: torch.optim.Optimizer, at: int = 3) -> dict:
    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    res: dict = {"error": None}
    try:
        with Checkpointer(root, preemption=False, resume=at) as ck:
            res["step"] = ck.restore({"train": Sharded(m, opt)})
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["scale"] = m.scale.float().tolist()
    return res


def worker(tmp: str, orig_params: str) -> None:
    import torch.distributed as dist

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")
    _ORIG_PARAMS[0] = orig_params == "1"
    root = Path(tmp) / "ck"
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    state = {"train": Sharded(m, opt)}
    res: dict = {}
    res["saved_dtypes"] = []
    with Checkpointer(root, preemption=False) as ck:
        for step in (1, 2, 3):
            if step > 1:
                _train(m, opt, step)
            if step != 2:  # before the first forward (the buffers as built: fp32), and after
                ck.save(step, state)
                ck.flush()
                said = json.loads((Path(ck.checkpoints()[-1].path) / "manifest.json").read_text())
                (part,) = said["extra"]["parts"].values()
                res["saved_dtypes"].append(part["plain"]["model/scale"][0])
    res["live_dtype"] = str(m.scale.dtype)
    res["scale"] = m.scale.float().tolist()
    res["again"] = _restore(root, m, opt)  # the same model, after its forwards
    fresh = _model()
    res["fresh"] = _restore(root, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    res["early_again"] = _restore(root, m, opt, at=1)  # saved fp32, the model now bf16
    fresh = _model()
    res["early_fresh"] = _restore(root, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), 1)
    fresh = _model(fsdp2=torch.float32)
    res["fsdp2"] = _restore(root, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    res["fsdp2_dtype"] = str(fresh.scale.dtype)
    fresh = _model(fsdp2=torch.float16)
    res["fsdp2_f16"] = _restore(root, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    (Path(tmp) / f"result.{dist.get_rank()}.json").write_text(json.dumps(res))
    spawn_ranks.leave_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
