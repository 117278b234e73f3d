"""``ResilientCheckpoint`` next to the Trainer's other modes and tools: a debugging
``fast_dev_run``, Lightning's tuner (``Tuner.lr_find``, ``LearningRateFinder``,
``BatchSizeFinder``), a ``GradientAccumulationScheduler``.

In-process runs of a tiny model on the CPU; a stop is an exception at the start of a batch
(no emergency save), the re-run a new module and Trainer in the same directory.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from resilient_callbacks import ConfigError, catalog
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


def _data() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    )


def _trainer(work: Path, callbacks: list, **trainer_kwargs) -> L.Trainer:  # type: ignore[no-untyped-def]
    kwargs = dict(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
    )
    return L.Trainer(callbacks=callbacks, **{**kwargs, **trainer_kwargs})


def _fit(work: Path, callbacks: list, **trainer_kwargs) -> tuple[_Net, L.Trainer]:  # type: ignore[no-untyped-def]
    L.seed_everything(0, verbose=False)
    module = _Net()
    data = _data()
    trainer = _trainer(work, callbacks, **trainer_kwargs)
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


class _Killed(Exception):
    pass


class _KillAfter(L.Callback):
    """Raises at the start of batch ``n + 1`` of the fit (no emergency save: a kill)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.seen += 1
        if self.seen > self.n:
            raise _Killed


class _Recording(L.Callback):
    """The module records its losses from the fit's ``on_train_start`` on (a finder's trial
    steps run with the Trainer's callbacks replaced by its own: this one sees none)."""

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        pl_module.recording = True


