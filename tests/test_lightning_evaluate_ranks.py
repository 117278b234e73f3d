"""``trainer.test(ckpt_path=...)`` with two DDP ranks (gloo, CPU) where the checkpoint directory
of ours is there for rank 0 only (a node-local path): every rank decides alike whether it is
ours, so no rank enters the read-only Checkpointer's collectives alone."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer

pytestmark = pytest.mark.timeout(300)

_TEST_ON_TWO_RANKS = """
import os, sys
import lightning as L
import torch
from resilient_callbacks.lightning import ResilientCheckpoint

work, ckpt = sys.argv[1:]
os.chdir(os.path.join(work, "rank" + os.environ["RANK"]))  # each rank's "node"


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.lin(batch[0]).pow(2).mean())


data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
    enable_model_summary=False, default_root_dir=work,
    callbacks=[ResilientCheckpoint(dirpath=os.path.join(work, "fit"))],
)
try:
    trainer.test(Net(), dataloaders=data, ckpt_path=ckpt)
except Exception as e:
    print("FAILED", type(e).__name__, e, flush=True)  # (exit 0: no rank is killed early)
else:
    print("TESTED", flush=True)
"""


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_a_checkpoint_of_ours_on_one_rank_only_is_refused_on_every_rank(tmp_path):
    """Rank 0's node has the checkpoint directory (with its manifest), rank 1's has nothing at
    that path. Rank 0 took it as ours and opened the collective read-only Checkpointer, rank 1
    gave it to Lightning's loader: rank 0 waited in a collective rank 1 never joined (a hang,
    or rank 1's FileNotFoundError while rank 0 hung). Now both ranks raise the same
    CheckpointNotFoundError naming the rank that lacks it."""
    with Checkpointer(tmp_path / "rank0" / "ck", keep_last=2) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 1)})
    (name,) = [n for n in os.listdir(tmp_path / "rank0" / "ck") if n.startswith("step_")]
    (tmp_path / "rank1").mkdir()
    out = spawn_ranks.run(
        [sys.executable, "-c", _TEST_ON_TWO_RANKS, str(tmp_path), f"ck/{name}"],
        2,
        tmp_path,
        "evaluate_ranks",
        expect=None,
        deadline=200.0,  # (a hang fails the test)
        tail=3000,
    )
    for rank, text in enumerate(out.outputs):
        said = [ln for ln in text.splitlines() if ln.startswith("FAILED")]
        assert said, f"rank {rank}: {text[-3000:]}"
        assert "CheckpointNotFoundError" in said[0], f"rank {rank}: {text[-3000:]}"
        assert "on rank(s) [0] but not on rank(s) [1]" in said[0], f"rank {rank}: {said}"
    assert out.codes == [0, 0], out.outputs
