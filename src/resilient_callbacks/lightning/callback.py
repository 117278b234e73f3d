"""``ResilientCheckpoint``: the Lightning callback. Each hook is a guard plus a core call.

Which ranks call what: Lightning runs every hook on every rank, at the same points, so every
rank constructs the ``Checkpointer`` (at ``fit``'s checkpoint-restore point) and calls
``restore``, ``step`` and ``close`` together, as the core requires.

How it plugs into ``Trainer.fit`` (Lightning 2.x):

- ``setup``: checks the strategy (single device or DDP), and wraps trainer internals for this
  ``fit`` (:mod:`.patches`): ``_checkpoint_connector.resume_start`` (where Lightning loads
  ``ckpt_path``) and ``fit_loop._load_combined_loader_states`` (where it restores the train
  dataloaders, after it built them and before it iterates them). ``teardown`` unwraps them.
- ``resume_start`` (:mod:`.resuming`): constructs the ``Checkpointer``. Without ``ckpt_path``
  it restores the newest valid checkpoint (falling back loudly) and hands Lightning's checkpoint
  dictionary to the connector, which restores model, datamodule, callbacks, loops, optimizers,
  schedulers and precision plugin exactly as for ``fit(ckpt_path=...)``. An explicit
  ``ckpt_path`` wins, but for a file Lightning's ``"last"`` picks when ours is as new
  (:mod:`.last`).
- train dataloaders: plain shuffled ``DataLoader``\\ s become ``ResumableDataLoader``\\ s
  (``loaders.py``), so their position is part of the checkpoint.
- ``on_train_start``: takes SIGTERM / SIGUSR1 back from Lightning's signal connector. The
  restored RNG states are put back right before the resumed epoch's first batch (:mod:`.boundary`:
  creating dataloader iterators, the sanity check and ``on_train_start`` hooks draw in between).
- step boundary: a batch that made an optimizer step is handed to ``Checkpointer.step`` (which
  decides, saves and handles preemption) once Lightning finished it: after its validation and
  plateau schedulers, and at an epoch's last batch after the epoch's end (:mod:`.boundary`).
- ``on_before_optimizer_step`` and ``on_validation_start`` (``WeightAveraging`` writes the
  model in place for a validation, which can follow a save before the next optimizer step)
  wait for the overlapped snapshot copy of the previous save.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from ..adapter import check_options
from ..checkpointer import Checkpointer, SaveStats
from ..errors import ConfigError
from . import (
    boundary,
    checks,
    deepspeed,
    ending,
    evaluate,
    patches,
    quiet,
    resuming,
    save_logs,
    sharded,
    stops,
    tuning,
)
from . import state as st
from .conversion import lossy_keys
from .loaders import prepare_train_loaders
from .model_checkpoints import remove_rolled_back
from .on_exception import ExceptionSave

log = logging.getLogger("resilient_callbacks.lightning")


class ResilientCheckpoint(Checkpoint):
    """Fault-tolerant checkpoints and exact auto-resume for ``Trainer.fit``.

    Args:
        dirpath: checkpoint directory (local or a shared mount). Default:
            ``<trainer.default_root_dir>/resilient_checkpoints``, the same on every run, so
            re-running the script resumes.
        make_dataloaders_resumable: rebuild plain ``DataLoader``\\ s (random, sequential or
            distributed sampler) as ``ResumableDataLoader``\\ s for exact mid-epoch resume.
            They draw exactly as the loaders they replace, so an uninterrupted run is the run
            without this callback.
        data_seed: ``None`` (default): a rebuilt random-sampler loader shuffles as the original
            (from the global torch RNG, which ``seed_everything`` seeds). An int: it shuffles
            from ``torch.Generator().manual_seed(data_seed)`` instead, independent of the global
            RNG (a different order than the original loader's). DDP's ``DistributedSampler``
            keeps its own seed.
        save_on_exception: when training raises, save the last completed step before the
            exception propagates (single process; nothing is saved if an optimizer began
            updating the weights since that step, nor during a validation with a ``WeightAveraging`` callback,
            whose averaged weights the model then holds).
        log_stats: log save timings and sizes through the trainer's loggers.
        **checkpointer_kwargs: passed to :class:`~resilient_callbacks.Checkpointer`:
            ``every_n_steps``, ``every_seconds``, ``adaptive``/``mtbf_hours``, ``keep_last``,
            ``keep_best``/``monitor``/``mode`` (``monitor`` names a key of
            ``trainer.callback_metrics``), ``async_save``, ``overlap_snapshot`` (default True
            here), ``remote``/``remote_options``, ``preemption``, ``signals``, ``resume``, ...
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        make_dataloaders_resumable: bool = True,
        data_seed: int | None = None,
        save_on_exception: bool = False,
        log_stats: bool = True,
        **checkpointer_kwargs: Any,
    ) -> None:
        ours = ("dirpath", "make_dataloaders_resumable", "data_seed", "save_on_exception")
        check_options("ResilientCheckpoint (Lightning)", checkpointer_kwargs, (*ours, "log_stats"))
        checks.own_options(
            make_dataloaders_resumable=make_dataloaders_resumable,
            save_on_exception=save_on_exception,
            log_stats=log_stats,
            data_seed=data_seed,
        )
        kwargs = dict(checkpointer_kwargs)
        kwargs.setdefault("overlap_snapshot", bool(kwargs.get("async_save", True)))
        checks.validate(dirpath, kwargs)
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.make_dataloaders_resumable = make_dataloaders_resumable
        self.data_seed = data_seed
        self.save_on_exception = save_on_exception
        self.log_stats = log_stats
        self._kwargs = kwargs
        self._section: dict[str, Any] | None = None  # DeepSpeedStrategy's config section
        self.checkpointer: Checkpointer | None = None
        self.restored_step: int | None = None
        self.preempted = False
        self._converter = st.Converter()
        self._unpatch: list[Any] = []
        self._reset_fit_state()

    def _reset_fit_state(self) -> None:
        self._ctx: st.SaveContext | None = None
        self._state: dict[str, Any] | None = None
        self._resume_started = False  # this fit()'s resume_start ran
        self._resumed_stopped: bool | str = False  # the restored step is where a run stopped
        self._past_end: str | None = None  # ... is past this fit()'s end (:mod:`.stages`)
        self._val_iterators_made = False  # ... and the run's persistent val iterators existed
        self._stop_rng: dict[str, Any] | None = None  # the streams before a stop's validation
        self._last_step: int | None = None
        self._step_end: boundary.StepEnd | None = None  # a step waiting for Lightning's work
        self._last_end: boundary.StepEnd | None = None  # ... and the last one it finished
        self._resume: boundary.Resume | None = None
        self._our_handlers: dict[int, Any] = {}
        self._on_exception = ExceptionSave()
        self._logged_save: SaveStats | None = None
        self._unresumable: list[str] = []
        self._close_error: tuple[Exception, Any, Any] | None = None  # (:mod:`.ending`)

    # ------------------------------------------------------------------ Lightning API

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath)

    @property
    def best_model_path(self) -> str:
        """The best ``.ckpt`` of a ``ModelCheckpoint`` in the same trainer, else ``""``: so
        ``trainer.test(ckpt_path="best")`` behaves as without this callback (this callback's
        checkpoints are directories in its own format)."""
        trainer = getattr(self, "_trainer", None)
        for cb in checks.callbacks(trainer):
            if isinstance(cb, ModelCheckpoint):
                return cb.best_model_path
        return evaluate.best_path(self, trainer) or getattr(self, "_best_model_path", "")

    @best_model_path.setter
    def best_model_path(self, path: str) -> None:
        # Lightning's spawn launchers (ddp_spawn, ddp_notebook) set the worker's value in the
        # main process, whose callbacks never ran setup: kept for the getter there
        self._best_model_path = path

    # ------------------------------------------------------------------ setup / teardown

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING.value:  # (validate/test/predict: evaluate.py)
            evaluate.at_setup(self, trainer)
            return
        checks.check_strategy(trainer)
        if deepspeed.is_deepspeed(trainer):
            deepspeed.check(trainer)
            section = deepspeed.take_section(trainer)  # before the strategy's deepspeed.initialize
            if section is not None:
                self._section = section
        mine = [cb for cb in checks.callbacks(trainer) if isinstance(cb, ResilientCheckpoint)]
        if len(mine) > 1:
            raise ConfigError(
                "the Trainer has several ResilientCheckpoint callbacks; use one (a checkpoint "
                "directory has one writer)"
            )
        self._trainer = trainer
        self._reset_fit_state()
        self.restored_step = None
        self.preempted = False
        if why := tuning.not_the_run(trainer):  # fast_dev_run, the Tuner's fit
            self._unpatch_all()
            rank_zero_info(f"ResilientCheckpoint: {why}: neither resumes nor saves")
            return
        self._patch(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the last saves commit in the background: the loggers get them once they did
        if (ckpt := self.checkpointer) is not None and not ckpt.closed:
            self._logged_save = save_logs.at_end(trainer, ckpt, self.log_stats, self._logged_save)

    def _run_ends(self, trainer: pl.Trainer) -> None:  # before the on_train_end hooks (stops.py)
        marks, ctx = functools.partial(self._marks, trainer, False), self._ctx
        stops.save_stopped_step(trainer, self.checkpointer, ctx, self._state, self._last_end, marks)
        if self._resume is not None:
            self._resume.before_run_end(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        ending.teardown(self, trainer, stage)

    def _patch(self, trainer: pl.Trainer) -> None:
        self._unpatch_all()

        def resumed(method: str) -> Any:
            return lambda: self._resume and getattr(self._resume, method)(trainer)

        self._unpatch = patches.wrap_fit(
            trainer,
            patches.FitHooks(
                resume_start=functools.partial(resuming.resume_start, self, trainer),
                before_lr_schedulers=resumed("before_lr_schedulers"),
                before_loader_states=functools.partial(self._prepare_loaders, trainer),
                after_setup_data=resumed("after_setup_data"),
                before_val_setup=functools.partial(self._validation_starts, trainer),
                after_val_setup=functools.partial(self._val_loaders_ready, trainer),
                after_batch=functools.partial(self._after_batch, trainer),
                before_epoch_start=resumed("before_epoch_start"),
                before_epoch_run=resumed("before_epoch_run"),
                before_epoch_end=resumed("before_epoch_end"),
                after_epoch_end=functools.partial(self._after_epoch_end, trainer),
                before_run_end=functools.partial(self._run_ends, trainer),
                after_run=resumed("after_run"),
            ),
        )

    def _unpatch_all(self) -> None:
        while self._unpatch:
            self._unpatch.pop()()

    # ------------------------------------------------------------------ dataloaders

    def _prepare_loaders(self, trainer: pl.Trainer) -> None:
        if self.make_dataloaders_resumable:
            self._unresumable += prepare_train_loaders(trainer, self.data_seed)
        if self._resume is not None:
            self._resume.before_loader_states(trainer)

    def _marks(self, trainer: pl.Trainer, epoch_end: bool, to_cpu: bool = True) -> dict[str, Any]:
        """What a save at this step records besides Lightning's dictionary (before a preemption)."""
        made = any(dl._iterator is not None for dl in patches.persistent_val_loaders(trainer))
        return {
            st.STOPPED_KEY: stops.recorded(trainer),  # before min_epochs too: it persists
            st.ACCUMULATE_KEY: trainer.accumulate_grad_batches,
            st.VAL_ITERATORS_KEY: made,
            **boundary.marks(trainer, epoch_end, to_cpu),  # (metrics, trainable parameters)
            st.STOP_RNG_KEY: self._stop_rng,  # (per rank)
        }

    def _validation_starts(self, trainer: pl.Trainer) -> None:
        self._stop_rng = stops.before_validation(trainer) or self._stop_rng

    def _val_loaders_ready(self, trainer: pl.Trainer) -> None:
        if self._val_iterators_made:  # (the resumed run's first validation)
            self._val_iterators_made = False
            patches.seed_val_loaders_aside(trainer)

    # ------------------------------------------------------------------ training

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reclaim_signals()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if tuning.not_the_run(trainer):
            return
        if self.checkpointer is None:
            raise RuntimeError(
                "ResilientCheckpoint could not hook into Trainer.fit's checkpoint loading "
                f"(lightning {pl.__version__}: _checkpoint_connector.resume_start was not "
                "called), so it would neither resume nor save. This Lightning version is not "
                "supported; please report it."
            )
        self._reclaim_signals()
        lossy = lossy_keys(pl_module, getattr(trainer, "datamodule", None))
        self._ctx, self._state = sharded.save_context_and_state(
            trainer, pl_module, lossy, self._converter
        )
        # Preflight: a value that cannot be saved fails now, not at the first save (read
        # without the on_save_checkpoint hooks, which run for saves only: :mod:`.quiet`)
        with quiet.preflight():
            self._ctx.rest()
        self._ctx.reset()
        if self.save_on_exception:
            self._on_exception.hook_optimizers(trainer.optimizers)
        self._last_step = trainer.global_step
        if self._resume is not None:
            self._resume.train_start(trainer)
            start = self.checkpointer.run_start if self._resume.auto else None  # chosen: kept
            remove_rolled_back(trainer, self.restored_step, start)
        on = stops.trains_on(trainer, self._resumed_stopped)
        if on is not None and self._resume is not None:
            rank_zero_info(f"ResilientCheckpoint: training on from step {self.restored_step}: {on}")
            self._resume.train_on()  # as if it had never stopped (no validation at the stop)
        elif self._resumed_stopped:
            # should_stop was set by the restored step (early stopping, max_time, the user's
            # code): re-running the finished script trains nothing, as for max_steps -- or, set
            # before min_epochs/min_steps were met, trains on to them, as the run did
            trainer.should_stop = True
            if checks.stops(trainer):
                rank_zero_info(
                    f"ResilientCheckpoint: the run stopped at step {self.restored_step} "
                    f"({stops.why(self._resumed_stopped)}) and that is its last checkpoint: "
                    "nothing to train"
                )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step_end is not None:
            log.debug("Lightning did not finish step %d: no checkpoint of it", self._step_end.step)
            self._step_end = None

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._state is None:
            return
        step = trainer.global_step
        if step == self._last_step:
            return  # accumulating gradients: no optimizer step in this batch
        self._last_step = step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._step_end = boundary.step_end(trainer, step, loss)

    def _after_batch(self, trainer: pl.Trainer) -> None:
        if self._step_end is not None and not boundary.ends_epoch(trainer):
            self._boundary(trainer, epoch_end=False)

    def _after_epoch_end(self, trainer: pl.Trainer) -> None:
        if self._step_end is not None:
            self._boundary(trainer, epoch_end=True)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointer is not None:  # (see the module's docstring)
            self.checkpointer.wait_for_snapshot()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # After forward/backward (the closure), before the update: the previous save's
        # parameter and optimizer-state copy must be complete.
        if self.checkpointer is not None:
            self.checkpointer.wait_for_snapshot()

    def _boundary(self, trainer: pl.Trainer, epoch_end: bool) -> None:
        """Lightning finished the step in ``self._step_end``: hand it to the Checkpointer."""
        ckpt, ctx, state, end = self.checkpointer, self._ctx, self._state, self._step_end
        assert ckpt is not None and ctx is not None and state is not None and end is not None
        self._step_end, self._last_end = None, end
        step, loss = end.step, end.loss
        ctx.reset(marks=functools.partial(self._marks, trainer, epoch_end))
        ctx.fit_loop_override = end.fit_loop
        metrics = st.finite_metrics(trainer.callback_metrics)
        loss_key = self._kwargs.get("loss_key", "loss")
        if self._kwargs.get("loss_jump") and loss_key not in metrics and loss is not None:
            metrics[loss_key] = loss.detach() if isinstance(loss, torch.Tensor) else loss
        # the last step is saved whatever the schedule, as a final save (which the remote tier
        # always takes, remote_every_n_saves or not); SystemExit(75) after a preemption save
        saved = ckpt.step(step, state, metrics, final=checks.is_final(trainer, epoch_end))
        if ckpt.preempted:
            self.preempted = True
            trainer.should_stop = True  # exit_on_preemption=False: stop after this step
        if self.save_on_exception and ckpt.world_size == 1:
            marks = self._marks(trainer, epoch_end, to_cpu=False)
            self._on_exception.remember(trainer, step, end.fit_loop, marks)
        self._logged_save = save_logs.after_step(
            trainer, ckpt, saved, self.log_stats, self._logged_save
        )

    # ------------------------------------------------------------------ failures

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        ending.on_exception(self, trainer, exception)

    def _reclaim_signals(self) -> None:
        """Lightning's signal connector registers its SIGTERM handler (and, under Slurm, a
        requeue handler) after the Checkpointer installed its own; SIGTERM then would both stop
        Lightning (``SIGTERMException``) and run a collective inside the handler. Put ours back:
        the Checkpointer saves at the next step boundary and exits (code 75)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._our_handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)

    def _close(self, raise_errors: bool) -> None:
        ending.close(self, raise_errors)