class _Tuned(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.1
        self.recording = False

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        n = len(self.losses)
        loss = super().training_step(batch, batch_idx)
        if not self.recording:
            del self.losses[n:]
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def _tuned_fit(
    work: Path, how: str, *callbacks: L.Callback, ours: bool = True
) -> tuple[_Tuned, ResilientCheckpoint]:
    """A fit whose learning rate a finder chose: ``Tuner(trainer).lr_find`` before it, or a
    ``LearningRateFinder`` among its callbacks; a ResilientCheckpoint in ``work / "ck"``
    (unless not ``ours``)."""
    from lightning.pytorch.callbacks import LearningRateFinder
    from lightning.pytorch.tuner import Tuner

    L.seed_everything(0, verbose=False)
    module = _Tuned()
    rc = ResilientCheckpoint(work / "ck", every_n_steps=3)
    finder = [LearningRateFinder(num_training_steps=20)] if how == "callback" else []
    trainer = _trainer(
        work, [*finder, _Recording(), *callbacks, *([rc] if ours else [])], max_epochs=3
    )
    data = _data()
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    if how == "tuner":
        Tuner(trainer).lr_find(module, loader, num_training=20, update_attr=True)
    with contextlib.suppress(_Killed):
        trainer.fit(module, loader)
    return module, rc


@pytest.mark.parametrize("how", ["tuner", "callback"])
def test_a_learning_rate_found_by_lightnings_tuner_resumes_exactly(tmp_path, how):
    """``Tuner(trainer).lr_find(model)`` before ``fit()``, or a ``LearningRateFinder``
    callback: the finder restores its own file through the ``resume_start`` we wrap. Found
    2026-12-06: that restore was taken for a ``fit(ckpt_path=...)`` and the re-run of a killed
    run trained again from step 0 (the Tuner's fit resumed ours, which the finder then replaced;
    its end counted as a finished fit, so the real fit went on from the live state)."""
    plain, _ = _tuned_fit(tmp_path / "plain", how, ours=False)
    assert plain.lr != 0.1 and len(plain.losses) == 24
    killed, _ = _tuned_fit(tmp_path, how, _KillAfter(10))
    resumed, rc = _tuned_fit(tmp_path, how)
    assert rc.restored_step == 9
    assert killed.losses[:9] + resumed.losses == plain.losses
    for a, b in zip(plain.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_batch_size_finder_in_the_fit_is_refused_at_a_resume(tmp_path):
    """A ``BatchSizeFinder`` callback searches again at every ``fit()``'s start, and the batch
    size it chose is kept nowhere: a resume is refused, naming the ``Tuner`` instead (before
    2026-12-06 its restore replaced ours: the re-run trained again from step 0)."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    class Sized(_Net):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return torch.utils.data.DataLoader(_data(), batch_size=self.batch_size, shuffle=True)

    def fit(*callbacks: L.Callback) -> None:
        trainer = _trainer(tmp_path, [BatchSizeFinder(max_trials=2, steps_per_trial=1), *callbacks])
        trainer.fit(Sized())

    with contextlib.suppress(_Killed):
        fit(ResilientCheckpoint(tmp_path / "ck", every_n_steps=2), _KillAfter(3))
    with pytest.raises(ConfigError, match=r"BatchSizeFinder.*Tuner\(trainer\).scale_batch_size"):
        fit(ResilientCheckpoint(tmp_path / "ck", every_n_steps=2))


def test_a_gradient_accumulation_schedule_resumes_mid_epoch_exactly(tmp_path):
    """``GradientAccumulationScheduler`` sets an epoch's ``accumulate_grad_batches`` in
    ``on_train_epoch_start``, which Lightning skips for an epoch it resumes in the middle of.
    Found 2026-12-06: the rest of that epoch stepped after every batch (3 steps more in all),
    with a warning that the Trainer's ``accumulate_grad_batches=1`` differed from the saved 3
    (the scheduler refuses any other)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def schedule() -> GradientAccumulationScheduler:
        return GradientAccumulationScheduler({0: 1, 1: 3})

    plain, trainer = _fit(tmp_path / "plain", [schedule()], max_epochs=3)
    assert trainer.global_step == 14  # 8 steps, then 3 an epoch (batches 3, 6 and 8)
    with contextlib.suppress(_Killed):
        _fit(
            tmp_path,
            [schedule(), ResilientCheckpoint(tmp_path / "ck", every_n_steps=3), _KillAfter(11)],
            max_epochs=3,
        )
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*accumulate_grad_batches")
        resumed, trainer = _fit(tmp_path, [schedule(), rc], max_epochs=3)
    assert rc.restored_step == 9  # epoch 1's first step (its batch 3)
    assert trainer.global_step == 14
    assert plain.losses[:11] + resumed.losses == plain.losses
    for a, b in zip(plain.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def _spawn_fit(work: Path, *callbacks: L.Callback) -> tuple[_Net, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module = _Net()
    trainer = _trainer(work, list(callbacks), devices=1, strategy="ddp_spawn")
    data = _data()
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    except Exception as e:  # (the worker's exception comes back as another)
        if "_Killed" not in str(e) and "_Killed" not in repr(e.__cause__):
            raise
    return module, trainer


@pytest.mark.slow
def test_a_spawned_fit_ends_and_resumes_with_the_weights_of_the_run(tmp_path):
    """``strategy="ddp_spawn"`` (and ``"ddp_notebook"``) runs the fit in worker processes; at
    the end Lightning's launcher sets the worker's ``best_model_path`` on the main process's
    ``trainer.checkpoint_callback``, ours. Found 2026-12-06: that property had no setter, and
    every such ``fit()`` raised ``AttributeError`` at its end, before the main process got the
    trained weights."""
    plain, _ = _spawn_fit(tmp_path / "plain")
    _spawn_fit(tmp_path, ResilientCheckpoint(tmp_path / "ck", every_n_steps=3), _KillAfter(10))
    assert _steps(tmp_path / "ck") == [3, 6, 9]
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=3)
    resumed, trainer = _spawn_fit(tmp_path, rc)
    assert trainer.checkpoint_callback is rc and rc.best_model_path == ""
    assert _steps(tmp_path / "ck")[-1] == 16
    for a, b in zip(plain.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_another_limit_train_batches_at_a_resume_is_said_or_refused(tmp_path):
    """Found 2026-12-07: a re-run with another ``limit_train_batches`` went on silently, and
    one with fewer batches than the resumed epoch had trained counted that epoch from batch 0
    again and trained 2 more batches in it (5 in an epoch of 2; Lightning's own ``ckpt_path``
    resume does the same). More batches than trained: the epoch ends at the new length, from
    the saved position, with a warning; fewer: refused, saying the way out; at an epoch's end:
    a warning."""
    plain, _ = _fit(tmp_path / "plain", [], max_epochs=3, limit_train_batches=6)
    ck = tmp_path / "ck"
    with contextlib.suppress(_Killed):
        _fit(tmp_path, [ResilientCheckpoint(ck, every_n_steps=3), _KillAfter(10)],
             max_epochs=3, limit_train_batches=6)  # fmt: skip
    saved = _steps(ck)
    assert saved[-1] == 9  # epoch 1, 3 batches into it
    rc = ResilientCheckpoint(ck, every_n_steps=100)
    with pytest.raises(ConfigError, match=r"limit_train_batches=3 here, 6 when.*3 batch\(es\) "
                       r"into epoch 1.*limit_train_batches=6"):  # fmt: skip
        _fit(tmp_path, [rc], max_epochs=3, limit_train_batches=3)
    assert rc.restored_step == 9 and _steps(ck) == saved
    rc = ResilientCheckpoint(ck, every_n_steps=100)
    with pytest.warns(UserWarning, match=r"limit_train_batches=4 here, 6 when.*epoch 1, 3 "):
        resumed, trainer = _fit(tmp_path, [rc], max_epochs=3, limit_train_batches=4)
    assert rc.restored_step == 9 and trainer.global_step == 9 + 1 + 4
    assert resumed.losses[0] == plain.losses[9]  # the saved position in the epoch's order
    rc = ResilientCheckpoint(ck, every_n_steps=100, resume=6)  # the end of epoch 0
    with pytest.warns(UserWarning, match=r"limit_train_batches=1.0 here, 6 when.*epochs from 1"):
        _, trainer = _fit(tmp_path / "again", [rc], max_epochs=3)
    assert rc.restored_step == 6 and trainer.global_step == 6 + 2 * 8


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"max_epochs": 2}, {"max_epochs": 3}),
        ({"max_epochs": -1, "max_steps": 10}, {"max_epochs": -1, "max_steps": 15}),
        (
            {"max_epochs": -1, "max_steps": 10, "accumulate_grad_batches": 2},
            {"max_epochs": -1, "max_steps": 15, "accumulate_grad_batches": 2},
        ),
    ],
    ids=["max_epochs", "max_steps", "max_steps-accumulated"],
)
def test_a_finished_run_given_more_epochs_or_steps_trains_them_as_the_longer_run(
    tmp_path, before, after
):
    """A finished fit re-run with ``max_epochs`` or ``max_steps`` raised goes on from its last
    step and ends as a run given the larger value from the start: the same losses and weights
    (checked 2026-12-07; it did already)."""
    plain, _ = _fit(tmp_path / "plain", [], **after)
    ck = tmp_path / "ck"
    first, done = _fit(tmp_path, [ResilientCheckpoint(ck, every_n_steps=5)], **before)
    rc = ResilientCheckpoint(ck, every_n_steps=5)
    more, trainer = _fit(tmp_path, [rc], **after)
    assert rc.restored_step == done.global_step < trainer.global_step
    assert first.losses + more.losses == plain.losses
    for a, b in zip(plain.parameters(), more.parameters(), strict=True):
        assert torch.equal(a, b)


