"""Lightning DDP on two CPU ranks (gloo): a resume with another ``limit_train_batches`` where
each rank's loader has a length of its own (``use_distributed_sampler=False``, a fraction of
it as the limit), so the resumed epoch's length differs between the ranks. Rank 0 alone
looked at its own: it said rank 0's length for every rank, and where the epoch was already
over on one rank only that rank raised, leaving the others training on into a collective.

The worker is this file: ``python test_rank_notices_lightning.py DIR MAX_STEPS LIMIT``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn


def worker(root: str, max_steps: int, limit: float) -> None:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    from resilient_callbacks.lightning import ResilientCheckpoint

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            n = 6 if self.global_rank == 0 else 12  # each rank's own loader
            return DataLoader(TensorDataset(torch.ones(n, 2)), batch_size=1)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        use_distributed_sampler=False,
        max_steps=max_steps,
        limit_train_batches=limit,
        callbacks=[ResilientCheckpoint(root, every_n_steps=2, async_save=False)],
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    # (each rank exits at once, its status its own: left to interpreter teardown with the
    # process group alive, a rank aborted there now and then under load, SIGABRT, as
    # spawn_ranks.leave_group says)
    try:
        trainer.fit(Model())
    except Exception as e:
        print(f"FIT FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(3)
    print(f"FIT DONE at step {trainer.global_step}", file=sys.stderr, flush=True)
    os._exit(0)


if __name__ == "__main__" and len(sys.argv) == 4:
    worker(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))


import pytest  # noqa: E402  (after the worker code, which does not need it)

import spawn_ranks  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def _run(tmp_path, name: str, max_steps: int, limit: float, expect: int) -> list[str]:
    argv = [sys.executable, __file__, str(tmp_path / "ckpt"), str(max_steps), str(limit)]
    return spawn_ranks.run(argv, 2, tmp_path, name, expect=expect, deadline=280).outputs


def _count(outputs: list[str], text: str) -> list[int]:
    return [sum(text in line for line in out.splitlines()) for out in outputs]


def test_an_epoch_length_that_differs_between_the_ranks_is_said_per_rank_or_refused_on_all(
    tmp_path,
):
    pytest.importorskip("lightning")
    _run(tmp_path, "first", 4, 1.0, 0)  # saved at step 4: 4 batches into epoch 0
    # 0.5: rank 0's epoch is 3 batches, over already; rank 1's is 6: every rank refuses
    outputs = _run(tmp_path, "refused", 8, 0.5, 3)
    shown = "\n".join(outputs)
    refused = "FIT FAILED: ConfigError: limit_train_batches=0.5 here, 1.0 when"
    assert _count(outputs, refused) == [1, 1], shown
    at = "the end of the epoch on rank 0 (an epoch of 3 batch(es) on rank 0, 6 batch(es) on rank 1)"
    assert _count(outputs, at) == [1, 1], shown
    # 0.9: an epoch of 5 batches on rank 0, 10 on rank 1: said once, naming each rank's
    outputs = _run(tmp_path, "said", 5, 0.9, 0)
    shown = "\n".join(outputs)
    said = "ends as an epoch of 5 batch(es) on rank 0, 10 batch(es) on rank 1"
    assert _count(outputs, said) == [1, 0], shown
    assert _count(outputs, "FIT DONE at step 5") == [1, 1], shown
