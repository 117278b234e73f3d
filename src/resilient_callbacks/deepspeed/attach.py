"""``initialize`` and ``attach``: a DeepSpeed engine that checkpoints itself.

::

    import resilient_callbacks.deepspeed as rcds
    engine, optimizer, loader, scheduler = rcds.initialize(
        model=model, model_parameters=model.parameters(), training_data=ds, config="ds.json")
    for batch in loader:                # continues mid-epoch after a resume
        loss = engine(batch); engine.backward(loss); engine.step()   # saves when due

Every rank calls these at the same point (they restore, and ``engine.step`` saves, with
collectives). After each ``engine.step()`` that completes an optimizer step (the end of a
gradient-accumulation cycle), the Checkpointer is told ``engine.global_steps`` and saves when its
schedule says so, answers a preemption signal (emergency save, exit 75) and keeps the retention
limits. :func:`initialize` restores the newest valid checkpoint into the engine before it
returns.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from .. import closing
from ..checkpointer import Checkpointer
from ..data import ResumableDataLoader
from ..errors import AT_CALLER, ConfigError, UnsupportedStateError, warn_and_log
from ..state_marks import PerRank
from . import section
from .engine_state import advice, check_config, engine_state
from .evaluation import EvaluationWatch
from .launch import launched, register
from .own_calls import OwnCalls

log = logging.getLogger("resilient_callbacks")

# DeepSpeedDataLoader's worker processes per rank under a process group (2 x one device)
DS_LOADER_WORKERS = 2


class DeepSpeedCheckpoint:
    """The checkpointing of one engine: its state, its :class:`Checkpointer`, and the wrapped
    ``engine.step``. Made by :func:`attach` (and :func:`initialize`); reachable as
    ``engine.resilient_checkpoint``."""

    def __init__(self, engine: Any, state: Any = None, **options: Any) -> None:
        other = getattr(engine, "resilient_checkpoint", None)
        if isinstance(other, DeepSpeedCheckpoint) and engine.__dict__.get("step") == other._step:
            # a second handle would wrap the first's step(), and closing either unwraps both
            raise ConfigError(
                "this engine is already checkpointed (engine.resilient_checkpoint, into "
                f"{other.checkpointer.dirpath}; from resilient_callbacks.deepspeed.initialize "
                "or an earlier attach()): use that handle, or close() it before attaching again"
            )
        self.engine = engine
        self.state: dict[str, Any] = {"engine": engine_state(engine)}
        if state is not None:
            self.state["user"] = state
        self.checkpointer: Checkpointer = Checkpointer(**options)
        self.checkpointer.restore_advice = advice()  # (its restore runs inside our calls)
        self.restored_step: int | None = None
        self._entered = False  # inside `with handle:` (which sees an exception)
        self._told_unguarded = False
        self._engine_step = engine.step
        engine.step = self._step  # an instance attribute: shadows DeepSpeedEngine.step
        # says when an evaluation after a checkpointed step draws random numbers
        self._evaluation = EvaluationWatch(engine)
        # engine.load_checkpoint/save_checkpoint on our directory: refused / warned about
        self._own_calls = OwnCalls(engine, self.checkpointer.dirpath)
        engine.resilient_checkpoint = self

    def restore(self) -> int:
        """Collective. Load the checkpoint chosen by ``resume`` into the engine (and the extra
        state); return ``engine.global_steps`` after it (0 for a fresh start)."""
        self.restored_step = self.checkpointer.restore(self.state)
        report = self.checkpointer.last_restore
        if self.restored_step:
            self._evaluation.checkpointed(self.restored_step, restored=True)
        if report is not None:
            # through DeepSpeed's logger, as a WARNING: the level its logger shows by default
            # (a resume must be visible, as with the Trainer's and Lightning's adapters)
            from deepspeed.utils import log_dist

            where = f"global_steps {self.engine.global_steps}"
            log_dist(
                f"resilient_callbacks: {report.describe(where)}", ranks=[0], level=logging.WARNING
            )
        return self.restored_step

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        # An optimizer step happened when global_steps moved: under DeepSpeed's own gradient
        # accumulation that is at its boundaries; with "managed_gradient_accumulation": false
        # at every step() (is_gradient_accumulation_boundary() says so only inside step()).
        # A step the fp16 loss scaler skipped still advances global_steps.
        self._evaluation.stepped()
        before = self.engine.global_steps
        out = self._engine_step(*args, **kwargs)
        if self.engine.global_steps != before:
            if not self._told_unguarded:
                self._warn_if_unguarded()
            step = int(self.engine.global_steps)
            if self.checkpointer.step(step, self.state):
                self._evaluation.checkpointed(step)
        return out

    def _warn_if_unguarded(self) -> None:
        """``save_on_exception`` needs to see the exception: say so, once, when no ``with``
        block and no launcher will show it one."""
        self._told_unguarded = True
        if self.checkpointer.config.save_on_exception and not (self._entered or launched()):
            msg = (
                "save_on_exception is set, but the training loop does not run inside `with "
                "engine.resilient_checkpoint:` (nor under resilient_callbacks.deepspeed.run): "
                "an exception will not be saved"
            )
            warn_and_log(log, msg, UserWarning, stacklevel=AT_CALLER)  # the user's engine.step()

    def save(self, *, final: bool = False) -> bool:
        """Collective. Save now; ``final=True`` at the end of training (the remote tier always
        takes a final save)."""
        step = int(self.engine.global_steps)
        saved = self.checkpointer.save(step, self.state, final=final)
        if saved:
            self._evaluation.checkpointed(step)
        return saved

    def close(self, timeout: float | None = None) -> None:
        """Flush pending saves and uploads; give ``engine.step`` back (also when the close
        raises: ``UploadIncompleteError`` after an outage)."""
        try:
            self.checkpointer.close(timeout)
        finally:
            self._unwrap()

    def abort(self, exc: BaseException) -> None:
        """Training failed with ``exc``: with ``save_on_exception``, save the last step
        ``engine.step()`` completed (one rank: see :meth:`Checkpointer.abort`), then close."""
        self.checkpointer.abort(exc)
        self._unwrap()

    def _unwrap(self) -> None:
        """Give ``engine.step``, ``eval`` and ``train`` back (DeepSpeedEngine's own)."""
        if self.engine.__dict__.get("step") == self._step:
            del self.engine.step
        self._evaluation.unwrap()
        self._own_calls.unwrap()

    def __enter__(self) -> DeepSpeedCheckpoint:
        self._entered = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and not closing.clean_exit(exc):  # (sys.exit(0): close() raises)
            self.abort(exc)
        else:
            self.close()


def attach(
    engine: Any, state: Any = None, *, restore: bool = True, **options: Any
) -> DeepSpeedCheckpoint:
    """Checkpoint an engine made elsewhere: ``options`` are :class:`Checkpointer` options
    (``dirpath`` required), ``state`` extra state saved beside the engine's (a data loader in
    :class:`~resilient_callbacks.PerRank`, user values). With ``restore`` (default), the newest
    valid checkpoint is loaded before it returns (``.restored_step`` says which step)."""
    if not options.get("dirpath"):
        raise ConfigError("attach() needs dirpath=: where to write checkpoints")
    section.validate(options, "attach()")
    handle = DeepSpeedCheckpoint(engine, state, **options)
    handle._own_calls.attached = True  # (its messages name attach()'s keywords)
    if restore:
        handle.restore()
    register(handle)  # under the launcher: saved at the script's end, or aborted
    return handle


def _resumable_loader(engine: Any, dataset: Any, collate_fn: Any) -> ResumableDataLoader:
    """The loader DeepSpeed's own would be (``DeepSpeedDataLoader`` under a process group:
    ``DistributedSampler(seed=0)`` whose ``set_epoch`` is never called, so every epoch comes in
    the same order; the micro-batch size; its drop_last; 2 worker processes; pinned memory),
    whose position is saved: a resumed run goes on mid-epoch. Under the launcher the script's
    own epoch loop starts at 0 again after a restart: the loader's passes are lined up with
    epochs (``passes_are_epochs``)."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return ResumableDataLoader(
        dataset,
        batch_size=engine.train_micro_batch_size_per_gpu(),
        seed=0,
        num_replicas=world,
        rank=rank,
        drop_last=bool(engine.dataloader_drop_last()),
        collate_fn=collate_fn,
        reshuffle=False,
        num_workers=DS_LOADER_WORKERS,
        pin_memory=True,
        passes_are_epochs=launched(),
    )


def _refuse_curriculum_sampling(config: Any) -> None:
    """DeepSpeed's curriculum data sampling (``data_efficiency.data_sampling.
    curriculum_learning``, read as DeepSpeed reads it: its own ``enabled``) orders the batches
    of the loader DeepSpeed makes from ``training_data``; ours, which replaces that loader,
    does not: the run would train without its curriculum, in silence. Refused before DeepSpeed
    builds the engine."""
    sampling = (config.get("data_efficiency") or {}) if isinstance(config, dict) else {}
    curriculum = (sampling.get("data_sampling") or {}).get("curriculum_learning") or {}
    if isinstance(curriculum, dict) and curriculum.get("enabled"):
        raise UnsupportedStateError(
            "resilient_callbacks.deepspeed: curriculum data sampling "
            '("data_efficiency": {"data_sampling": {"curriculum_learning": ...}}) with '
            "training_data= is not supported yet: the loader that replaces DeepSpeed's (to "
            "save its position) does not apply the curriculum. Turn curriculum sampling off, or build the engine with "
            "deepspeed.initialize and checkpoint it with rcds.attach (the loader's position is "
            "then yours to save, in attach's state=)"
        )


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    *,
    config: Any = None,
    collate_fn: Any = None,
    checkpoint: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with checkpointing from the config's ``"resilient_checkpoint"``
    section (or ``checkpoint=``, a dict of the same options, which wins key by key). Same
    arguments and return value; the engine is restored from the newest valid checkpoint before
    it returns, and the data loader (from ``training_data``) continues mid-epoch.

    Without a section and without ``checkpoint=``, this is ``deepspeed.initialize`` unchanged.
    """
    import deepspeed

    from .launch import original_initialize

    ds_initialize = original_initialize() or deepspeed.initialize
    if "config_params" in kwargs:  # deepspeed.initialize's other name for config
        if config is not None:
            raise ValueError("pass config= or config_params=, not both")
        config = kwargs.pop("config_params")
    for flag in ("deepspeed_config", "deepscale_config"):  # (the second: its deprecated name)
        if config is None and getattr(args, flag, None) is not None:
            config = getattr(args, flag)
            args = copy.copy(args)  # the caller's args keep their config
            setattr(args, flag, None)  # DeepSpeed refuses a config given twice
    clean, options = section.split(config) if config is not None else (None, None)
    if checkpoint is not None:
        options = {**(options or {}), **checkpoint}
        section.validate(options, "checkpoint=")
    common = dict(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        lr_scheduler=lr_scheduler, **kwargs,
    )  # fmt: skip
    if options is None:
        said = section.without_section(config, launched()) if config is not None else None
        if said:
            warn_and_log(log, f"resilient_callbacks: {said}", UserWarning, stacklevel=AT_CALLER)
        return ds_initialize(
            training_data=training_data, config=config, collate_fn=collate_fn, **common
        )
    if launched() and optimizer is None and not (clean or {}).get("optimizer"):
        # under the launcher, an engine DeepSpeed gives no optimizer (a teacher, an evaluator
        # built from the training config) is left as DeepSpeed makes it: nothing to resume
        log.warning(
            "resilient_callbacks: an engine without an optimizer is not checkpointed (it has "
            "nothing to resume); the engines that train are"
        )
        return ds_initialize(
            training_data=training_data, config=clean, collate_fn=collate_fn, **common
        )
    check_config(clean)
    if training_data is not None:
        _refuse_curriculum_sampling(clean)
    # training_data: ours below, whose position is part of the checkpoint
    engine, opt, _, sched = ds_initialize(training_data=None, config=clean, **common)
    loader = None
    extra: dict[str, Any] = {}
    if training_data is not None:
        loader = _resumable_loader(engine, training_data, collate_fn)
        engine.training_dataloader = loader  # where DeepSpeed keeps the loader it makes
        # on more ranks than wrote the checkpoint, new ranks re-shard from rank 0's position
        extra["data"] = PerRank(loader, new_ranks="rank0")
    handle = DeepSpeedCheckpoint(engine, extra or None, **options)
    handle.restore()
    register(handle)  # under the launcher: saved at the script's end, or aborted
    return engine, opt, loader, sched
