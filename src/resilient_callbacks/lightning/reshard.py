"""Lightning's epoch lengths after a resume on another number of ranks (or batch size).

A :class:`~resilient_callbacks.ResumableDataLoader` resumed from a checkpoint of another
sharding hands out the rest of the interrupted epoch, sharded over this run's ranks: its length
in that epoch is the rest's (``in_resharded_epoch``). Lightning counts the epoch's batches from
its start, in the old sharding (its restored loop progress), and takes the epoch's length once,
when it builds the loaders (``fit_loop.max_batches``, the data fetcher's length, the validation
interval). Left alone it stops the resumed epoch after ``rest - done`` batches, and every later
epoch after ``rest`` batches, silently training less. So:

- after the loaders are built and their states loaded (:func:`after_setup`), the resumed
  epoch's length becomes the batches done before (Lightning's count) plus the rest the loader
  still has; the fetcher's too;
- at each later epoch's start (:func:`epoch_started`), the lengths are the loader's again (the
  whole epoch in this run's sharding), and the validation interval follows.

A run resumed on the number of ranks it saved with (and every uninterrupted run) is left as it
is. Which ranks call what: every rank, at the same points of the fit loop; no collective.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
from lightning.pytorch.utilities.data import sized_len

from .. import notices
from ..data import ResumableDataLoader

log = logging.getLogger("resilient_callbacks")


def after_setup(trainer: pl.Trainer) -> int | None:
    """After ``fit_loop.setup_data`` of the resumed fit: make Lightning's length of the resumed
    epoch count its batches as Lightning does. Returns that epoch if it was re-sharded."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    loaders = list(combined.flattened) if combined is not None else []
    resharded = [
        dl
        for dl in loaders
        if isinstance(dl, ResumableDataLoader)
        and dl.in_resharded_epoch
        and dl.loaded_batches is not None
    ]
    if not resharded:
        return None
    if len(loaders) > 1:
        notices.log_once(  # (the same on every rank: said once, on rank 0)
            log,
            "the train dataloaders resume an epoch on another number of ranks; with %d loaders "
            "Lightning's epoch length may not match the rest of the epoch they hand out",
            len(loaders),
        )
        return None
    dl = resharded[0]
    done = int(fit_loop.epoch_loop.batch_progress.current.ready)
    offset = done - int(dl.loaded_batches or 0)  # batches of the old sharding before the rest
    if offset <= 0 or fit_loop.max_batches == float("inf"):
        return None
    fit_loop.max_batches = offset + (sized_len(combined) or 0)
    fetcher = fit_loop._data_fetcher
    length = getattr(fetcher, "length", None)
    if fetcher is not None and length is not None:
        fetcher.length = length + offset
    log.info(
        "epoch %d resumed on another sharding: %d batch(es) done before, %d left here",
        trainer.current_epoch,
        offset,
        fit_loop.max_batches - offset,
    )
    return trainer.current_epoch


def epoch_started(trainer: pl.Trainer) -> None:
    """At the start of an epoch after the re-sharded one: Lightning's lengths are the loader's
    whole epoch in this run's sharding (as a fit started on these ranks has them)."""
    fit_loop = trainer.fit_loop
    n = sized_len(fit_loop._combined_loader) if fit_loop._combined_loader is not None else None
    if n is None or n == fit_loop.max_batches:
        return
    fit_loop.max_batches = n
    interval = trainer.val_check_interval
    timed = getattr(trainer, "_val_check_time_interval", None) is not None
    if isinstance(interval, float) and not timed:
        trainer.val_check_batch = max(1, int(n * interval))
