"""``dcp.Sharded`` resumed after the model or its optimizer changed between runs (FSDP2 on 2
gloo ranks; the ranks run this file's :func:`worker`). Each change is an exact resume or a
refusal before anything is loaded, naming the saved and the current value and what to do.

Found 2026-12-07, as a user would meet them:

- a buffer whose shape changed: every parameter was loaded, then ``load_state_dict`` raised
  torch's ``RuntimeError: size mismatch for scale`` (a half-restored model, a deep traceback);
- a buffer the model no longer has: the same, ``Unexpected key(s) in state_dict``;
- a buffer whose dtype changed: loaded, cast in silence (parameters of another dtype were
  refused, without saying what to do);
- ``StateDictOptions(strict=False)`` with the parameters split into other groups: restored,
  and the next ``step()`` raised ``KeyError: 'betas'`` (DCP's load gives each saved group's
  hyper-parameters to one group holding its parameters; the other was left without); a group
  of new parameters only was left the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import spawn_ranks
from torch_needs import needs_dcp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600), needs_dcp]


def _results(tmp_path: Path, sharding: str) -> dict:
    argv = [sys.executable, __file__, str(tmp_path), sharding]
    spawn_ranks.run(argv, 2, tmp_path, "changes", zygote=spawn_ranks.shared_zygote())
    ranks = [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys()
    return ranks[0]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return _results(tmp_path_factory.mktemp("changes"), "fsdp2")


def _refused(res: dict, case: str) -> str:
    got = res[case]
    assert got["error"] is not None, (case, got)
    assert got["error"].startswith("CheckpointMismatchError: "), (case, got["error"])
    assert got["changed"] == [], (case, got)  # refused before anything was loaded
    return got["error"]


def test_the_same_model_resumes_exactly(results):
    got = results["same"]
    assert got["error"] is None and got["step"] == 2, got
    assert got["values"] == results["saved_fp32"]
    assert got["stepped"] is True


@pytest.mark.parametrize(
    ("case", "saved", "now"), [("to_bf16", "F32", "BF16"), ("to_fp32", "BF16", "F32")]
)
def test_parameters_of_another_dtype_are_refused_saying_what_to_do(results, case, saved, now):
    said = _refused(results, case)
    assert f"model/0.weight: saved {saved} [7, 6], this model has {now} [7, 6]" in said
    assert "the dtype changed since the save" in said and "read_only=True" in said


def test_a_buffer_of_another_shape_or_dtype_is_refused_before_loading(results):
    said = _refused(results, "buffer_shape")
    assert "model/scale: saved F32 [3], this model has F32 [4]" in said
    said = _refused(results, "buffer_dtype")
    assert "model/scale: saved F32 [3], this model has F64 [3]" in said
    assert "the dtype changed since the save" in said


def test_a_buffer_the_model_lost_is_refused_unless_strict_is_false(results):
    said = _refused(results, "buffer_removed")
    assert "model/scale: in the checkpoint, not in this model/optimizer" in said
    got = results["buffer_removed_lenient"]
    assert got["error"] is None and got["step"] == 2 and got["stepped"] is True, got
    assert got["values"] == {k: v for k, v in results["saved_fp32"].items() if k != "model/scale"}


def test_lenient_restores_compare_the_optimizer_groups_on_the_saved_parameters(results):
    said = _refused(results, "groups_split_lenient")
    assert "parameter groups of [4] in the checkpoint, of [2, 2] here" in said
    said = _refused(results, "new_group_lenient")
    assert "parameter groups of [4] in the checkpoint, of [4, 0] here" in said
    assert "add_param_group" in said
    assert "new parameters go into a group" in said and "no longer has" not in said


def test_a_lenient_restore_of_a_model_that_lost_parameters_says_so(results):
    """The model lost a parameter (``2.bias``): the saved group counts it, the refusal said
    "new parameters go into a group that holds saved ones" (found 2026-12-07)."""
    said = _refused(results, "param_lost_lenient")
    assert "parameter groups of [4] in the checkpoint, of [3] here" in said
    assert "count 1 parameter(s) this model no longer has (2.bias)" in said, said
    assert "new parameters" not in said, said
    assert "scale" not in said, said


def test_a_lenient_restore_of_a_model_that_lost_a_parameter_and_a_buffer_tells_them_apart(
    results,
):
    """The model lost ``2.bias`` and the buffer ``scale``: the refusal counted ``scale`` among
    the "2 parameter(s) this model no longer has (2.bias, scale)" (found 2026-12-07). The
    checkpoint does not say which saved names were buffers; those with optimizer state were
    parameters, the others are named as saved tensors."""
    said = _refused(results, "param_buffer_lost_lenient")
    assert "parameter groups of [4] in the checkpoint, of [3] here" in said
    assert "count 1 parameter(s) this model no longer has (2.bias)" in said, said
    assert "1 saved tensor(s) this model no longer has (scale) without optimizer state" in said
    assert "new parameters" not in said, said


def test_a_lenient_restore_of_a_model_that_lost_a_buffer_and_regrouped_advises_on_groups(
    results,
):
    """The buffer ``scale`` lost and the groups split: the refusal named ``scale`` as a lost
    parameter and left out where parameters may go (found 2026-12-07)."""
    said = _refused(results, "buffer_removed_split_lenient")
    assert "parameter groups of [4] in the checkpoint, of [2, 2] here" in said
    assert "new parameters go into a group" in said and "parameter(s) this" not in said, said
    assert "1 saved tensor(s) this model no longer has (scale) without optimizer state" in said


def test_lenient_restores_load_new_parameters_in_a_saved_or_added_group(results):
    # new parameters in the saved group, or in a group added after the restore: loaded
    for case in ("new_param_lenient", "added_group_lenient"):
        got = results[case]
        assert got["error"] is None and got["step"] == 2 and got["stepped"] is True, (case, got)
        assert got["values"] == results["saved_fp32"], case


def test_optimizer_state_of_another_dtype_is_refused_saying_what_to_do(results):
    """bf16 parameters, the same optimizer class keeping its state in bf16 where the save kept
    fp32: refused, not cast; kept in fp32 as saved, it resumes exactly
    (:mod:`resilient_callbacks.dcp.state_dtypes`). Its 0-d ``scale`` (a tensor not sharded)
    came back rounded to bf16 by the optimizer's ``load_state_dict``: 1.0 for 1.0002."""
    said = _refused(results, "state_bf16")
    assert "optim/state/0.weight/m: saved F32 [7, 6], this model has BF16 [7, 6]" in said
    assert "the optimizer keeps this state in another dtype" in said
    said = _refused(results, "state_scale_bf16")  # (a 0-d state: it was loaded, cast)
    assert "optim/state/0.weight/scale: saved F32 [], this model has BF16 [] (the opt" in said
    got = results["state_fp32"]
    assert got["error"] is None and got["step"] == 2 and got["stepped"] is True, got
    assert got["values"]["optim/0.weight/scale"] == pytest.approx(1.0002, abs=1e-6)
    assert got["values"] == results["saved_moments"]