def test_another_accumulation_at_a_mid_epoch_resume_says_where_the_first_step_falls(tmp_path):
    """Lightning steps where the epoch's batch count is a multiple of accumulate_grad_batches:
    resumed 4 batches into an epoch with 3 instead of 2, the first step took 2 batches, not
    the 3 the warning said every step takes (found 2026-12-07)."""

    class _Steps(L.Callback):
        def __init__(self) -> None:
            self.at: list[tuple[int, int]] = []

        def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
            self.at.append((trainer.current_epoch, trainer.global_step))

    ck = tmp_path / "ck"
    with contextlib.suppress(_Killed):
        _fit(tmp_path, [ResilientCheckpoint(ck, every_n_steps=1), _KillAfter(5)],
             accumulate_grad_batches=2)  # fmt: skip
    rc, steps = ResilientCheckpoint(ck, every_n_steps=100), _Steps()
    with pytest.warns(UserWarning, match=r"accumulate_grad_batches=3 here, 2 when") as said:
        _fit(tmp_path, [rc, steps], accumulate_grad_batches=3)
    assert rc.restored_step == 2  # 4 batches into epoch 0
    assert steps.at[:2] == [(0, 2), (0, 3)]  # the batches 5 and 6 of the epoch: one step
    (text,) = [str(w.message) for w in said if "accumulate_grad_batches" in str(w.message)]
    assert "the first after the resume takes 2" in text
