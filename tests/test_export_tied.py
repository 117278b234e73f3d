"""``resilient-ckpt export`` of a model with a tied weight (an embedding shared with the output
layer, as GPT-2's): the exported state dict has every name the module's ``state_dict`` has, so
``load_state_dict(strict=True)`` into a fresh model works and the weight stays tied, as with
DeepSpeed's ``zero_to_fp32.py``. At ZeRO 1-3 the tied weight is one parameter in the optimizer's
partitions, saved once: the export left its second name out."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("ds_tied_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # a DeepSpeed engine built and trained (imports alone take ~10 s)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_tied_weight_is_exported_under_each_name(tmp_path: Path, stage: int) -> None:
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(WORKER.parent))
    from ds_tied_worker import Tied

    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    run = [sys.executable, str(WORKER), str(tmp_path), str(stage)]
    subprocess.run(run, check=True, env=env, capture_output=True, timeout=300)
    out = tmp_path / "export"
    cli = [sys.executable, "-m", "resilient_callbacks", "export", str(tmp_path / "ck"), str(out)]
    subprocess.run(cli, check=True, capture_output=True, text=True)
    got = load_file(out / "model.safetensors")
    live = torch.load(tmp_path / "live.pt")
    assert sorted(got) == sorted(live)  # lm_head.weight too
    for k, v in live.items():
        assert torch.equal(got[k], v), k
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    incumbent = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
    assert sorted(incumbent) == sorted(got)
    for k, v in incumbent.items():
        assert torch.equal(got[k], v), k
    fresh = Tied()
    fresh.load_state_dict(got, strict=True)
    assert fresh.lm_head.weight is fresh.wte.weight  # still tied
    assert torch.equal(fresh.wte.weight, live["wte.weight"])
