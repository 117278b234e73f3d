"""``engine.load_checkpoint`` / ``engine.save_checkpoint`` on the section's directory (or
``rcds.attach``'s, whose refusal names attach's keywords, not a section).

DeepSpeed read our directory's advisory ``latest`` file (our newest checkpoint) as its own tag
and failed with a bare ``AssertionError``; now the load is refused with a message that says
where the restore already happened and how to pick another step. A DeepSpeed save into it is
said, once (it overwrites ``latest``); into another directory it is DeepSpeed's, unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from test_deepspeed import run_one_rank

SCRIPT = """
import torch, deepspeed
import resilient_callbacks.deepspeed as rcds
from resilient_callbacks import ConfigError
from ds_noshm import skip_shm_op
skip_shm_op()
deepspeed.init_distributed(dist_backend="gloo")
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH + "/ck", "every_n_steps": 1}}
engine, *_ = rcds.initialize(model=torch.nn.Linear(4, 1), config=cfg)
engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
engine.step()
try:
    engine.load_checkpoint(DIRPATH + "/ck/")
except ConfigError as e:
    print("REFUSED:", e)
engine.save_checkpoint(DIRPATH + "/ck")
engine.save_checkpoint(DIRPATH + "/ck")
engine.save_checkpoint(DIRPATH + "/ds")
print("LOADED OTHER:", engine.load_checkpoint(DIRPATH + "/ds")[0])
engine.resilient_checkpoint.close()
print("DEEPSPEED'S AGAIN:", not {"load_checkpoint", "save_checkpoint"} & set(vars(engine)))
handle = rcds.attach(engine, dirpath=DIRPATH + "/att")
try:
    engine.load_checkpoint(DIRPATH + "/att")
except ConfigError as e:
    print("REFUSED ATTACHED:", e)
handle.close()
"""


def test_deepspeeds_own_load_and_save_on_our_directory(tmp_path: Path) -> None:
    out = run_one_rank(tmp_path / "own.py", SCRIPT.replace("DIRPATH", repr(str(tmp_path))))
    assert out.returncode == 0, out.stderr[-3000:]
    refused = re.search(r"REFUSED: (.*)", out.stdout)
    assert refused, out.stdout + out.stderr[-3000:]
    assert "resilient_callbacks' checkpoint directory" in refused.group(1)
    assert "engine.global_steps is 1" in refused.group(1) and '"resume"' in refused.group(1)
    said = re.findall(r"own\.py:\d+: UserWarning: engine\.save_checkpoint", out.stderr)
    assert len(said) == 1, out.stderr[-3000:]  # once, at the user's call
    assert str(tmp_path / "ds") in out.stdout  # another directory: DeepSpeed's, as without us
    assert "DEEPSPEED'S AGAIN: True" in out.stdout
    # an engine checkpointed by rcds.attach: its keywords are named, not a section it lacks
    attached = re.search(r"REFUSED ATTACHED: (.*)", out.stdout)
    assert attached, out.stdout + out.stderr[-3000:]
    assert "rcds.attach()'s dirpath" in attached.group(1)
    assert "pass resume= to rcds.attach()" in attached.group(1)
    assert "section" not in attached.group(1)
