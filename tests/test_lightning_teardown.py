"""The end of a Lightning ``fit()`` whose close fails: ``Checkpointer.close()`` raises
``UploadIncompleteError`` once it gave up on uploads during an outage of the remote store.

The callback closes in its ``teardown`` hook. The error used to be raised there, inside
Lightning's ``_call_teardown_hook``: the teardown of the callbacks after ours and of the
LightningModule, the loggers' ``finalize("success")`` and ``profiler.describe()`` never ran,
and Lightning's exception path finalized the loggers as "failed". Now the error is raised after
all of that, out of ``fit()``, and the loggers are finalized once, "success" (docs/lightning.md).

The store is ``file://`` whose uploads fail (``RemoteStore.upload`` raises), the outage limit
0.5 s: close gives up after half a second of failing attempts, however loaded the machine.
"""

from __future__ import annotations

import logging
import signal
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.profilers import PassThroughProfiler
from torch.utils.data import DataLoader, TensorDataset

from resilient_callbacks import checkpointer as ckmod
from resilient_callbacks import upload_wait
from resilient_callbacks.checkpointer import RESUMABLE_EXIT_CODE
from resilient_callbacks.errors import UploadIncompleteError
from resilient_callbacks.lightning import ResilientCheckpoint
from resilient_callbacks.remote import RemoteStore

pytestmark = pytest.mark.timeout(300)


class _UserError(Exception):
    pass


def _name(stage: str) -> str:
    return getattr(stage, "value", stage)  # (a TrainerFn, a str enum)


def _loader() -> DataLoader:
    data = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)))
    return DataLoader(data, batch_size=4)


class _Net(L.LightningModule):
    def __init__(
        self, events: list[str], fail_at: int | None = None, sigterm_at: int | None = None
    ):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.events, self.fail_at, self.sigterm_at = events, fail_at, sigterm_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at:
            raise _UserError(f"the user's step {self.global_step + 1} failed")
        if self.global_step == self.sigterm_at:
            signal.raise_signal(signal.SIGTERM)  # the Checkpointer's handler: a preemption
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", self.layer(batch[0]).mean())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test", self.layer(batch[0]).mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def teardown(self, stage: str) -> None:
        self.events.append(f"module.teardown:{_name(stage)}")


class _Data(L.LightningDataModule):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def train_dataloader(self) -> DataLoader:
        return _loader()

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader

    def teardown(self, stage: str) -> None:
        self.events.append(f"datamodule.teardown:{_name(stage)}")


class _Later(Checkpoint):
    """A callback whose teardown comes after ours (Lightning puts ``Checkpoint`` callbacks
    last, in their order)."""

    def __init__(self, events: list[str], fail: bool = False) -> None:
        self.events, self.fail = events, fail

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.events.append(f"later.teardown:{_name(stage)}")
        if self.fail:
            raise _UserError("the later callback's teardown failed")

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.events.append(f"later.on_exception:{type(exception).__name__}")


class _Logger(Logger):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    @property
    def name(self) -> str:
        return "rec"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        pass

    def finalize(self, status: str) -> None:
        self.events.append(f"logger.finalize:{status}")


class _Profiler(PassThroughProfiler):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def describe(self) -> None:
        self.events.append("profiler.describe")
        super().describe()


@pytest.fixture
def store_down(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every upload fails; close gives up after 0.5 s of it. Returns the attempts' count."""
    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 0.5)
    # close() looks 20 times a second: it gave up at its second look, a second apart
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)
    attempts: list[int] = []

    def down(*a: Any, **k: Any) -> None:
        attempts.append(1)
        raise ConnectionError("the store is down")

    monkeypatch.setattr(RemoteStore, "upload", down)
    return attempts


def _trainer(tmp_path: Any, events: list[str], *callbacks: Any, **kw: Any) -> L.Trainer:
    return L.Trainer(
        max_steps=4,
        accelerator="cpu",
        callbacks=list(callbacks),
        logger=_Logger(events),
        profiler=_Profiler(events),
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kw,
    )


def _ours(tmp_path: Any, **kw: Any) -> ResilientCheckpoint:
    return ResilientCheckpoint(
        tmp_path / "ck", remote=f"file://{tmp_path / 'remote'}", every_n_steps=2, **kw
    )


def _fit(trainer: L.Trainer, module: _Net, data: _Data) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)


