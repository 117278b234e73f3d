"""Training that fails by an exception, not by a kill: an error raised part-way through an
optimizer's update, a KeyboardInterrupt (Ctrl-C) at any point of our own code. Whatever the
point, the directory holds only committed, verifying checkpoints, nothing stays locked, and a
re-run resumes from the newest committed one. Injections are deterministic (chosen points,
no timing)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from resilient_callbacks import catalog
from resilient_callbacks.catalog import Depth
from resilient_callbacks.lightning import ResilientCheckpoint
from resilient_callbacks.optim import update_began


def _committed(root) -> list[tuple[int, str]]:
    return [
        (e.step, e.manifest.reason)
        for e in catalog.scan(str(root), Depth.FULL)
        if e.manifest is not None and str(e.status) == "valid"
    ]


@pytest.mark.parametrize("how", ["keyword", "positional", "none"])
def test_the_update_counts_as_begun_once_the_closure_returned(how):
    """``step(closure)`` evaluates the closure (forward, backward) before it updates anything:
    an exception in it leaves the weights as they were. ``args`` of a step pre-hook are
    ``step()``'s own, the optimizer first."""
    lin = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    began: list[bool] = []
    handle = opt.register_step_pre_hook(update_began(lambda: began.append(True)))

    def closure(fail: bool):
        def run():
            assert not began  # (nothing marked before the closure ran)
            if fail:
                raise RuntimeError("out of memory in the forward pass")
            opt.zero_grad()
            loss = lin(torch.ones(1, 2)).sum()
            loss.backward()
            return loss

        return run

    def step(fail: bool) -> None:
        if how == "keyword":
            opt.step(closure=closure(fail))
        elif how == "positional":
            opt.step(closure(fail))
        else:
            if fail:
                raise RuntimeError("out of memory in the forward pass")
            closure(False)()
            opt.step()

    with pytest.raises(RuntimeError):
        step(fail=True)
    assert began == []
    step(fail=False)
    assert began == [True]
    handle.remove()


class _TornSGD(torch.optim.SGD):
    """SGD whose ``fail_at``-th step raises part-way through its update: after the closure (the
    forward and backward) and after the first parameter changed, as an out-of-memory error in
    the middle of a step does."""

    fail_at = 0
    calls = 0

    def step(self, closure=None):
        type(self).calls += 1
        if type(self).calls != self.fail_at:
            return super().step(closure)
        if closure is not None:
            closure()
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(100.0)
        raise RuntimeError("out of memory in the middle of the update (simulated)")


class _Module(L.LightningModule):
    def __init__(self, fail_forward_at: int = 0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.fail_forward_at = fail_forward_at

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.fail_forward_at:
            raise RuntimeError("a NaN check in the forward pass (simulated)")
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return _TornSGD(self.parameters(), lr=0.1)


def _fit(root, module: _Module) -> ResilientCheckpoint:
    L.seed_everything(0, verbose=False)
    rc = ResilientCheckpoint(root, every_n_steps=2, save_on_exception=True, preemption=False)
    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        callbacks=[rc],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)))
    trainer.fit(module, DataLoader(data, batch_size=4))
    return rc


@pytest.fixture
def torn_at(monkeypatch):
    def at(n: int) -> None:
        monkeypatch.setattr(_TornSGD, "calls", 0)
        monkeypatch.setattr(_TornSGD, "fail_at", n)

    return at


def test_lightning_saves_nothing_after_an_update_that_raised_part_way(tmp_path, torn_at, caplog):
    """The callback watched optimizer steps with a post-hook, which a step that raised in its
    update never reaches: the half-updated weights were saved as the step before (an emergency
    checkpoint the re-run resumed from, its weights off by 100)."""
    torn_at(5)  # the update of step 5 raises
    module = _Module()
    with pytest.raises(RuntimeError, match="middle of the update"):
        _fit(tmp_path / "ck", module)
    assert _committed(tmp_path / "ck") == [(2, "periodic"), (4, "periodic")]
    assert "began updating the weights" in caplog.text
    torn_at(0)
    rc = _fit(tmp_path / "ck", _Module())
    assert rc.restored_step == 4


def test_lightning_saves_the_last_step_after_an_error_in_the_forward_pass(tmp_path, torn_at):
    """The forward and backward run inside the closure Lightning hands ``optimizer.step()``:
    an exception there changed no weight, and the last completed step is saved."""
    torn_at(0)
    with pytest.raises(RuntimeError, match="NaN check"):
        _fit(tmp_path / "ck", _Module(fail_forward_at=6))
    assert _committed(tmp_path / "ck")[-1] == (5, "emergency")
