"""``resilient-ckpt export --dtype {fp32,bf16,fp16}``: a ZeRO run's weights were written as their
fp32 masters only, twice the size of the bf16 model most users load. ``--dtype`` writes every
floating-point weight as the fp32 export cast to it (integer buffers as they are); the default
is unchanged (as saved)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from resilient_callbacks import Checkpointer
from test_cli import cli

ZERO2 = """
import sys, torch
import resilient_callbacks.deepspeed as rcds
from ds_noshm import skip_shm_op
skip_shm_op()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH, "every_n_steps": 2, "async_save": False}}
engine, *_ = rcds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
x = torch.randn(2, 4)
while engine.global_steps < 4:
    engine.backward(engine(x).pow(2).mean())
    engine.step()
engine.resilient_checkpoint.close()
"""


def _exports(root: str, tmp_path: Path) -> dict[str, dict[str, torch.Tensor]]:
    got = {}
    for dtype in (None, "fp32", "bf16", "fp16"):
        out = tmp_path / f"out-{dtype}"
        r = cli("export", root, str(out), *(["--dtype", dtype] if dtype else []))
        assert r.returncode == 0, r.stderr
        got[str(dtype)] = load_file(out / "model.safetensors")
    return got


def _assert_cast(got: dict[str, dict[str, torch.Tensor]], floats: torch.dtype) -> None:
    base = got["None"]
    assert any(v.dtype == floats for v in base.values())
    assert got["fp32"].keys() == base.keys()
    for name, to in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        assert got[name].keys() == base.keys()
        for k, v in base.items():
            want = v.to(to) if v.is_floating_point() else v
            assert got[name][k].dtype == want.dtype, (name, k)
            assert torch.equal(got[name][k], want), (name, k)


@pytest.mark.distributed
def test_zero2_export_dtype_is_the_fp32_export_cast(tmp_path: Path) -> None:
    from test_deepspeed import run_one_rank

    root = str(tmp_path / "ck")
    done = run_one_rank(tmp_path / "run.py", ZERO2.replace("DIRPATH", repr(root)))
    assert done.returncode == 0, done.stderr[-3000:]
    got = _exports(root, tmp_path)
    _assert_cast(got, torch.float32)
    assert got["None"]["1.num_batches_tracked"].dtype == torch.int64  # an integer buffer
    assert {v.dtype for k, v in got["bf16"].items() if "num_batches" not in k} == {torch.bfloat16}


def test_plain_module_export_dtype_casts_floats_and_keeps_integers(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model(torch.randn(3, 4))  # running stats and num_batches_tracked
    model[0].double()  # a float64 layer too: every float is cast
    with Checkpointer(root) as ck:
        ck.save(1, {"model": model})
    got = _exports(root, tmp_path)
    _assert_cast(got, torch.float64)
    assert got["fp16"]["1.num_batches_tracked"].dtype == torch.int64


def test_fp16_export_of_a_weight_beyond_its_range_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(1e6)  # fp16 ends at 65504: it would be inf
    with Checkpointer(root) as ck:
        ck.save(1, {"model": model})
    out = tmp_path / "out"
    r = cli("export", root, str(out), "--dtype", "fp16")
    assert r.returncode == 1 and not out.exists(), r.stdout + r.stderr
    assert "weight holds 1e+06, beyond fp16's largest value" in r.stderr, r.stderr
    assert cli("export", root, str(out), "--dtype", "bf16").returncode == 0


def test_an_unknown_dtype_is_a_usage_error(tmp_path: Path) -> None:
    r = cli("export", str(tmp_path), str(tmp_path / "out"), "--dtype", "int8")
    assert r.returncode == 2 and "invalid choice" in r.stderr, r.stderr


def test_trainer_export_dtype_writes_the_from_pretrained_weights_cast(tmp_path: Path) -> None:
    """A Trainer run's from_pretrained directory: ``--dtype bf16`` writes the weights of the
    default export cast to bf16, and ``from_pretrained`` loads them."""
    tt = pytest.importorskip("test_transformers")
    ck = tmp_path / "ck"
    tt._train(tmp_path, tt.ResilientCheckpoint(ck, every_n_steps=2), 2)
    outs = {}
    for dtype in (None, "bf16"):
        out = tmp_path / f"hf-{dtype}"
        r = cli("export", str(ck), str(out), *(["--dtype", dtype] if dtype else []))
        assert r.returncode == 0, r.stderr
        outs[dtype] = load_file(out / "model.safetensors")
    assert outs["bf16"].keys() == outs[None].keys()
    for k, v in outs[None].items():
        assert v.dtype == torch.float32 and torch.equal(outs["bf16"][k], v.to(torch.bfloat16)), k
    model = tt.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-bf16", torch_dtype="auto")
    assert model.dtype == torch.bfloat16
