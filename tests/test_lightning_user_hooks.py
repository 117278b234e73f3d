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


class _Lora(L.LightningModule):
    """A frozen base whose weights its ``on_save_checkpoint`` leaves out of every checkpoint
    (as a LoRA/PEFT module does): only the adapter is saved."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(256, 256).requires_grad_(False)  # 257 KiB, never saved
        self.adapter = torch.nn.Linear(256, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.adapter(self.base(batch[0])).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.adapter.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint):  # type: ignore[no-untyped-def]
        for k in [k for k in checkpoint["state_dict"] if k.startswith("base.")]:
            del checkpoint["state_dict"][k]


class _HostBytes(L.Callback):
    def __init__(self, rc: ResilientCheckpoint) -> None:
        self.rc, self.seen = rc, []

    def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
        assert self.rc.checkpointer is not None
        self.seen.append(self.rc.checkpointer._saver.buffers.nbytes)


def test_no_host_buffers_ahead_for_what_an_on_save_checkpoint_hook_takes_out(tmp_path):
    """The read ahead of the first save leaves the hooks out, so it saw the frozen base the
    module's hook drops from every save, and allocated host buffers for all of it (on a GPU:
    pinned, kept by torch's host allocator) -- for a LoRA of a 7B model, 14 GB never copied
    into. Where a hook may change what a save holds, the first save allocates what it copies."""
    ds = torch.utils.data.TensorDataset(torch.randn(32, 256))
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=3)
    peek = _HostBytes(rc)
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        callbacks=[rc, peek],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Lora(), torch.utils.data.DataLoader(ds, batch_size=4))
    saved = peek.seen[-1]  # after the save at step 3: the adapter, its optimizer, RNG states
    assert 0 < saved < 256 * 256 * 4
    assert max(peek.seen) == saved, peek.seen
    for entry in catalog.scan(str(tmp_path / "ck"), catalog.Depth.FULL):
        assert entry.manifest is not None
        assert not [f.path for f in entry.manifest.files if "base." in f.path]

    class _NoHook(_Lora):
        on_save_checkpoint = L.LightningModule.on_save_checkpoint

    # without such a hook the buffers are made ahead (at step 1), the frozen base's included
    rc = ResilientCheckpoint(tmp_path / "ck2", every_n_steps=3)
    peek = _HostBytes(rc)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        callbacks=[rc, peek],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_NoHook(), torch.utils.data.DataLoader(ds, batch_size=4))
    assert peek.seen[1] > 256 * 256 * 4
