"""When the Lightning callback saves a step, and what a resume from that save puts back.

A step is saved once Lightning has finished it, so a checkpoint holds everything the
uninterrupted run did for that step:

- after the batch's ``on_advance_end`` (its validation, step-interval ``ReduceLROnPlateau``
  schedulers and bookkeeping);
- at an epoch's last batch, after ``fit_loop.on_advance_end`` too (the ``on_train_epoch_end``
  hooks and epoch-interval plateau schedulers).

The loop progress saved with it is Lightning's at the step's ``on_train_batch_end`` hook,
the point Lightning's own restart logic expects for a checkpoint of a training step (it then
neither repeats the step's validation nor its epoch's end). Lightning's restart gets these
things wrong for such a checkpoint (its own checkpoints too), which :class:`Resume` puts right:

- ``trainer.callback_metrics`` start empty, so a plateau scheduler or ``EarlyStopping`` that
  reads a metric logged before the save finds nothing (Lightning raises "ReduceLROnPlateau
  conditioned on metric ... which is not available"): the saved ones are put back;
- it skips the epoch-interval plateau schedulers at the end of the first epoch it runs,
  because it does not save metrics: with them saved, they run;
- it restores the train dataloaders' states (torchdata's ``StatefulDataLoader`` fast-forwards
  its sampler there) before it announces the epoch to their samplers: a ``DistributedSampler``
  then replays epoch 0's order. The samplers are told the resumed epoch first;
- resumed on another number of ranks, it counts the resumed epoch's batches from its start
  but takes its length from the rest the loader hands out, and keeps that length for every
  later epoch: :mod:`.reshard` sets them right;
- it leaves the random streams to whatever drew between the restore and the first batch
  (dataloader iterators made at setup, the sanity check, ``on_train_start`` hooks): they are
  put back where the uninterrupted run went on from the save, before the next epoch's start
  (after a checkpoint of an epoch's last batch) or before the resumed epoch's next batch;
- after a checkpoint of an epoch's last batch it skips the next epoch's
  ``on_train_epoch_start`` hooks: they run; it does not make that epoch's dataloader
  iterators where the uninterrupted run does (after those hooks and after
  ``reload_dataloaders_every_n_epochs`` rebuilt the loaders, drawing from the global RNG):
  they are made there; and with a loader of unknown length it does not count the epoch's
  batches from 0: it does;
- restored at the fit's ``max_steps`` it skips its whole loop, and restored where the run
  stopped it goes to ``on_train_end`` at once: the run's ``on_train_start``/``on_train_end``
  hooks and the end of an epoch its last step was in the middle of run, training nothing.

Which ranks call what: every rank runs these at the same points (Lightning runs its loops on
every rank); nothing here runs a collective.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch

from .. import rng
from ..wrapped import plain_name
from . import checks, reshard, stops
from .state import STOP_RNG_KEY, finite_metrics

EPOCH_END_KEY = "resilient_callbacks_epoch_end"
"""Recorded true in a checkpoint of an epoch's last batch (saved after the epoch's end)."""

METRICS_KEY = "resilient_callbacks_callback_metrics"
"""``trainer.callback_metrics`` at the save (scalars), put back at the resume."""

LIMIT_KEY = "resilient_callbacks_limit_train_batches"
"""``trainer.limit_train_batches`` at the save: a resume with another is warned about, or refused
where the resumed epoch is already past the new end (:func:`.checks.epoch_length`)."""

TRAINABLE_KEY = "resilient_callbacks_trainable"
"""With a ``BaseFinetuning`` callback: the names of the parameters trainable at the save
(``requires_grad``), which the resume makes trainable again (:func:`_trainable_as_saved`)."""

TRACKING_KEY = "resilient_callbacks_bn_tracking"
"""With a ``BaseFinetuning`` callback: whether each BatchNorm module tracked its running
statistics at the save (``track_running_stats``, which its freeze and unfreeze set)."""


@dataclass
class StepEnd:
    """An optimizer step whose batch ended, waiting for Lightning to finish its work."""

    step: int
    loss: Any
    fit_loop: dict[str, Any]  # Lightning's fit-loop state at the step's on_train_batch_end


def step_end(trainer: pl.Trainer, step: int, loss: Any) -> StepEnd:
    """Called at ``on_train_batch_end``: the loop progress is copied now (Lightning counts
    the batch completed right after this hook)."""
    return StepEnd(step, loss, copy.deepcopy(trainer.fit_loop.state_dict()))


def ends_epoch(trainer: pl.Trainer) -> bool:
    """Whether the batch that just ran is its epoch's last (the epoch's end follows)."""
    return bool(trainer.fit_loop.epoch_loop._num_ready_batches_reached())


def marks(trainer: pl.Trainer, epoch_end: bool, to_cpu: bool = True) -> dict[str, Any]:
    """What a save records for :class:`Resume`: whether it ends an epoch, the metrics and,
    with a ``BaseFinetuning`` callback, the parameters then trainable."""
    out = {
        EPOCH_END_KEY: epoch_end,
        METRICS_KEY: saved_metrics(trainer, to_cpu),
        LIMIT_KEY: trainer.limit_train_batches,
    }
    if _finetuning(trainer):
        module = trainer.lightning_module
        named = module.named_parameters()
        out[TRAINABLE_KEY] = sorted(plain_name(n) for n, p in named if p.requires_grad)
        out[TRACKING_KEY] = {
            _module_name(n): m.track_running_stats
            for n, m in module.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        }
    return out


def saved_metrics(trainer: pl.Trainer, to_cpu: bool = True) -> dict[str, Any]:
    """The scalar ``callback_metrics`` (:func:`.state.finite_metrics`), tensors copied: to the
    CPU, or where they are, without waiting for the device, for a save that may never happen."""
    return {
        k: (v.to("cpu", copy=True) if to_cpu else v.clone()) if isinstance(v, torch.Tensor) else v
        for k, v in finite_metrics(trainer.callback_metrics).items()
    }


class Resume:
    """What a resume from one of our checkpoints puts right in Lightning's restart."""

    def __init__(
        self, checkpoint: dict[str, Any], rng_state: tuple[dict[str, Any], Any] | None
    ) -> None:
        """Takes (pops) our keys out of the restored checkpoint dictionary; ``rng_state``: the
        random streams as restored (:func:`resilient_callbacks.rng.capture`)."""
        self.rng_state = rng_state
        self.auto = True  # the newest valid checkpoint, not one chosen (resume=, ckpt_path=)
        self.loaders_epoch = True
        metrics = checkpoint.pop(METRICS_KEY, None)
        self.metrics: dict[str, Any] | None = metrics if isinstance(metrics, dict) else None
        self.epoch_end = bool(checkpoint.pop(EPOCH_END_KEY, False))
        self.limit = checkpoint.pop(LIMIT_KEY, None)  # (None: saved by an older version)
        self.batches_done = checks.batches_into_epoch(checkpoint)
        trainable = checkpoint.pop(TRAINABLE_KEY, None)  # (None: older, or no finetuning)
        self.trainable = set(trainable) if isinstance(trainable, list) else None
        tracking = checkpoint.pop(TRACKING_KEY, None)
        self.tracking = tracking if isinstance(tracking, dict) else None
        self.epoch_end_run = self.saved_at_epoch_end = self.epoch_end
        self.started = False  # on_train_start ran
        self.past_end: str | None = None  # the checkpoint is past this fit()'s end (:mod:`.stages`)
        # a checkpoint without metrics (written by an older version) keeps Lightning's skip
        self.plateau = self.metrics is not None
        self.data_set_up = False
        self.resharded_epoch: int | None = None  # resumed on another number of ranks
        self.counts = checks.saved_counts(checkpoint)  # optimizers' and schedulers' states
        # this rank's streams before the validation Lightning ran at the stop (if it did)
        self.before_stop_validation = stops.streams(checkpoint.pop(STOP_RNG_KEY, None))

    def train_on(self) -> None:
        """A run that stopped (``max_time``) trains on from the restored step: from the random
        streams before the validation Lightning ran only because it stopped, as a run that
        never stopped goes on (:func:`.stops.before_validation`)."""
        if self.before_stop_validation is not None:
            self.rng_state = self.before_stop_validation

    def before_lr_schedulers(self, trainer: pl.Trainer) -> None:
        """Before Lightning loads the schedulers' states: their settings changed since the
        checkpoint (``T_max``, ...) are named, as the core's restore names them."""
        checks.scheduler_settings_changed(trainer)

    def before_loader_states(self, trainer: pl.Trainer) -> None:
        """Before Lightning loads the train dataloaders' states (the first time)."""
        if not self.loaders_epoch:
            return
        self.loaders_epoch = False
        combined = trainer.fit_loop._combined_loader
        epoch = trainer.current_epoch  # the resumed one (its loop progress is loaded)
        for dl in combined.flattened if combined is not None else []:
            _set_sampler_epoch(dl, epoch)

    def after_setup_data(self, trainer: pl.Trainer) -> None:
        """After the fit loop built the train loaders and loaded their states (the first
        time): an epoch resumed on another sharding gets Lightning's length right."""
        if not self.data_set_up:
            self.data_set_up = True
            self.resharded_epoch = reshard.after_setup(trainer)
            checks.epoch_length(trainer, self.limit, self.batches_done, self.epoch_end)

    def train_start(self, trainer: pl.Trainer) -> None:
        """``on_train_start`` (Lightning emptied the metrics after the sanity check; the
        optimizers and schedulers are set up: another number than saved is warned about)."""
        self.started = True
        checks.optimizers_and_schedulers(trainer, self.counts)
        if not self.epoch_end:
            _start_swa_mid_epoch(trainer)
            _accumulation_mid_epoch(trainer)
        _trainable_as_saved(trainer, self.trainable, self.tracking)
        if self.metrics:
            trainer.callback_metrics.update(self.metrics)

    def before_epoch_start(self, trainer: pl.Trainer) -> None:
        """Before the first ``fit_loop.on_advance_start``: after a checkpoint of an epoch's
        last batch, Lightning restarts "mid-epoch" and would skip the next epoch's start
        (its ``on_train_epoch_start`` hooks and progress)."""
        if self.epoch_end:
            self.epoch_end = False
            self.put_back_rng()
            trainer.fit_loop.reset_restart_stage()

    def before_epoch_run(self, trainer: pl.Trainer) -> None:
        """Before the first ``epoch_loop.on_run_start`` after a checkpoint of an epoch's last
        batch: the uninterrupted run starts the next epoch afresh there. (Every epoch: after
        a re-sharded one, Lightning's lengths are the loader's whole epoch again.)"""
        if self.resharded_epoch not in (None, trainer.current_epoch):
            reshard.epoch_started(trainer)
        self.put_back_rng()  # (a mid-epoch resume: its next batch follows)
        if not self.epoch_end_run:
            return
        self.epoch_end_run = False
        loop = trainer.fit_loop.epoch_loop
        if loop.batch_progress.current.ready:
            # a loader of unknown length: Lightning resets the counts at an epoch's end only
            # when it knows the length; as it does for the others
            loop.batch_progress.reset_on_run()
            loop.scheduler_progress.reset_on_run()
            loop.automatic_optimization.optim_progress.reset_on_run()
            loop.val_loop.batch_progress.total.reset()
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is not None:
            iter(fetcher)  # Lightning skips this while restarting; the iterator made at setup
            # (before the epoch's start hooks and the RNG restore) is dropped unused

    def put_back_rng(self) -> None:
        """The random streams as restored (once; called at the resumed epoch's start, and at
        the end of a resumed ``fit()`` that trained nothing)."""
        state, self.rng_state = self.rng_state, None
        if state is not None:
            rng.restore(*state)

    def after_run(self, trainer: pl.Trainer) -> None:
        """After ``fit_loop.run``. Restored at this fit's ``max_steps`` (a finished script run
        again, or an earlier stage of a script), or with ``should_stop`` set before the loop (a
        ``Timer`` whose ``max_time`` the restored run used up, in ``on_fit_start``), Lightning
        skips its whole loop: no ``on_train_start``, no end of the epoch the last step was in,
        no ``on_train_end`` (as with ``fit(ckpt_path=...)``; a run ended by ``max_epochs`` gets
        its hooks). The uninterrupted run did them: they run, training nothing
        (:meth:`before_run_end`)."""
        fit_loop = trainer.fit_loop
        if self.started or self.past_end:
            return
        if trainer.global_step != trainer.max_steps and not trainer.should_stop:
            return
        if fit_loop.max_batches == 0 or trainer.limit_train_batches == 0:
            return  # (skipped for want of batches, as Lightning does)
        fit_loop.reset()
        fit_loop.on_run_start()
        fit_loop._restarting = False
        fit_loop.on_run_end()

    def before_run_end(self, trainer: pl.Trainer) -> None:
        """Before ``fit_loop.on_run_end`` (the ``on_train_end`` hooks) of a resumed ``fit()``
        that trained no batch (a re-run of a finished run or stage, :mod:`.stages`): what the
        uninterrupted run did after the restored step. The random streams are put back as
        restored; Lightning's loops, which it left restarting, are not (a next ``fit()`` of this
        Trainer then starts as after a ``fit()`` that trained); and after a step in the middle
        of an epoch (``max_steps`` or a stop there) that epoch ends, as it did in the run: its
        ``on_train_epoch_end`` hooks, the epoch counted done."""
        if self.rng_state is None or self.past_end:
            return  # it trained (or a later stage's checkpoint: that stage resumes from it)
        self.put_back_rng()
        fit_loop, loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
        progress = loop.batch_progress.total
        if progress.completed == getattr(progress, "processed", 0) - 1:  # at on_train_batch_end
            # what Lightning's restart does in the first epoch it runs (TrainingEpochLoop.reset)
            loop.batch_progress.increment_completed()
            loop._batches_that_stepped += 1
        for each in (fit_loop, loop, loop.val_loop):
            each.on_iteration_done()
        if not self.saved_at_epoch_end:
            fit_loop.on_advance_end()

    def before_epoch_end(self, trainer: pl.Trainer) -> None:
        """Before the first ``fit_loop.on_advance_end``: Lightning skips the epoch-interval
        plateau schedulers while it is restarting (metrics were not saved); they were."""
        if self.plateau:
            self.plateau = False
            # the private flag: the ``restarting`` setter forces True for max_steps training
            trainer.fit_loop._restarting = False


