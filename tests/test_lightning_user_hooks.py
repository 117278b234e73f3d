"""What a user's own Lightning hooks see when ``ResilientCheckpoint`` is added: their
``on_save_checkpoint`` runs once per save, as with Lightning's ``ModelCheckpoint`` (not for the
callback's preflight or its reading of the state ahead of the first save), and what they add
to the checkpoint is saved and restored.

In-process runs of a tiny model on the CPU.
"""

from __future__ import annotations

import threading
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


def _host_bytes_each_batch(
    tmp_path: Path, name: str, module: L.LightningModule, max_steps: int
) -> list[int]:
    """The host buffers' bytes after each batch of a fit of ``module`` saving every 3 steps."""
    rc = ResilientCheckpoint(tmp_path / name, every_n_steps=3)
    peek = _HostBytes(rc)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        callbacks=[rc, peek],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    ds = torch.utils.data.TensorDataset(torch.randn(32, 256))
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=4))
    return peek.seen


def test_no_host_buffers_ahead_for_what_an_on_save_checkpoint_hook_takes_out(tmp_path):
    """The read ahead of the first save leaves the hooks out, so it saw the frozen base the
    module's hook drops from every save, and allocated host buffers for all of it (on a GPU:
    pinned, kept by torch's host allocator) -- for a LoRA of a 7B model, 14 GB never copied
    into. Where a hook may change what a save holds, the first save allocates what it copies."""
    seen = _host_bytes_each_batch(tmp_path, "ck", _Lora(), max_steps=4)
    saved = seen[-1]  # after the save at step 3: the adapter, its optimizer, RNG states
    assert 0 < saved < 256 * 256 * 4
    assert max(seen) == saved, seen
    for entry in catalog.scan(str(tmp_path / "ck"), catalog.Depth.FULL):
        assert entry.manifest is not None
        assert not [f.path for f in entry.manifest.files if "base." in f.path]

    class _NoHook(_Lora):
        on_save_checkpoint = L.LightningModule.on_save_checkpoint

    # without such a hook the buffers are made ahead (at step 1), the frozen base's included
    assert _host_bytes_each_batch(tmp_path, "ck2", _NoHook(), max_steps=2)[1] > 256 * 256 * 4


def _saved_by_another_thread_during_a_quiet_read(tmp_path: Path, trainer: L.Trainer) -> dict:  # type: ignore[type-arg]
    """``trainer.save_checkpoint`` on this thread while another thread is inside a quiet read
    (the preflight of another fit in the process); what the save wrote."""
    from resilient_callbacks.lightning import quiet

    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def held_open() -> dict:  # type: ignore[type-arg]
        entered.set()
        assert release.wait(60)
        return {}

    def other() -> None:
        try:
            with quiet.preflight():
                quiet.dump_fn(held_open, trainer)()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            entered.set()

    t = threading.Thread(target=other)
    t.start()
    try:
        assert entered.wait(60)
        trainer.save_checkpoint(tmp_path / "real.ckpt")
    finally:
        release.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    return torch.load(tmp_path / "real.ckpt", weights_only=False)


def test_a_quiet_read_on_another_thread_leaves_a_real_save_its_hooks(tmp_path):
    """The quiet read swapped Lightning's module-level hook helpers for the whole process: a
    real save on another thread meanwhile (another Trainer of the process) ran none of its
    on_save_checkpoint hooks, and saved without what they add."""
    module, cb = _Counting(), _CountingCallback()
    trainer = _fit(tmp_path, module, cb, max_steps=1)
    before = len(module.saved_at)  # (Lightning's default ModelCheckpoint saved at the end)
    saved = _saved_by_another_thread_during_a_quiet_read(tmp_path, trainer)
    assert len(module.saved_at) == len(cb.saved_at) == before + 1
    assert saved["saves_so_far"] == before + 1


def test_quiet_reads_that_end_out_of_order_leave_the_hooks_running(tmp_path):
    """Two threads' quiet reads, overlapping, the first ending first: the second put back the
    first's hook-less helpers, and no on_save_checkpoint hook ran again in the process."""
    from resilient_callbacks.lightning import quiet

    module, cb = _Counting(), _CountingCallback()
    trainer = _fit(tmp_path, module, cb, max_steps=1)
    before = len(module.saved_at)  # (Lightning's default ModelCheckpoint saved at the end)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def read(entered: threading.Event, wait_for: threading.Event) -> dict:  # type: ignore[type-arg]
        entered.set()
        assert wait_for.wait(60)
        return {}

    def first() -> None:
        try:
            with quiet.preflight():
                quiet.dump_fn(lambda: read(first_in, second_in), trainer)()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            first_out.set()

    def second() -> None:
        try:
            assert first_in.wait(60)
            with quiet.preflight():
                quiet.dump_fn(lambda: read(second_in, first_out), trainer)()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            second_in.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert len(module.saved_at) == len(cb.saved_at) == before + 1
    saved = torch.load(tmp_path / "after.ckpt", weights_only=False)
    assert saved["saves_so_far"] == before + 1
