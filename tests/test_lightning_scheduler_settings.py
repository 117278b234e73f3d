"""A Lightning run resumed from our checkpoint with an LR scheduler's settings changed in
``configure_optimizers`` (``CosineAnnealingLR``'s ``T_max``): Lightning loads the saved
scheduler states itself and takes the checkpoint's settings without a word, as its own
``ckpt_path`` resume does; the callback keeps that (nothing refused) and names each changed
setting, as the core's restore does for a plain ``Checkpointer`` state."""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import lightning_train  # noqa: E402

_ABOUT = "LR scheduler settings"  # (the warnings fit_warned returns)


class _Cosine(L.LightningModule):
    def __init__(self, t_max: int, set_in_train_start: bool = False) -> None:
        super().__init__()
        self.t_max = t_max
        self.set_in_train_start = set_in_train_start
        self.lin = torch.nn.Linear(4, 1)
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        self.lrs.append(self.optimizers().param_groups[0]["lr"])
        return self.lin(batch[0]).pow(2).mean()

    def on_train_start(self) -> None:  # the way the warning gives to take the new value
        if self.set_in_train_start:
            self.lr_schedulers().T_max = self.t_max

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.t_max)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _cosine_lrs(t_max: int, steps: range, new_t_max: int | None = None) -> list[float]:
    """The lrs of steps ``steps`` of a plain torch run with ``T_max=t_max``, set to
    ``new_t_max`` (if given) at the first of them."""
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
    out = []
    for i in range(steps.stop):
        if i == steps.start and new_t_max is not None:
            sched.T_max = new_t_max
        if i in steps:
            out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_a_changed_t_max_is_named_and_the_saved_one_schedules_on(tmp_path):
    """T_max 10, then 100: Lightning's restore loads T_max=10 over the new code's 100 (as its
    own ckpt_path resume does); it went unsaid. Now a warning names it, and the way on."""
    assert lightning_train.fit_warned(tmp_path, _Cosine(10), 4, _ABOUT) == []
    same = _Cosine(10)  # the same settings: nothing said
    assert lightning_train.fit_warned(tmp_path, same, 6, _ABOUT) == []
    changed = _Cosine(100)
    (said,) = lightning_train.fit_warned(tmp_path, changed, 8, _ABOUT)
    assert "lr_schedulers[0] (CosineAnnealingLR): T_max=10 from the checkpoint (100 here)" in said
    assert "set them on the scheduler in your LightningModule's on_train_start" in said
    assert changed.lr_schedulers().T_max == 10  # loaded as Lightning loads it: nothing refused
    assert changed.lrs == _cosine_lrs(10, range(6, 8))


def test_a_t_max_set_in_on_train_start_schedules_on_with_the_new_value(tmp_path):
    """The way the warning gives: on_train_start runs after Lightning's restore."""
    lightning_train.fit_warned(tmp_path, _Cosine(10), 4, _ABOUT)
    changed = _Cosine(100, set_in_train_start=True)
    (said,) = lightning_train.fit_warned(tmp_path, changed, 6, _ABOUT)
    assert "T_max=10 from the checkpoint (100 here)" in said
    assert changed.lr_schedulers().T_max == 100
    assert changed.lrs == _cosine_lrs(10, range(4, 6), new_t_max=100)
    assert changed.lrs != _cosine_lrs(10, range(4, 6))
