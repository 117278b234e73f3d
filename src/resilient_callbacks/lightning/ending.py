"""How a ``fit()`` ends for :class:`~.callback.ResilientCheckpoint`: the close of its
``Checkpointer`` at Lightning's ``teardown`` hook (a fit that ended), or at ``on_exception``
(a fit that failed: the emergency save first, with ``save_on_exception``).

Which ranks call what: Lightning runs both hooks on every rank, at the same point, so every
rank closes its ``Checkpointer`` together, as the core requires.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from .. import closing
from ..errors import CheckpointError
from . import refit

if TYPE_CHECKING:
    from .callback import ResilientCheckpoint

log = logging.getLogger("resilient_callbacks.lightning")


def teardown(cb: ResilientCheckpoint, trainer: pl.Trainer, stage: str) -> None:
    """The callback's ``teardown``: close (errors raised), remember the finished fit."""
    if stage != TrainerFn.FITTING.value:
        return
    ckpt = cb.checkpointer
    try:
        close(cb, raise_errors=True)
        if ckpt is not None and not cb._past_end:  # (only after a fit() without an error)
            refit.finished(trainer, ckpt.dirpath)
    finally:
        cb._unpatch_all()


def on_exception(cb: ResilientCheckpoint, trainer: pl.Trainer, exception: BaseException) -> None:
    """The callback's ``on_exception``: the emergency save, then the close; never raises."""
    try:
        if cb.save_on_exception and not isinstance(exception, (SystemExit, CheckpointError)):
            cb._on_exception.save(cb.checkpointer, cb._ctx, cb._state, trainer, exception)
    except Exception as e:  # never mask the original exception
        log.error("save_on_exception: the emergency save failed: %s", e)
    finally:
        if cb.checkpointer is not None and not isinstance(exception, SystemExit):
            closing.failing(cb.checkpointer, exception)  # a failure, not an end
        close(cb, raise_errors=False)
        cb._unpatch_all()


def close(cb: ResilientCheckpoint, raise_errors: bool) -> None:
    """Close the callback's ``Checkpointer`` (if open); its error raised or logged."""
    for h in cb._step_hooks:
        h.remove()
    cb._step_hooks = []
    ckpt, cb.checkpointer = cb.checkpointer, None
    cb._state = cb._ctx = None
    if ckpt is None:
        return
    cb.preempted = cb.preempted or ckpt.preempted
    try:
        ckpt.close()
    except Exception as e:
        if raise_errors:
            raise
        log.error("closing the checkpointer: %s", e)
