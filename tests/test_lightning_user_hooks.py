"""What a user's own Lightning hooks see when ``ResilientCheckpoint`` is added: their
``on_save_checkpoint`` runs once per save, as with Lightning's ``ModelCheckpoint`` (not for the
callback's preflight or its reading of the state ahead of the first save), and what they add
to the checkpoint is saved and restored.

In-process runs of a tiny model on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from resilient_callbacks import UnsupportedStateError, catalog
from resilient_callbacks.lightning import ResilientCheckpoint

pytestmark = pytest.mark.timeout(300)


class _Counting(L.LightningModule):
    """Counts its ``on_save_checkpoint`` calls and adds the count to the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.saved_at: list[int] = []
        self.loaded: list[int] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint):  # type: ignore[no-untyped-def]
        self.saved_at.append(self.global_step)
        checkpoint["saves_so_far"] = len(self.saved_at)

    def on_load_checkpoint(self, checkpoint):  # type: ignore[no-untyped-def]
        self.loaded.append(checkpoint["saves_so_far"])


class _CountingCallback(L.Callback):
    def __init__(self) -> None:
        self.saved_at: list[int] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):  # type: ignore[no-untyped-def]
        self.saved_at.append(trainer.global_step)


def _steps(ck: Path) -> list[int]:
    return [e.step for e in catalog.scan(str(ck), catalog.Depth.FULL) if e.manifest is not None]


def _fit(work: Path, module: L.LightningModule, *callbacks: L.Callback, max_steps: int = 4):  # type: ignore[no-untyped-def]
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4))
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
    )
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True))
    return trainer


def test_on_save_checkpoint_hooks_run_once_per_save_as_with_model_checkpoint(tmp_path):
    """The callback's preflight (at on_train_start) and the core's reading of the state to
    allocate the first save's buffers (at step 1) called every on_save_checkpoint hook: a
    user's hook that counts saves, logs or writes a file saw steps 0 and 1, never saved."""
    theirs, theirs_cb = _Counting(), _CountingCallback()
    mc = ModelCheckpoint(tmp_path / "mc", every_n_train_steps=2, save_top_k=-1)
    _fit(tmp_path / "a", theirs, theirs_cb, mc)
    ours, ours_cb = _Counting(), _CountingCallback()
    _fit(tmp_path / "b", ours, ours_cb, ResilientCheckpoint(tmp_path / "ck", every_n_steps=2))
    assert theirs.saved_at == theirs_cb.saved_at == [2, 4]
    assert ours.saved_at == ours_cb.saved_at == [2, 4]
    assert _steps(tmp_path / "ck") == [2, 4]
    # what the hook added is in the checkpoint (the save after the quiet read dumps again)
    again = _Counting()
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    _fit(tmp_path / "b", again, rc, max_steps=6)
    assert rc.restored_step == 4 and again.loaded == [2]


class _Unsaveable:
    pass


class _BadOnSave(L.Callback):
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):  # type: ignore[no-untyped-def]
        checkpoint["thing"] = _Unsaveable()


def test_a_value_an_on_save_checkpoint_hook_adds_that_cannot_be_saved_fails_the_first_save(
    tmp_path,
):
    """Not checked before training any more (that would call the hook): the first save
    raises, naming the entry, and commits nothing."""
    module = _Counting()
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    with pytest.raises(UnsupportedStateError, match=r"'thing'.*_Unsaveable"):
        _fit(tmp_path, module, _BadOnSave(), rc)
    assert module.global_step == 2
    assert not _steps(tmp_path / "ck")
