"""``trainer.validate()``/``test()`` after a ``fit()`` with ``ResilientCheckpoint`` and no
``ModelCheckpoint``: Lightning's ``"best"`` (its default when no model is given) is this
callback's checkpoint -- the newest, or the best by ``monitor`` -- loaded verified, as the
default ``ModelCheckpoint``'s file would be; a checkpoint directory of ours given as
``ckpt_path`` loads too. In-process runs of a tiny model on the CPU."""

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
        self.lin = torch.nn.Linear(4, 1)
        self.loaded_steps: list[int] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.lin(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        # best mid-run by construction (the training loss's minimum depends on the init)
        self.log("val_loss", float((self.global_step - 3) ** 2))

    def test_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("test_loss", self.lin(batch[0]).pow(2).mean())

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.3)

    def on_load_checkpoint(self, checkpoint):  # type: ignore[no-untyped-def]
        self.loaded_steps.append(checkpoint["global_step"])


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g)), batch_size=4
    )


def _trainer(work: Path, *callbacks: L.Callback, **kw) -> L.Trainer:  # type: ignore[no-untyped-def]
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
        callbacks=list(callbacks),
        **kw,
    )


def test_test_and_validate_after_fit_load_the_newest_checkpoint(tmp_path):
    """It raised "ModelCheckpoint is not configured to save the best model"."""
    module = _Net()
    trainer = _trainer(tmp_path, ResilientCheckpoint(tmp_path / "ck", every_n_steps=2), max_steps=6)
    trainer.fit(module, _loader())
    expected = trainer.test(module, _loader(), verbose=False)  # the weights in memory: step 6
    with torch.no_grad():
        module.lin.weight.zero_()  # so only a load gives the trained weights back
    with pytest.warns(UserWarning, match="best model of the previous `fit` call"):
        got = trainer.test(dataloaders=_loader(), verbose=False)
    assert got == expected and module.loaded_steps == [6]
    assert trainer.validate(dataloaders=_loader(), verbose=False)
    assert module.loaded_steps == [6, 6]


def test_best_is_the_best_checkpoint_by_monitor_and_a_path_of_ours_loads(tmp_path):
    module = _Net()
    rc = ResilientCheckpoint(
        tmp_path / "ck", every_n_steps=1, keep_last=1, keep_best=1, monitor="val_loss"
    )
    trainer = _trainer(tmp_path, rc, max_steps=6, val_check_interval=1, limit_val_batches=1)
    trainer.fit(module, _loader(), _loader())
    kept = catalog.committed(catalog.scan(str(tmp_path / "ck"), catalog.Depth.NONE))
    best = min(kept, key=lambda e: e.manifest.metrics["val_loss"])
    assert best.step != 6 and len(kept) == 2  # the best is not the newest
    trainer.test(ckpt_path="best", dataloaders=_loader(), verbose=False)
    assert module.loaded_steps == [best.step]
    other = _Net()  # a new Trainer with the callback (its own directory), ours given
    evaluating = _trainer(tmp_path / "b", ResilientCheckpoint(tmp_path / "b" / "ck"))
    evaluating.test(other, _loader(), ckpt_path=best.path, verbose=False)
    assert not (tmp_path / "b" / "ck").exists()  # nothing opened or written there
    assert other.loaded_steps == [best.step]
    assert torch.equal(other.lin.weight, module.lin.weight)


class _OtherRun(_Net):
    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("val_loss", -100.0)  # better than any of the run under test


def test_best_by_monitor_is_of_the_fits_own_run_not_another_run_beside_it(tmp_path):
    """The best was chosen among every checkpoint in the directory: a new run
    (``resume="never"``) beside an earlier run's checkpoints evaluated the other run's model."""
    kw = {"every_n_steps": 1, "keep_best": 1, "monitor": "val_loss"}
    earlier = _trainer(
        tmp_path / "a",
        ResilientCheckpoint(tmp_path / "ck", **kw),
        max_steps=2,
        val_check_interval=1,
        limit_val_batches=1,
    )
    earlier.fit(_OtherRun(), _loader(), _loader())
    module = _Net()
    rc = ResilientCheckpoint(tmp_path / "ck", resume="never", **kw)
    trainer = _trainer(tmp_path / "b", rc, max_steps=6, val_check_interval=1, limit_val_batches=1)
    with pytest.warns(UserWarning, match="other run"):
        trainer.fit(module, _loader(), _loader())
    trainer.test(ckpt_path="best", dataloaders=_loader(), verbose=False)
    assert module.loaded_steps == [3]  # val_loss (3 - 3) ** 2 == 0, of this run


class _Tied(_Net):
    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("val_loss", 1.0)  # every validation ties


def test_best_of_tied_scores_is_the_earliest_the_one_retention_keeps(tmp_path):
    """Every validation reports the same val_loss: keep_best=1 keeps the first (a later score
    must be strictly better, as for Lightning's ModelCheckpoint(save_top_k=1)). The "best"
    evaluated after the fit was the newest of the ties (step 6), another checkpoint than the
    one retention keeps as the best."""
    module = _Tied()
    rc = ResilientCheckpoint(
        tmp_path / "ck", every_n_steps=1, keep_last=1, keep_best=1, monitor="val_loss"
    )
    trainer = _trainer(tmp_path, rc, max_steps=6, val_check_interval=1, limit_val_batches=1)
    trainer.fit(module, _loader(), _loader())
    kept = catalog.committed(catalog.scan(str(tmp_path / "ck"), catalog.Depth.NONE))
    assert [e.step for e in kept] == [1, 6]
    trainer.test(ckpt_path="best", dataloaders=_loader(), verbose=False)
    assert module.loaded_steps == [1]


def test_best_is_of_the_current_lineage_not_a_branch_a_roll_back_abandoned(tmp_path):
    """A run that rolled back (resume=5 while 10 existed) abandoned 10, which scored best; with
    keep_last=None it is still there. Retention ranks the current lineage's best first
    (10-1); the "best" evaluated after the fit was the abandoned 10, a timeline the run threw
    away."""
    from resilient_callbacks import Checkpointer
    from resilient_callbacks.lightning.evaluate import evaluated

    d, state = tmp_path / "ck", {"model": torch.nn.Linear(4, 4)}
    opts = {"every_n_steps": 5, "keep_last": None, "keep_best": 1, "monitor": "loss"}
    with Checkpointer(d, **opts) as ck:
        ck.restore(state)
        for step in range(1, 11):
            ck.step(step, state, {"loss": 0.1 if step == 10 else 1.0})
    with Checkpointer(d, resume=5, **opts) as ck:
        assert ck.restore(state) == 5
        for step in range(6, 16):
            ck.step(step, state, {"loss": 0.5 if step == 10 else 0.9})
        run = ck._dir.run_id
    names = [e.name for e in catalog.committed(catalog.scan(str(d), catalog.Depth.NONE))]
    assert "step_000000010" in names  # the abandoned one, kept (keep_last=None)
    best = evaluated(str(d), "loss", "min", None, run)
    assert Path(best).name == "step_000000010-1"
