"""How a ``fit()`` ends for :class:`~.callback.ResilientCheckpoint`: the close of its
``Checkpointer`` at Lightning's ``teardown`` hook (a fit that ended), or at ``on_exception``
(a fit that failed: the emergency save first, with ``save_on_exception``).

A close that fails at the end of a fit (``UploadIncompleteError`` after it gave up on uploads
during an outage, a last save that failed) is raised out of ``fit()`` only once Lightning has
done all it does at a normal end: raised from our ``teardown`` hook, inside Lightning's
``_call_teardown_hook`` (``lightning/pytorch/trainer/call.py``), it skipped the teardown of the
callbacks after ours and of the LightningModule, the loggers' ``finalize("success")`` and
``profiler.describe()``. Two things of Lightning 2.x are relied on, each pinned by
``tests/test_lightning_teardown.py``: ``_call_teardown_hook`` ends with
``trainer.profiler.describe()``, after every teardown hook and the loggers' finalize (the error
is raised from a wrapper of that call); and the exception then goes through
``_call_and_handle_interrupt``'s ``_interrupt``, which calls the ``on_exception`` hooks and
finalizes every logger ``"failed"`` (skipped once: they were finalized ``"success"`` a moment
before; the training succeeded, the durability of its newest checkpoints did not).

Which ranks call what: Lightning runs both hooks on every rank, at the same point, so every
rank closes its ``Checkpointer`` together, as the core requires. A close error is raised where
the core raises it (rank 0; in node-local mode the node leaders too), each rank for itself:
nothing collective runs between its ``teardown`` hook and that raise.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from .. import closing
from ..errors import CheckpointError
from . import evaluate, refit

if TYPE_CHECKING:
    from .callback import ResilientCheckpoint

log = logging.getLogger("resilient_callbacks.lightning")


def teardown(cb: ResilientCheckpoint, trainer: pl.Trainer, stage: str) -> None:
    """The callback's ``teardown``: close (errors raised), remember the finished fit."""
    if stage != TrainerFn.FITTING.value:
        cb._unpatch_all()  # (a validate/test/predict's wrapper: evaluate.py)
        return
    ckpt = cb.checkpointer
    try:
        close(cb, raise_errors=True)
    except Exception as e:
        _raise_after_teardown(cb, trainer, e)
    else:
        # (only after a fit() without an error; a preempted one goes on at the next fit())
        if ckpt is not None and not cb._past_end and not ckpt.preempted:
            refit.finished(trainer, ckpt.dirpath)
        if ckpt is not None:
            evaluate.fit_ended(cb, ckpt.dirpath, ckpt.latest_path, ckpt.run_id)
    finally:
        cb._unpatch_all()


def on_exception(cb: ResilientCheckpoint, trainer: pl.Trainer, exception: BaseException) -> None:
    """The callback's ``on_exception``: the emergency save, then the close; never raises. A
    close error that waited for the end of Lightning's teardown (another teardown hook failed
    meanwhile: that error propagates) is logged."""
    pending, cb._close_error = cb._close_error, None
    if pending is not None:
        error, profiler, describe = pending
        _restore(profiler, "describe", describe)
        _log_instead(error, exception)
    try:
        if cb.save_on_exception and not isinstance(exception, (SystemExit, CheckpointError)):
            cb._on_exception.save(cb.checkpointer, cb._ctx, cb._state, trainer, exception)
    except Exception as e:  # never mask the original exception
        log.error("save_on_exception: the emergency save failed: %s", e)
    finally:
        watcher = cb.checkpointer.watcher if cb.checkpointer is not None else None
        if cb.checkpointer is not None and not isinstance(exception, SystemExit):
            closing.failing(cb.checkpointer, exception)  # a failure, not an end
        close(cb, raise_errors=False)
        if watcher is not None:
            _handlers_back(cb, trainer, watcher)
        cb._unpatch_all()


def _handlers_back(cb: ResilientCheckpoint, trainer: pl.Trainer, watcher: Any) -> None:
    """After the close at ``on_exception``: Lightning's signal connector registered its handlers
    after the Checkpointer installed ours, so it restores ours at its teardown, which follows
    the ``on_exception`` hooks (at a fit that ended, it comes before our close). It restores
    what was there before ours instead: the closed watcher's handler stayed in place, for a
    later Trainer's connector to compose into its own. (Where the close kept ours, a
    preemption's exit under way, the connector restores it as it would.)"""
    connector = getattr(trainer, "_signal_connector", None)
    originals = getattr(connector, "_original_handlers", None)
    if not isinstance(originals, dict):
        return
    for signum, ours in cb._our_handlers.items():
        if originals.get(signum) is ours and signal.getsignal(signum) is not ours:
            originals[signum] = watcher.handler_before(signum)


def close(cb: ResilientCheckpoint, raise_errors: bool) -> None:
    """Close the callback's ``Checkpointer`` (if open); its error raised or logged."""
    cb._on_exception.release()
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


def _raise_after_teardown(cb: ResilientCheckpoint, trainer: pl.Trainer, error: Exception) -> None:
    """Raise ``error``, the close's, at the end of Lightning's ``_call_teardown_hook``: from a
    wrapper of its last call, ``trainer.profiler.describe()`` (see the module's docstring)."""
    profiler: Any = trainer.profiler  # type: ignore[attr-defined]
    original = getattr(profiler, "describe", None)
    if not callable(original):  # not the Lightning this relies on: raise it here, as before
        raise error

    def describe() -> None:
        cb._close_error = None
        _restore(profiler, "describe", describe)
        try:
            original()
        except BaseException as other:
            _log_instead(error, other)
            raise
        for logger in trainer.loggers:
            _skip_failed_finalize(logger)
        raise error

    profiler.describe = describe
    cb._close_error = (error, profiler, describe)


def _skip_failed_finalize(logger: Any) -> None:
    """Lightning's ``_interrupt`` finalizes every logger ``"failed"`` for the close error raised
    after it finalized them ``"success"``: skip that one call."""

    original = logger.finalize

    def finalize(status: str) -> None:
        _restore(logger, "finalize", finalize)
        if status != "failed":
            original(status)

    logger.finalize = finalize


def _log_instead(error: Exception, other: BaseException) -> None:
    """``other`` propagates where the close's ``error`` would have: log that one."""
    log.error("closing the checkpointer (after %s): %s", type(other).__name__, error)


def _restore(obj: Any, name: str, ours: Any) -> None:
    """Remove our wrapper ``ours`` of ``obj.name``, unless something replaced it since."""
    if vars(obj).get(name) is ours:
        delattr(obj, name)