def test_a_close_that_gives_up_on_uploads_lets_lightning_finish_its_teardown_first(
    tmp_path, store_down
):
    """Found 2026-12-06: the callback's teardown raised UploadIncompleteError inside Lightning's
    _call_teardown_hook: the LightningModule's and a later callback's teardown, the loggers'
    finalize("success") and profiler.describe() were skipped, and the loggers were finalized
    "failed". Now fit() raises the error after all of them, and the loggers get "success" once:
    the training succeeded; the durability of its newest checkpoints did not."""
    events: list[str] = []
    ours = _ours(tmp_path)
    trainer = _trainer(tmp_path, events, ours, _Later(events))
    with pytest.raises(UploadIncompleteError, match="step_000000004"):
        _fit(trainer, _Net(events), _Data(events))
    assert events == [
        "datamodule.teardown:fit",
        "later.teardown:fit",
        "module.teardown:fit",
        "logger.finalize:success",
        "profiler.describe",
        "later.on_exception:UploadIncompleteError",  # Lightning's exception path: fit() raised
    ]
    assert store_down and ours.checkpointer is None  # it tried, and closed all the same
    # nothing of ours is left on Lightning's objects
    assert "finalize" not in vars(trainer.logger) and "describe" not in vars(trainer.profiler)


def test_validate_test_and_predict_do_not_close_or_touch_the_store(tmp_path, store_down):
    """The callback opens and closes its Checkpointer in fit() only: validate, test and predict
    (also after a fit whose close raised) neither open one nor raise; their own end is
    Lightning's, loggers finalized "success"."""
    events: list[str] = []
    ours = _ours(tmp_path)
    trainer = _trainer(tmp_path, events, ours)
    module, data = _Net(events), _Data(events)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(module, datamodule=data)
        assert not (tmp_path / "ck").exists() and ours.checkpointer is None
        with pytest.raises(UploadIncompleteError):
            trainer.fit(module, datamodule=data)
        tried = len(store_down)
        events.clear()
        trainer.validate(module, datamodule=data)
        trainer.test(module, datamodule=data)
        assert len(trainer.predict(module, datamodule=data)) == 4
    assert len(store_down) == tried and ours.checkpointer is None
    assert [e for e in events if e.startswith("logger")] == ["logger.finalize:success"] * 3


def test_the_users_training_error_propagates_and_the_close_error_is_logged(
    tmp_path, store_down, caplog
):
    """An exception in training_step: the user's error leaves fit(), the close's (which gave up
    on the step-2 checkpoint's upload) is logged; the loggers are finalized "failed" once, by
    Lightning's exception path (no teardown hooks run: Lightning's own behaviour)."""
    caplog.set_level(logging.ERROR, "resilient_callbacks")
    events: list[str] = []
    ours = _ours(tmp_path)
    trainer = _trainer(tmp_path, events, ours, _Later(events))
    with pytest.raises(_UserError, match="step 3"):
        _fit(trainer, _Net(events, fail_at=2), _Data(events))
    assert events == ["later.on_exception:_UserError", "logger.finalize:failed"]
    logged = [r.getMessage() for r in caplog.records if "step_000000002" in r.getMessage()]
    assert logged and "never reached" in logged[0], caplog.text
    assert ours.checkpointer is None


def test_a_teardown_failing_after_ours_is_the_error_fit_raises(tmp_path, store_down, caplog):
    """A callback's teardown after ours fails, while the close gave up on uploads: its error is
    the one fit() raises (as without our callback), the close's is logged. Before, ours was
    raised from our teardown, and that callback's teardown never ran."""
    caplog.set_level(logging.ERROR, "resilient_callbacks")
    events: list[str] = []
    trainer = _trainer(tmp_path, events, _ours(tmp_path), _Later(events, fail=True))
    with pytest.raises(_UserError, match="teardown failed"):
        _fit(trainer, _Net(events), _Data(events))
    assert events == [
        "datamodule.teardown:fit",
        "later.teardown:fit",
        "later.on_exception:_UserError",
        "logger.finalize:failed",
    ]
    logged = [r.getMessage() for r in caplog.records if "step_000000004" in r.getMessage()]
    assert logged and "never reached" in logged[0], caplog.text
    assert "describe" not in vars(trainer.profiler)


def test_a_preemption_with_the_store_down_still_exits_75(tmp_path, store_down):
    """A SIGTERM during training: the emergency save at the step boundary, then SystemExit(75)
    out of fit() (Lightning's exception path, no teardown hooks), not UploadIncompleteError:
    the close of a preempted process bounds its wait by the grace period and raises nothing
    (the restart uploads)."""
    events: list[str] = []
    ours = _ours(tmp_path, grace_period=6.0)
    trainer = _trainer(tmp_path, events, ours, _Later(events))
    with pytest.raises(SystemExit) as info:
        _fit(trainer, _Net(events, sigterm_at=2), _Data(events))
    assert info.value.code == RESUMABLE_EXIT_CODE
    assert ours.preempted and ours.checkpointer is None
    assert events == ["later.on_exception:SystemExit", "logger.finalize:failed"]
    assert (tmp_path / "ck" / "step_000000003").is_dir()  # the emergency checkpoint, local
