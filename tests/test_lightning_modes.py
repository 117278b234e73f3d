"""``ResilientCheckpoint`` in the Trainer's other modes: a debugging ``fast_dev_run``.

In-process runs of a tiny model on the CPU; a stop is an exception at the start of a batch
(no emergency save), the re-run a new module and Trainer in the same directory.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from resilient_callbacks import catalog
from resilient_callbacks.lightning import ResilientCheckpoint

pytestmark = pytest.mark.timeout(300)


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.net(batch[0]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(work: Path, callbacks: list, **trainer_kwargs) -> tuple[_Net, L.Trainer]:  # type: ignore[no-untyped-def]
    L.seed_everything(0, verbose=False)
    module = _Net()
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    )
    kwargs = dict(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
    )
    trainer = L.Trainer(callbacks=callbacks, **{**kwargs, **trainer_kwargs})
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    return module, trainer


def _steps(ck: Path) -> list[int]:
    return [e.step for e in catalog.scan(str(ck), catalog.Depth.FULL) if e.manifest is not None]


def test_a_fast_dev_run_neither_saves_nor_resumes(tmp_path):
    """Lightning's ``fast_dev_run`` ("Logging and checkpointing is suppressed") trains one batch
    to check the code: ModelCheckpoint saves nothing then. Found 2026-12-06: ours saved that
    batch's step, and the real run started next in the directory resumed from the debug run's
    step 1 (not the run without the callback); a ``fast_dev_run`` after a real run resumed it
    and raised ("You restored a checkpoint with current_epoch=2, but you have set
    Trainer(max_epochs=1)")."""
    ck = tmp_path / "ck"
    plain, _ = _fit(tmp_path / "plain", [])
    _, trainer = _fit(tmp_path, [ResilientCheckpoint(ck, every_n_steps=1)], fast_dev_run=True)
    assert trainer.global_step == 1 and _steps(ck) == []
    rc = ResilientCheckpoint(ck, every_n_steps=3)
    real, _ = _fit(tmp_path, [rc])
    assert rc.restored_step is None and real.losses == plain.losses
    saved = _steps(ck)
    assert saved[-1] == 16
    rc = ResilientCheckpoint(ck, every_n_steps=1)
    again, trainer = _fit(tmp_path, [rc], fast_dev_run=2)
    assert rc.restored_step is None and trainer.global_step == 2
    assert again.losses == plain.losses[:2] and _steps(ck) == saved
