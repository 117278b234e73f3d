"""``exit_on_preemption=False`` under Lightning: ``fit()`` returns after the emergency
checkpoint, and the run goes on from it exactly -- in a new process, or by ``fit()`` again on
the same Trainer (not counted as a finished fit, which a next ``fit()`` goes on from live with
fresh optimizers). In-process runs of a tiny model on the CPU, a real SIGUSR1."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from resilient_callbacks.lightning import ResilientCheckpoint

pytestmark = pytest.mark.timeout(300)


class _SignalOnce(L.Callback):
    """A real SIGUSR1 to this process during step ``step + 1``."""

    def __init__(self, step: int) -> None:
        self.step, self.armed = step, True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.armed and trainer.global_step == self.step:
            self.armed = False
            os.kill(os.getpid(), signal.SIGUSR1)


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=0.1)  # (fresh moments would show)


def _loader() -> torch.utils.data.DataLoader:
    data = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data), batch_size=4, shuffle=True
    )


def _trainer(work: Path, *callbacks: L.Callback) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=12,
        callbacks=list(callbacks),
        default_root_dir=work,
    )


@pytest.mark.parametrize("again_in", ["a new process", "the same trainer"])
def test_a_preempted_fit_goes_on_exactly_from_its_emergency_checkpoint(tmp_path, again_in):
    L.seed_everything(0)
    plain = _Net()
    _trainer(tmp_path / "plain").fit(plain, _loader())

    L.seed_everything(0)
    module = _Net()
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100, exit_on_preemption=False)
    trainer = _trainer(tmp_path, rc, _SignalOnce(2))
    trainer.fit(module, _loader())
    assert rc.preempted and trainer.global_step == 3
    if again_in == "a new process":
        module, rc = _Net(), ResilientCheckpoint(tmp_path / "ck", every_n_steps=100)
        trainer = _trainer(tmp_path, rc)
    trainer.fit(module, _loader())
    assert rc.restored_step == 3 and trainer.global_step == 12
    assert torch.equal(module.lin.weight, plain.lin.weight)
    assert torch.equal(module.lin.bias, plain.lin.bias)
