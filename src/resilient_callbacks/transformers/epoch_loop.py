"""The epoch loop of a ``transformers.Trainer`` under ``ResilientCheckpoint``: its wrapper of
``Trainer._run_epoch`` (installed by :mod:`.hooks` at ``on_train_begin``), called once per
epoch. It counts the epochs and optimizer steps the checkpoint records; on a resume it starts
the first epoch where the checkpoint left off (the epoch number, the rest of the epoch's batches
from the resumable batch sampler, the data loader's base seed drawn from the RNG state recorded
at the epoch's start), ends a run that was already done, and closes the checkpointer when the
epoch raises.

Which ranks call what: the Trainer runs ``_run_epoch`` on every rank alike, so every rank runs
this the same way; nothing here is collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import hooks
from .data import decode_cpu_rng, generator_at

if TYPE_CHECKING:
    from .callback import ResilientCheckpoint


def run_epoch(cb: ResilientCheckpoint, original: Any, *args: Any, **kwargs: Any) -> Any:
    """``cb``'s wrapper of ``trainer._run_epoch(*args, **kwargs)`` (``original``)."""
    trainer = cb._trainer
    bound = hooks.bind_arguments(original, args, kwargs)
    a = bound.arguments
    targs = trainer.args
    gas = int(targs.gradient_accumulation_steps)
    epoch = int(a["epoch"])
    steps_in_epoch = int(a["steps_in_epoch"])
    updates_per_epoch = int(a["num_update_steps_per_epoch"])
    first = cb._epoch_calls == 0
    cb._epoch_calls += 1
    start = 0
    base = cb._base
    base.generator = cb._own_generator  # a resumed epoch's one-off generator goes
    epoch_start: torch.Tensor | None = None
    if cb._resume is not None:
        r_epoch, r_updates, r_rng, r_start, r_stopped = cb._resume
        if first:
            cb._epoch_offset = r_epoch - epoch
        epoch += cb._epoch_offset
        state = trainer.state
        # The Trainer's count of epochs ends the run too (a max_steps run's as well, where
        # an epoch ended early: should_epoch_stop), unless a max_steps run's epochs have
        # another length than at the save (new data: that count starts from step 0)
        done = state.global_step >= state.max_steps or (
            (targs.max_steps <= 0 or cb._same_epochs) and epoch >= state.num_train_epochs
        )
        if done or (first and r_stopped):
            trainer.control.should_training_stop = True
            return None
        a["epoch"] = a["epochs_trained"] = epoch
        a["resume_from_checkpoint"] = None
        a["steps_trained_in_current_epoch"] = 0
        if first and r_updates > 0 and not targs.ignore_data_skip:
            start = r_updates
            # The rest of the epoch: the Trainer's batch counter, accumulation boundaries
            # and the short last accumulation group line up with the uninterrupted run.
            a["steps_in_epoch"] = steps_in_epoch - start * gas
            a["num_update_steps_per_epoch"] = updates_per_epoch - start
            assert cb._batches is not None
            # the first batch is collated from the random states it was collated from
            # before the save (None: not fetched ahead, or a checkpoint without them)
            collated = cb._saved.rank_values.get("next_batch_rng")
            main = cb._base.num_workers == 0
            cb._batches.resume_at(
                start * gas, r_rng, decode_cpu_rng(collated) if collated and main else None
            )
            # The iterator this epoch creates draws its base seed as the interrupted run's
            # did at the epoch start, from that RNG state, not from the global RNG now.
            epoch_start = r_start
            base.generator = generator_at(r_start)
        elif first and hooks.persistent_workers(targs):
            # Persistent workers: the uninterrupted run made its one iterator in its first
            # epoch, and later epochs reset it without a draw; the iterator this run makes
            # must not draw from the global RNG either (its base seed from a throwaway one).
            base.generator = generator_at(r_start)
    elif a["resume_from_checkpoint"] is not None and epoch == a["epochs_trained"]:
        start = int(a["steps_trained_in_current_epoch"]) // gas  # the Trainer's own resume
    cb._epoch, cb._updates = epoch, start
    cb._steps_in_epoch, cb._updates_per_epoch = steps_in_epoch, updates_per_epoch
    cb._epoch_ended = False
    if epoch_start is None:  # what the iterator created in this epoch will draw from
        own = cb._own_generator
        epoch_start = (own.get_state() if own is not None else torch.get_rng_state()).clone()
    cb._saved.epoch_start_live = epoch_start
    try:
        return original(*bound.args, **bound.kwargs)
    except BaseException as e:
        cb._abort(e)
        raise
