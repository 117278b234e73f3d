"""What the Lightning callback logs through the trainer's loggers (TensorBoard, CSV, MLflow,
W&B: whatever is configured) after a step boundary: with ``log_stats``, the save's timings and
size (``resilient/blocking_s``, ``save_s``, ``save_mb``, ``saved_step``); with
``telemetry="logger"``, every checkpoint metric (docs/monitoring.md) after each save.

Which ranks call what: every rank calls :func:`after_step` and :func:`at_end` (which waits
for the background saves); only global rank zero logs.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from .. import sinks
from ..checkpointer import Checkpointer, SaveStats


def after_step(
    trainer: pl.Trainer,
    ckpt: Checkpointer,
    saved: bool,
    log_stats: bool,
    logged: SaveStats | None,
) -> SaveStats | None:
    """Log what this step boundary has to say; ``logged`` is the committed save whose stats
    were logged last (each is logged once, when its commit is known). Returns the new one."""
    if not trainer.loggers or not trainer.is_global_zero:
        return logged
    out: dict[str, float] = {}
    if log_stats:
        if saved and ckpt.config.async_save and ckpt.blocking_seconds:
            out["resilient/blocking_s"] = ckpt.blocking_seconds[-1]
        last = ckpt.last_save
        if last is not None and last is not logged:
            logged = last
            out.update(_committed(last))
            if not ckpt.config.async_save:
                out["resilient/blocking_s"] = last.seconds
    if out:
        _log(trainer, out)
    if saved:
        sinks.to_framework(ckpt, lambda values: _log(trainer, values))
    return logged


def at_end(
    trainer: pl.Trainer, ckpt: Checkpointer, log_stats: bool, logged: SaveStats | None
) -> SaveStats | None:
    """The end of training (every rank): wait for the background saves, then log the last
    committed save's stats if not logged yet and, with ``telemetry="logger"``, the metrics as
    they are once everything committed (after each save they describe the one before)."""
    wanted = log_stats or "logger" in ckpt.telemetry_kinds
    if not wanted:
        return logged
    ckpt.flush()
    if not trainer.loggers or not trainer.is_global_zero:
        return logged
    last = ckpt.last_save
    if log_stats and last is not None and last is not logged:
        logged = last
        _log(trainer, _committed(last))
    sinks.to_framework(ckpt, lambda values: _log(trainer, values), final=True)
    return logged


def _committed(last: SaveStats) -> dict[str, float]:
    """What is logged of a committed save."""
    return {
        "resilient/save_s": last.seconds,
        "resilient/save_mb": last.bytes / 1e6,
        "resilient/saved_step": float(last.step),
    }


def _log(trainer: pl.Trainer, values: dict[str, Any]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(values, step=trainer.global_step)