def test_fsdp1_read_directly_refuses_the_same_changes_before_loading(tmp_path):
    """FSDP1 (``use_orig_params=True``), restored without its ``set_state_dict``
    (:mod:`resilient_callbacks.dcp.flat_restore`): a buffer the model no longer has was
    dropped in silence; one of another dtype or shape was refused only after the rest of the
    state had been applied, and parameters of another dtype without saying what to do."""
    res = _results(tmp_path, "fsdp1")
    got = res["same"]
    assert got["error"] is None and got["step"] == 2 and got["stepped"] is True, got
    assert got["values"] == res["saved_fp32"]
    said = _refused(res, "to_bf16")
    assert "model/0.weight: saved F32 [7, 6], this model has BF16 [7, 6] (the dtype" in said
    said = _refused(res, "buffer_dtype")
    assert "model/scale: saved F32 [3], this model has F64 [3] (the dtype changed" in said
    said = _refused(res, "buffer_shape")
    assert "model/scale: saved F32 [3], this model has F32 [4]" in said
    said = _refused(res, "buffer_removed")
    assert "model/scale: in the checkpoint, not in this model/optimizer" in said


# ----------------------------------------------------------------------------- the ranks

_SHARDING = ["fsdp2"]  # (the worker's: fsdp2, or fsdp1 with use_orig_params=True)


class _Moments(torch.optim.Optimizer):
    """Momentum kept in ``state_dtype`` (an option of the optimizer, as low-precision ones have)."""

    def __init__(self, params, state_dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
        super().__init__(params, {"lr": 0.1})
        self.state_dtype = state_dtype
        self.scale_dtype = scale_dtype

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["scale"] = torch.tensor(1.0, dtype=self.scale_dtype)  # (0-d: plain)
                    state["step"] = torch.tensor(0.0)
                state["m"].mul_(0.9).add_(p.grad.to(self.state_dtype))
                state["scale"].mul_(1.0001)
                state["step"] += 1
                p.add_(state["m"].to(p.dtype), alpha=-group["lr"] * float(state["scale"]))


def _model(dtype: torch.dtype = torch.float32, change: str = "") -> torch.nn.Module:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5))
    m.register_buffer("scale", torch.full((3,), 2.0))
    if change == "buffer_shape":
        m.scale = torch.full((4,), 2.0)
    elif change in ("buffer_removed", "buffer_removed_split"):
        del m.scale
    elif change in ("param_lost", "param_buffer_lost"):  # (its state and group count: saved)
        m[2].register_parameter("bias", None)
        if change == "param_buffer_lost":
            del m.scale
    elif change == "new_param":
        m[2].register_parameter("spare", nn.Parameter(torch.ones(3)))
    m = m.to(dtype)
    if change == "buffer_dtype":
        m.scale = torch.full((3,), 2.0, dtype=torch.float64)
    if _SHARDING[0] == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrap = ModuleWrapPolicy({nn.Linear})
        return FSDP(m, auto_wrap_policy=wrap, device_id=torch.device("cpu"), use_orig_params=True)
    for layer in (m[0], m[2], m):
        fully_shard(layer)
    return m