def _start_swa_mid_epoch(trainer: pl.Trainer) -> None:
    """A resume mid-epoch (Lightning calls no ``on_train_epoch_start`` for the resumed epoch):
    a ``StochasticWeightAveraging`` callback that had started in the saved run makes its
    ``SWALR`` scheduler (and loads its saved state) only in that hook, so the resumed run
    trained the rest of the epoch without it and skipped its step at the epoch's end: every
    later learning rate differed (Lightning's own resume does the same). Its epoch start runs
    here instead; it averages nothing again (the epoch's update is in its restored state)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if (
            isinstance(cb, StochasticWeightAveraging)
            and not cb._initialized
            and cb._scheduler_state is not None
            and cb.swa_start <= trainer.current_epoch <= cb.swa_end
        ):
            cb.on_train_epoch_start(trainer, trainer.lightning_module)


def _accumulation_mid_epoch(trainer: pl.Trainer) -> None:
    """A resume mid-epoch: a ``GradientAccumulationScheduler`` sets the epoch's
    ``accumulate_grad_batches`` only in ``on_train_epoch_start``, which Lightning skips for the
    resumed epoch, so the rest of it stepped after every batch (its ``on_train_start``, which
    ran just before, requires the Trainer's 1). Its epoch start runs here instead."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, GradientAccumulationScheduler):
            cb.on_train_epoch_start(trainer, trainer.lightning_module)


def _finetuning(trainer: pl.Trainer) -> bool:
    from lightning.pytorch.callbacks import BaseFinetuning

    return any(isinstance(cb, BaseFinetuning) for cb in trainer.callbacks)  # type: ignore[attr-defined]


def _trainable_as_saved(
    trainer: pl.Trainer, trainable: set[str] | None, tracking: dict[str, Any] | None
) -> None:
    """``BaseFinetuning`` (``BackboneFinetuning``) freezes its modules in ``setup`` at every
    ``fit()`` and unfreezes them in its ``finetune_function`` only at the epoch it chose: a run
    resumed after that epoch (from Lightning's checkpoint too) trained on with them frozen,
    and every later step differed. Each parameter is made trainable or frozen as it was at the
    save (``trainable``, :data:`TRAINABLE_KEY`: a finetuning may unfreeze a part of a module,
    or freeze again), and each BatchNorm module tracks its running statistics as it did
    (``tracking``, :data:`TRACKING_KEY`; where not recorded, those of a module with a
    trainable parameter, as ``BaseFinetuning.make_trainable`` sets them). A checkpoint of an
    older version, without the names: the modules whose parameters an optimizer holds are
    made trainable (``make_trainable``)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    if not _finetuning(trainer):
        return
    module = trainer.lightning_module
    if trainable is None:
        held = {id(p) for o in trainer.optimizers for g in o.param_groups for p in g["params"]}
        for sub in BaseFinetuning.flatten_modules(module):
            if any(id(p) in held and not p.requires_grad for p in sub.parameters(recurse=False)):
                BaseFinetuning.make_trainable(sub)
        return
    for name, p in module.named_parameters():
        p.requires_grad_(plain_name(name) in trainable)
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
            was = (tracking or {}).get(_module_name(name))
            if was is None:  # (recorded by a version before it)
                was = sub.track_running_stats or any(p.requires_grad for p in sub.parameters())
            sub.track_running_stats = bool(was)


def _module_name(name: str) -> str:
    """A submodule's name without torch.compile's ``_orig_mod`` segments."""
    return plain_name(name + ".")[:-1] if name else ""
