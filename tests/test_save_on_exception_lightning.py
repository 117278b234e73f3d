"""Lightning's ``save_on_exception`` with manual optimization: an exception after the weights
were written in place within a step that did not finish (a SAM-style ``first_step()``, the
user's own write after ``manual_backward``) saves nothing, said in the log; an exception that
changed no weight saves the last completed step, its weights those a periodic save of it holds."""

from __future__ import annotations

import os

import lightning as L
import pytest
import safetensors.torch
import torch

from features_train import SAM
from resilient_callbacks.lightning import ResilientCheckpoint
from test_exceptions_in_training import _committed, fit_8_steps


class Boom(RuntimeError):
    pass


class _StepSAM(SAM):
    """SAM whose ``step()`` is its second pass, as Lightning's manual ``opt.step()`` calls it."""

    def step(self, closure=None):
        if closure is not None:
            closure()
        self.second_step()


class _TwoPass(L.LightningModule):
    """Manual optimization, two passes per step; raises ``Boom`` at step ``fail_at`` (1-based)
    at ``where``: ``"backward"`` (after manual_backward, nothing written), ``"write"`` (after
    manual_backward and an in-place write of a weight; ``"replace"``: ``p.data = t``),
    ``"first_step"`` (between the two passes)."""

    def __init__(self, fail_at: int = 0, where: str = "") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lin = torch.nn.Linear(4, 1)
        self.fail_at, self.where = fail_at, where

    def _fail(self, where: str) -> None:
        if self.global_step + 1 == self.fail_at and self.where == where:
            raise Boom(where)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.lin(batch[0]).pow(2).mean())
        self._fail("backward")
        if self.global_step + 1 == self.fail_at and self.where in ("write", "replace"):
            w = self.lin.weight
            if self.where == "replace":
                w.data = w.data.clamp(-0.01, 0.01)  # (a new tensor: its address tells)
            else:
                with torch.no_grad():
                    w.clamp_(-0.01, 0.01)
            self._fail(self.where)
        opt.first_step()
        opt.zero_grad()
        self._fail("first_step")
        self.manual_backward(self.lin(batch[0]).pow(2).mean())
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return _StepSAM(self.parameters(), torch.optim.SGD, lr=0.1)


def _fit(root, every: int = 2, **failing) -> None:
    L.seed_everything(0, verbose=False)  # (before the module's weights are drawn)
    module = _TwoPass(**failing)
    rc = ResilientCheckpoint(  # (synchronous: no due save skipped while one is being written)
        root, every_n_steps=every, save_on_exception=True, preemption=False, async_save=False
    )
    fit_8_steps(module, rc)


def _tensors(root, step: int) -> dict[str, torch.Tensor]:
    d = os.path.join(root, f"step_{step:09d}")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            out.update(safetensors.torch.load_file(os.path.join(d, name)))
    return out


@pytest.mark.parametrize("where", ["first_step", "write", "replace"])
def test_an_in_place_write_in_a_step_that_did_not_finish_saves_nothing(tmp_path, where, caplog):
    """The callback watched only ``optimizer.step()``: a write before it (SAM's first pass, the
    user's own) left moved weights, saved as step 5's in an emergency checkpoint."""
    with pytest.raises(Boom):
        _fit(tmp_path / "ck", fail_at=6, where=where)
    assert _committed(tmp_path / "ck") == [(2, "periodic"), (4, "periodic")]
    assert "lin.weight was written in place since step 5" in caplog.text
    # (what to do: a write of the user's own is saved with its step after the optimizer's)
    assert "after the optimizer's step: in on_train_batch_end" in caplog.text
    assert "Boom during training: saving" not in caplog.text


def test_an_exception_after_the_backward_pass_saves_the_last_step_as_a_save_of_it(tmp_path):
    _fit(tmp_path / "ref", every=1)
    with pytest.raises(Boom):
        _fit(tmp_path / "ck", fail_at=6, where="backward")
    assert _committed(tmp_path / "ck")[-1] == (5, "emergency")
    saved, ref = _tensors(tmp_path / "ck", 5), _tensors(tmp_path / "ref", 5)
    assert saved.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(saved[k], ref[k])] == []