def _nonzero(p: torch.Tensor) -> bool:
    """Whether the parameter (its whole, or under FSDP1 this rank's piece) is not all zero."""
    return bool((p.full_tensor() if hasattr(p, "full_tensor") else p).ne(0).any())


def _values(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.float().tolist() for k, v in msd.items() if "spare" not in k}
    for fqn, st in osd["state"].items():
        if "spare" not in fqn:
            out.update({f"optim/{fqn}/{k}": v.float().tolist() for k, v in st.items()})
    return out


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    dtype = next(m.parameters()).dtype
    m(torch.randn(8, 6, dtype=dtype)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _save(root: Path, dtype: torch.dtype, moments: bool = False) -> dict:
    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    m = _model(dtype)
    m.scale.fill_(5.0)  # (a restore that loads it is seen: the models are built with 2.0)
    opt: torch.optim.Optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
    if moments:
        opt = _Moments(m.parameters(), torch.float32, torch.float32)
    with Checkpointer(root, every_n_steps=1, preemption=False) as ck:
        for step in (1, 2):
            _train(m, opt, step)
            ck.step(step, {"train": Sharded(m, opt)})
    return _values(m, opt)


def _load(root: Path, case: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    bf16 = case == "to_bf16" or case.startswith("state_")
    dtype = torch.bfloat16 if bf16 else torch.float32
    change = case.removesuffix("_lenient")
    m = _model(dtype, "new_param" if "new" in change or "added" in change else change)
    params = dict(m.named_parameters())
    old = [p for n, p in params.items() if "spare" not in n]
    if case in ("groups_split_lenient", "buffer_removed_split_lenient"):
        opt = torch.optim.AdamW([{"params": old[:2]}, {"params": old[2:], "lr": 1e-3}])
    elif case in ("new_group_lenient", "added_group_lenient"):
        opt = torch.optim.AdamW([{"params": old}], lr=1e-2)
        if case == "new_group_lenient":
            opt.add_param_group({"params": [params["2.spare"]], "lr": 1e-3})
    elif case.startswith("state_"):
        fp32, bf16 = torch.float32, torch.bfloat16
        opt = _Moments(
            m.parameters(),
            bf16 if case == "state_bf16" else fp32,
            bf16 if case == "state_scale_bf16" else fp32,
        )
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    options = StateDictOptions(strict=not case.endswith("_lenient"))
    res: dict = {"error": None, "step": None, "stepped": False}
    try:
        with Checkpointer(root, preemption=False) as ck:
            res["step"] = ck.restore({"train": Sharded(m, opt, options=options)})
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["changed"] = sorted(n for n, p in params.items() if _nonzero(p))
    if getattr(m, "scale", None) is not None and bool(m.scale.ne(2).any()):
        res["changed"].append("scale")
    if res["error"] is None:
        if case == "added_group_lenient":  # the new parameters' own group, after the restore
            opt.add_param_group({"params": [params["2.spare"]], "lr": 1e-3})
        res["values"] = _values(m, opt)
        try:
            _train(m, opt, 3)
            res["stepped"] = True
        except Exception as e:  # (KeyError: 'betas', from a group left without it)
            res["stepped"] = f"{type(e).__name__}: {e}"
    return res


def worker(tmp: str, sharding: str) -> None:
    """Save two checkpoints (fp32 and bf16 parameters), then restore them into changed models."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = Path(tmp)
    _SHARDING[0] = sharding
    if sharding == "fsdp1":
        res = {"saved_fp32": _save(out / "fp32", torch.float32)}
        for case in ("same", "to_bf16", "buffer_dtype", "buffer_shape", "buffer_removed"):
            res[case] = _load(out / "fp32", case)
        (out / f"result.{dist.get_rank()}.json").write_text(json.dumps(res))
        spawn_ranks.leave_group()
    res = {
        "saved_fp32": _save(out / "fp32", torch.float32),
        "saved_bf16": _save(out / "bf16", torch.bfloat16),
        "saved_moments": _save(out / "moments", torch.bfloat16, moments=True),
    }
    cases = [
        "same",
        "to_bf16",
        "buffer_shape",
        "buffer_dtype",
        "buffer_removed",
        "buffer_removed_lenient",
        "groups_split_lenient",
        "new_group_lenient",
        "new_param_lenient",
        "added_group_lenient",
        "param_lost_lenient",
        "param_buffer_lost_lenient",
        "buffer_removed_split_lenient",
    ]
    for case in cases:
        res[case] = _load(out / "fp32", case)
    res["to_fp32"] = _load(out / "bf16", "to_fp32")
    for case in ("state_bf16", "state_scale_bf16", "state_fp32"):
        res[case] = _load(out / "moments", case)
    (out / f"result.{dist.get_rank()}.json").write_text(json.dumps(res))
    spawn_ranks.leave_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
