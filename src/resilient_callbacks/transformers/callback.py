"""``ResilientCheckpoint``: fault tolerance for a ``transformers.Trainer`` with one callback.

Which ranks call what: the Trainer fires every event on every rank, and every rank runs the same
code here; ``Checkpointer.restore``/``step``/``save``/``close`` are called by all ranks at the
same points (they run collectives when ``torch.distributed`` is initialized).

What happens when, in ``trainer.train()``:

- ``on_init_end`` (only for ``Trainer(callbacks=[...])``): refuse an ``IterableDataset`` at once;
  with ``auto_find_batch_size``, wrap the training loop (:mod:`.auto_batch`).
- ``on_train_begin`` (the first event of ``train()``; the model, optimizer, scheduler and data
  loader exist by then, nothing was iterated or computed): find the Trainer, refuse what is not
  supported (:mod:`.checks`), open the :class:`~resilient_callbacks.Checkpointer`, make the data
  loader's batch sampler resumable, restore the newest valid checkpoint into the live objects and
  the ``TrainerState`` (saying so through the Trainer's logger, ``transformers.trainer``), and wrap
  ``_run_epoch``/``_maybe_log_save_evaluate`` on this Trainer instance (see :mod:`.hooks` for
  why a callback alone cannot do it).
- after each optimizer step, once its logging, evaluation and best-metric tracking are done:
  ``Checkpointer.step()`` (saves when due; handles preemption). For the last step of an epoch
  this happens after the epoch-end logging/evaluation, so the checkpoint is at the epoch boundary.
- ``on_train_end``: wait for background saves, close, unwrap.

Transparency: none of this draws from a random stream or changes a batch, so an uninterrupted
run with the callback is the run without it, bit for bit (only ``resilient/*`` save timings are
added to the log). On a resume, the one draw a resumed run would make that the interrupted run
did not (the data loader's base seed, drawn from the global torch RNG whenever an iterator is
created) is taken from the RNG state recorded at that epoch's start instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from transformers import TrainerCallback

import resilient_callbacks_ds_guard

from .. import sinks
from ..adapter import check_options
from ..checkpointer import Checkpointer
from ..config import CheckpointerConfig
from . import (
    auto_batch,
    checks,
    collator_rng,
    epoch_loop,
    first,
    hooks,
    phases,
    progress,
    resumed,
    trainer_state,
    trials,
    under_deepspeed,
)
from .data import ResumableBatches, encode_cpu_rng, make_resumable
from .trainer_state import FORMAT, METRIC_PREFIX, STATE_FIELDS  # noqa: F401 (their old home)

log = logging.getLogger("resilient_callbacks")

_OWN_OPTIONS = (
    "dirpath",
    "save_on_evaluate",
    "save_on_train_end",
    "trainer_checkpoints",
    "log_save_metrics",
)


class ResilientCheckpoint(TrainerCallback):
    """Atomic, verified, pickle-free checkpoints of a ``transformers.Trainer`` run, with retention
    and exact auto-resume: re-running the same script continues from the newest valid checkpoint.

    >>> trainer.add_callback(ResilientCheckpoint("ckpts/run1", every_n_steps=200, keep_last=3))  # doctest: +SKIP
    >>> trainer.train()                                                                          # doctest: +SKIP

    ``dirpath``: local (or shared, mounted) directory of the checkpoints; default
    ``<output_dir>/_resilient_checkpoints`` (``push_to_hub`` skips names starting with ``_``). ``every_n_steps``, ``keep_last``, ``keep_best``, ``monitor``,
    ``mode`` and every other keyword are options of :class:`~resilient_callbacks.Checkpointer`
    (``every_seconds``, ``async_save``, ``adaptive``, ``remote``, ``preemption``, ``resume``, ...),
    passed through unchanged. Without a save trigger, the Trainer's ``save_steps`` (or, with
    ``save_strategy="epoch"``, every epoch end) is used.

    ``keep_best=None`` is 0 and ``mode=None`` is ``"min"``, but for a ``monitor`` that is the
    Trainer's ``metric_for_best_model``, ``mode`` follows its ``greater_is_better``; under
    DeepSpeed, options left out are taken from the config's section.

    Adapter options:

    - ``save_on_evaluate`` (default: ``monitor is not None``): also save after every evaluation
      that reports ``monitor``, so each evaluated state can be kept as a best checkpoint.
    - ``save_on_train_end`` (default ``True``): save the final step.
    - ``trainer_checkpoints`` (default ``False``): the Trainer's own ``checkpoint-N`` saves
      (``save_strategy="steps"``/``"epoch"``) are switched off, since this callback replaces
      them; ``True`` keeps them.
    - ``log_save_metrics`` (default ``True``): after each save, log its timings to the Trainer's
      log (``resilient/save_blocking_s``, ``resilient/last_committed_s``, ...).

    Adding it does not change the run: an uninterrupted ``train()`` draws the same random numbers
    and trains on the same batches as without it. A resume is announced at WARNING through the
    ``transformers.trainer`` logger (shown by default), and ``train()`` returns the metrics of the
    uninterrupted run (``train_loss`` included), also when re-run after the run finished.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        every_n_steps: int | None = None,
        keep_last: int | None = None,
        keep_best: int | None = None,
        monitor: str | None = None,
        mode: str | None = None,
        save_on_evaluate: bool | None = None,
        save_on_train_end: bool = True,
        trainer_checkpoints: bool = False,
        log_save_metrics: bool = True,
        **checkpointer_options: Any,
    ) -> None:
        check_options("ResilientCheckpoint (Transformers)", checkpointer_options, _OWN_OPTIONS)
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.options: dict[str, Any] = {
            "every_n_steps": every_n_steps,
            "keep_last": keep_last,
            "keep_best": keep_best,
            "monitor": monitor,
            "mode": mode,
            **checkpointer_options,
        }
        fields = {f.name for f in dataclasses.fields(CheckpointerConfig)}
        # Validate values now (a bad option fails at construction, not after the model loads).
        CheckpointerConfig(
            dirpath=self.dirpath or os.getcwd(),
            **{k: v for k, v in self.options.items() if k in fields and v is not None},
        )
        self.monitor = monitor  # (at train(): with a DeepSpeed section's, see _begin)
        self._save_on_evaluate = save_on_evaluate
        self.save_on_evaluate = checks.save_on_evaluate(save_on_evaluate, self.options)
        self.save_on_train_end = save_on_train_end
        self.trainer_checkpoints = trainer_checkpoints
        self.log_save_metrics = log_save_metrics
        # a DeepSpeed config's section is read at on_train_begin, after deepspeed.initialize
        resilient_callbacks_ds_guard.claim("transformers.ResilientCheckpoint")
        first.install(ResilientCheckpoint)  # restores before the callbacks' on_train_begin

        self.checkpointer: Checkpointer | None = None
        self.restored_step: int | None = None  # step the latest train() resumed from; None: fresh
        self._attached: Any = None  # a Trainer given to attach()
        self._trainer: Any = None  # the Trainer whose train() is running
        self._loader: Any = None
        self._batches: ResumableBatches | None = None
        self._base: Any = None  # the torch DataLoader inside the Trainer's loader
        self._own_generator: torch.Generator | None = None  # its generator (None: global RNG)
        self._saved = trainer_state.SavedState(exclude=self)  # what is saved of the Trainer
        self._save_every_epoch = False
        self._resume: tuple[int, int, torch.Tensor, torch.Tensor, bool] | None = None
        self._same_epochs = False  # as many optimizer steps an epoch as at the save
        self._eval_on_start = False  # turned off for a resumed run; given back at its end
        self._restored_rng: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        self._epoch_calls = self._epoch_offset = self._epoch = self._updates = 0
        self._steps_in_epoch = self._updates_per_epoch = 0
        self._pending: int | None = None
        self._epoch_ended = self._final_logged = self._ending = False
        self._step_metrics: dict[str, float] = {}
        self._logged_commit: int | None = None  # the committed step the last save log named
        self._home = ""  # the dirpath of this process's first training (phases.py)

    # ------------------------------------------------------------------ public

    def attach(self, trainer: Any) -> ResilientCheckpoint:
        """Name the Trainer explicitly. Only needed when the callback events are not fired by a
        ``transformers.Trainer`` method (the callback finds its Trainer on the call stack)."""
        self._attached = trainer
        auto_batch.install(trainer)
        return self

    # ------------------------------------------------------------------ events

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Fired by Trainer.__init__ for Trainer(callbacks=[...]), the earliest to see the data
        trainer = self._attached or hooks.find_trainer(self, required=False)
        if trainer is not None:
            checks.check_train_dataset(getattr(trainer, "train_dataset", None))
            auto_batch.install(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not first.begun(self):  # (it begins before every callback's on_train_begin)
            self._start(args, state, kwargs.get("train_dataloader"))

    def _start(self, args: Any, state: Any, loader: Any) -> None:
        trainer = self._attached if self._attached is not None else hooks.find_trainer(self)
        self._begin(trainer, args, state, loader)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer is None:
            return
        if not self.trainer_checkpoints:
            control.should_save = False
        self._updates += 1  # (state.epoch was set before every callback: _next_epoch)
        self._pending = state.global_step
        self._step_metrics = {}

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer is None:
            return
        if not self.trainer_checkpoints:
            control.should_save = False
        if self.checkpointer is not None and self.checkpointer.preempted:
            # stopped mid-epoch by the preemption: no end-of-epoch evaluation or save
            control.should_evaluate = control.should_save = False
        self._epoch_ended = True

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self._record(logs)

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
        self._record(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ckpt, trainer = self.checkpointer, self._trainer
        if ckpt is not None and trainer is not None:
            self._log_final()  # if the wrapper of the handler's on_train_end did not
            if not ckpt.preempted:  # (a preempted training goes on at the next train())
                phases.finished(self._home, trainer)
        if not self._ending:  # (the wrapper below closes after every callback's)
            self._finish()

    def _train_end(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Wraps the Trainer's ``callback_handler.on_train_end``: the last committed checkpoint
        is logged before any callback's ``on_train_end``, where a reporting integration ends its
        run (MLflow's: a log after that started a new, stray run); the close after them all
        (:func:`.hooks.end_of_train`)."""
        return hooks.end_of_train(self, original, *args, **kwargs)

    def _log_final(self) -> None:
        ckpt, trainer = self.checkpointer, self._trainer
        if ckpt is not None and trainer is not None and not self._final_logged:
            self._final_logged = True
            trainer_state.log_final(trainer, ckpt, self.log_save_metrics, self._logged_commit)

    # ------------------------------------------------------------------ begin

    def _begin(self, trainer: Any, args: Any, state: Any, loader: Any) -> None:
        self._finish()  # a previous train() that raised may have left things open
        checks.check_setup(trainer, loader)
        hooks.check_supported(trainer)
        section = under_deepspeed.take_section(trainer, args)
        own_dir, own = under_deepspeed.with_section(self.dirpath, self.options, section)
        options, self._save_every_epoch = checks.resolved_options(own, args, state)
        self.monitor = options.get("monitor")
        self.save_on_evaluate = checks.save_on_evaluate(self._save_on_evaluate, options)
        checks.warn_about_trainer_saves(args, self.trainer_checkpoints)
        checks.warn_about_monitor(options, args)
        trial = trials.trial(trainer)  # (a hyperparameter search's: a directory of its own)
        self._home, options = trials.place(checks.checkpoint_dir(own_dir, args), options, trial)
        dirpath, options = phases.place(self._home, trainer, options)  # (the first training's)
        options = trials.fresh_if_another(dirpath, options, trial)
        self._saved.trial = trial

        self._loader = loader
        self._batches = make_resumable(loader.batch_sampler)
        # batches collated in this process draw from its random streams: record them
        self._batches.record_rng = getattr(loader, "num_workers", 0) == 0
        self._base = getattr(loader, "base_dataloader", loader)
        self._own_generator = self._base.generator
        # a collator drawing from a generator of its own (MLM masking with seed=): saved too
        self._batches.collator = (
            collator_rng.holder(self._base.collate_fn) if self._batches.record_rng else None
        )
        self._saved.signature = {
            "steps_in_epoch": len(loader),
            "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
            "per_device_batch_size": int(trainer._train_batch_size),
            "world_size": int(args.world_size),
            "num_samples": len(loader.dataset),
        }
        self._saved.model_info = checks.model_info(trainer.model)
        self._epoch_calls = self._epoch_offset = 0
        self._pending, self._epoch_ended, self._resume = None, False, None
        self._same_epochs = False
        self._logged_commit, self._final_logged = None, False
        self.restored_step = None

        ckpt = Checkpointer(dirpath, **options)
        ckpt.logs_through_framework = True
        ckpt.restore_advice = resumed.advice()
        ckpt.load_notices = lambda: self._saved.load_notices(trainer.args)  # (said by restore)
        if self._save_every_epoch:
            ckpt.saves_on_caller_schedule("every epoch end (save_strategy='epoch')")
        self.checkpointer = ckpt
        self._trainer = trainer
        try:
            self._saved.build(trainer, self._batches)
            if state.global_step > 0:
                log.info(
                    "train(resume_from_checkpoint=...) restored step %d: ResilientCheckpoint "
                    "does not auto-resume this run and saves into %s from here on",
                    state.global_step,
                    dirpath,
                )
                ckpt.continued_from(state.global_step, "train(resume_from_checkpoint=...)")
            else:
                auto_batch.check_ahead(trainer, ckpt, self._saved.signature)
                step = ckpt.restore(self._saved.tree)
                if step:
                    trials.check_restored(self._saved.values.get("trial"), trial, step)
                    auto_batch.check(trainer, self._saved.values, self._saved.signature, step)
                    resumed.apply(self, trainer, state, step)
            hooks.wrap(trainer, "_run_epoch", self._run_epoch)
            hooks.wrap(trainer, "_maybe_log_save_evaluate", self._after_step)
            hooks.wrap(trainer.callback_handler, "on_train_end", self._train_end)
            progress.set_before_callbacks(trainer.callback_handler, self._next_epoch)
        except BaseException:
            self._trainer = None
            ckpt.close()
            raise

    # ------------------------------------------------------------------ the Trainer's loop

    def _run_epoch(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        return epoch_loop.run_epoch(self, original, *args, **kwargs)

    def _next_epoch(self) -> float | None:  # state.epoch of the step ending now (progress.py)
        if self._trainer is None:
            return None
        gas = int(self._trainer.args.gradient_accumulation_steps)
        return progress.epoch_at(self._epoch, self._updates + 1, gas, self._steps_in_epoch)

    def _after_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if self._trainer is None or self._pending is None:
            self._epoch_ended = False
            return result
        control = self._trainer.control
        if self._epoch_ended:
            self._epoch_ended = False
            self._complete(epoch_end=True)
        elif not (
            self._updates >= self._updates_per_epoch
            or control.should_epoch_stop
            or control.should_training_stop
        ):
            self._complete(epoch_end=False)
        # else: the epoch ends after this step; its end-of-epoch logging and evaluation belong
        # to this step's state, so the checkpoint waits for them.
        return result

    def _complete(self, epoch_end: bool) -> None:
        """Step ``self._pending`` is complete: hand it to the Checkpointer."""
        trainer, ckpt = self._trainer, self.checkpointer
        assert ckpt is not None and self._pending is not None
        state, control = trainer.state, trainer.control
        step, self._pending = self._pending, None
        epoch_done = self._updates >= self._updates_per_epoch or (
            control.should_epoch_stop and not control.should_training_stop
        )
        position = (
            (self._epoch + 1, 0) if epoch_end and epoch_done else (self._epoch, self._updates)
        )
        rng = self._batches.epoch_rng if self._batches is not None else None
        self._saved.refresh(trainer, position, rng, self._next_batch_rng(position))
        metrics, self._step_metrics = self._step_metrics, {}
        final = control.should_training_stop or state.global_step >= state.max_steps
        # the last step as a final save: taken whatever the schedule, and by the remote tier
        # whatever remote_every_n_saves says
        saved = ckpt.step(step, self._saved.tree, metrics, final=final and self.save_on_train_end)
        if ckpt.preempted:  # exit_on_preemption=False: train() returns (saved as not stopped)
            control.should_training_stop = True
        force = (
            self.save_on_evaluate and self.monitor is not None and self.monitor in metrics
        ) or (epoch_end and self._save_every_epoch)
        if force and not saved:
            saved = ckpt.save(step, self._saved.tree, metrics)
        if saved and self.log_save_metrics:
            logs = trainer_state.save_logs(ckpt)
            if logs:
                trainer.log(logs)
                self._logged_commit = ckpt.last_save.step if ckpt.last_save else None
        if saved:
            # telemetry="logger": every checkpoint metric through the Trainer's log, so every
            # report_to integration (TensorBoard, MLflow, W&B) receives them
            sinks.to_framework(ckpt, trainer.log)

    def _next_batch_rng(self, position: tuple[int, int]) -> dict[str, Any] | None:
        """The random states the batch at ``position`` (epoch, optimizer steps) was collated
        from, if this process collated it already: accelerate's loader fetches one batch ahead,
        so a collator's draws (masking) for the step after a save happen before it."""
        b, gas = self._batches, int(self._trainer.args.gradient_accumulation_steps)
        if b is None or b.before_batch is None or position != (self._epoch, self._updates):
            return None
        return encode_cpu_rng(b.before_batch) if b.handed == self._updates * gas > 0 else None

    def _record(self, values: Any) -> None:
        if self._trainer is not None:
            self._step_metrics.update(trainer_state.scalar_metrics(values))

    # ------------------------------------------------------------------ end

    def _abort(self, exc: BaseException) -> None:
        """``train()`` is leaving with an exception: save it if configured
        (``save_on_exception``), then close and unwrap."""
        trainer, ckpt = self._trainer, self.checkpointer
        self._trainer = None
        self._release(trainer)
        if ckpt is not None:
            try:
                ckpt.abort(exc)
            except Exception as e:  # the training error propagates; this one is reported
                log.error("closing the checkpointer after %s failed: %s", type(exc).__name__, e)

    def _finish(self) -> None:
        trainer, ckpt = self._trainer, self.checkpointer
        self._trainer = None
        self._release(trainer)
        if ckpt is not None:
            ckpt.close()  # also destroys its background gloo group (needed under torchrun)

    def _release(self, trainer: Any) -> None:
        """Unwrap the Trainer's methods; give the data loader back its own generator and the
        arguments their ``eval_on_start``."""
        if trainer is not None:
            for name in hooks.WRAPPED:
                hooks.unwrap(trainer, name)
            for event in ("on_epoch_begin", "on_train_end", "on_step_end"):
                hooks.unwrap(trainer.callback_handler, event)
            self._restored_rng = None
            if self._eval_on_start:
                trainer.args.eval_on_start, self._eval_on_start = True, False
        if self._base is not None:
            self._base.generator = self._own_generator
            self._base = None
