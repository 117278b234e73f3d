"""How :class:`~.callback.ResilientCheckpoint` resumes a ``fit()``: its wrapper of Lightning's
``_checkpoint_connector.resume_start`` (installed by :mod:`.patches` at ``setup``), which opens
the ``Checkpointer`` and decides where the run continues from: an explicit ``ckpt_path`` (one of
ours, or Lightning's file unless ours is as new: :mod:`.last`), the live state of a ``fit()``
called again on the same Trainer (:mod:`.refit`), or the newest valid checkpoint in the
directory, restored by the core and handed to the connector as Lightning's checkpoint
dictionary, which then restores everything as for ``fit(ckpt_path=...)``.

Which ranks call what: Lightning calls ``resume_start`` on every rank at the same point of
``fit()``, so every rank constructs its ``Checkpointer`` and calls ``restore`` together, as the
core requires.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from .. import rng
from ..adapter import with_section
from ..checkpointer import Checkpointer
from ..manifest import MANIFEST_NAME
from . import boundary, checks, last, refit, sharded, stages, tuning
from . import state as st

if TYPE_CHECKING:
    from .callback import ResilientCheckpoint

log = logging.getLogger("resilient_callbacks.lightning")


def resume_start(
    cb: ResilientCheckpoint,
    trainer: pl.Trainer,
    original: Any,
    checkpoint_path: Any,
    weights_only: Any,
) -> None:
    if trainer.state.fn != TrainerFn.FITTING or cb._resume_started:
        original(checkpoint_path, weights_only)  # (a finder restoring its file: tuning.py)
        return
    cb._resume_started = True
    resume = cb._kwargs.get("resume", "auto")
    lightning_ckpt = None
    if checkpoint_path:
        path = os.fspath(checkpoint_path)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST_NAME)):
            resume = path  # one of ours, given explicitly
        elif resume != "auto" or not last.prefers_ours(trainer, path, dirpath(cb, trainer)):
            lightning_ckpt, resume = checkpoint_path, "never"
    open_checkpointer(cb, trainer, resume)
    ckpt = cb.checkpointer
    assert ckpt is not None
    if refit.goes_on_live(trainer, ckpt.dirpath, resume, bool(checkpoint_path)):  # fit() again
        original(None, weights_only)  # Lightning's: the live state, fresh optimizers
        ckpt.continued_from(trainer.global_step, "this Trainer's fit() before", same_run=True)
        return
    if lightning_ckpt is not None:
        log.info(
            "fit(ckpt_path=%s) given: resuming from it, not from %s; new checkpoints go to %s",
            lightning_ckpt,
            ckpt.dirpath,
            ckpt.dirpath,
        )
        original(checkpoint_path, weights_only)
        loaded = trainer._checkpoint_connector._loaded_checkpoint or {}
        step = loaded.get("global_step")
        if isinstance(step, int):
            ckpt.continued_from(step, f"fit(ckpt_path={os.fspath(lightning_ckpt)!r})")
        return
    is_sharded = sharded.is_sharded(trainer)
    holder = sharded.receivers(trainer) if is_sharded else st.receivers()
    live = rng.capture()  # setup draws from these till the first batch (as the run did)
    step = ckpt.restore(holder)
    if ckpt.restored_from is None:
        if resume != "auto" or ckpt.config.read_only:  # (else the core said where it looked)
            log.info("no checkpoint in %s: starting fresh", ckpt.dirpath)
        original(None, weights_only)
        return
    if is_sharded:  # weights and optimizer states are loaded: the part checked they fit
        checkpoint = sharded.assemble(holder)
    else:
        checkpoint = st.assemble(holder, trainer.lightning_module)
        checks.check_model_fits(trainer, checkpoint["state_dict"], ckpt.restored_from)
    checkpoint = checks.migrate(checkpoint, ckpt.restored_from)
    conn = trainer._checkpoint_connector
    conn._ckpt_path = ckpt.restored_from
    conn._loaded_checkpoint = checkpoint
    cb.restored_step = step
    # the random streams as the core restored them: put back right before the first batch
    cb._resume = boundary.Resume(checkpoint, rng.capture())
    cb._resume.auto = resume == "auto"  # not a step or path chosen by the user
    cb._unpatch += tuning.skip_at_resume(trainer)  # (finders ran at the run's start)
    rng.restore(*live)  # a train_dataloader() drawing its data makes the run's data
    cb._resumed_stopped = checkpoint.pop(st.STOPPED_KEY, False)
    cb._past_end = cb._resume.past_end = stages.past_end(trainer, checkpoint, step)
    cb._val_iterators_made = bool(checkpoint.pop(st.VAL_ITERATORS_KEY, False))
    accumulate = checkpoint.pop(st.ACCUMULATE_KEY, None)
    checks.accumulation(trainer, accumulate, checkpoint, cb._resume.epoch_end)
    if ckpt.last_restore is not None:
        # said as Lightning says its own (rank_zero_info), with the tier and what was skipped
        where = st.position(checkpoint, cb._resume.epoch_end)
        rank_zero_info(f"ResilientCheckpoint: {ckpt.last_restore.describe(where)}")


def open_checkpointer(cb: ResilientCheckpoint, trainer: pl.Trainer, resume: Any) -> None:
    cb._close(raise_errors=False)
    _, kwargs = with_section(cb.dirpath, dict(cb._kwargs), cb._section)
    kwargs["resume"] = resume
    if "signals" not in kwargs:
        kwargs["signals"] = checks.signals(trainer)
    cb.checkpointer = Checkpointer(dirpath(cb, trainer), **kwargs)
    cb.checkpointer.logs_through_framework = True
    # (the callback calls step() when global_step moved: after an optimizer step, or one its
    # GradScaler skipped, whose gradients the next step's zero_grad drops: no window)
    cb.checkpointer.steps_are_updates = True
    checks.say_when_it_saves(cb.checkpointer)
    watcher = cb.checkpointer.watcher
    if watcher is not None and threading.current_thread() is threading.main_thread():
        for name in watcher.installed_signals:
            signum = getattr(signal, name)
            cb._our_handlers[signum] = signal.getsignal(signum)


def dirpath(cb: ResilientCheckpoint, trainer: pl.Trainer) -> str:
    own_dir, _ = with_section(cb.dirpath, dict(cb._kwargs), cb._section)
    return own_dir or os.path.join(trainer.default_root_dir, "resilient_checkpoints")
