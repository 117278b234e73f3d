"""A resumed ``train()`` of ``ResilientCheckpoint``: what it sets up after the restore, and the
random streams put back around the resumed epoch's first ``on_epoch_begin``.

Every rank calls these alike, at ``on_train_begin`` (:func:`apply`, after
``Checkpointer.restore``) and at the first ``on_epoch_begin`` (:func:`epoch_begin`, wrapping
the Trainer's callback handler); only the main process logs the resume.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import transformers
from transformers.utils import logging as hf_logging

from .. import rng
from ..inplace import Advice
from . import checks, data_settings, hooks

trainer_log = hf_logging.get_logger("transformers.trainer")  # where the resume is announced


def advice() -> Advice:
    """The restore's warnings in a Trainer user's words (who never calls ``restore()``: the
    callback does, inside ``train()``), at their ``trainer.train(...)`` line."""
    dirs = [os.path.dirname(transformers.__file__)]
    accelerate = getattr(sys.modules.get("accelerate"), "__file__", None)
    if accelerate:  # (auto_find_batch_size calls through it)
        dirs.append(os.path.dirname(accelerate))
    where = "in a TrainerCallback's on_train_begin (it runs after the restore)"
    return Advice(
        new_key=f"set it {where}",
        new_settings=f"set them on its lr_scheduler {where}",
        like="the Trainer's own resume_from_checkpoint does",
        through=tuple(dirs),
    )


def apply(cb: Any, trainer: Any, state: Any, step: int) -> None:
    """Every rank, after ``cb``'s Checkpointer restored ``step``: give the Trainer its state
    back and set up the rest of the resumed run (the evaluation loader, ``eval_on_start``, the
    random streams put back at the first ``on_epoch_begin``), then say where it resumed."""
    cb._resume = cb._saved.apply(trainer, state, step)
    # whether an epoch has as many optimizer steps as at the save (the Trainer's count of
    # epochs, which ends the run, is then the uninterrupted run's)
    per_epoch = data_settings.updates_per_epoch
    cb._same_epochs = per_epoch(cb._saved.values["data"]) == per_epoch(cb._saved.signature)
    if hooks.persistent_workers(trainer.args) and any(
        k.startswith("eval_") for e in state.log_history for k in e
    ):
        # The uninterrupted run made its evaluation loader's one iterator at its first
        # evaluation, later reset without a draw: this run's first draws from a throwaway
        hooks.wrap(trainer, "get_eval_dataloader", hooks.eval_loader_without_draw)
    if getattr(trainer.args, "eval_on_start", False):
        # the run evaluated at its start; a resumed one must not again (a second eval entry
        # in the log history, and its draws from the restored RNGs change every later step)
        trainer.args.eval_on_start = False
        cb._eval_on_start = True
    # The random streams as restored, put back at the resumed epoch's start (see
    # epoch_begin): callbacks after this one draw in on_train_begin
    cb._restored_rng = rng.capture()
    hooks.wrap(trainer.callback_handler, "on_epoch_begin", functools.partial(epoch_begin, cb))
    loop = cb._saved.values["loop"]
    cb.restored_step = step
    if trainer.is_world_process_zero():
        where = f"epoch {loop['epoch']}, {loop['updates']} optimizer step(s) into it"
        extra = checks.nothing_left(state, stopped=cb._resume[4])
        restored = cb.checkpointer.last_restore if cb.checkpointer else None
        if restored is not None:
            # WARNING through transformers.trainer: the Trainer's logging tree shows WARNING
            # by default, while its own "Continuing training from checkpoint" (INFO) is hidden
            trainer_log.warning(f"ResilientCheckpoint: {restored.describe(where)}{extra}")


def epoch_begin(cb: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
    """The resumed run's first ``on_epoch_begin``: the random streams are put back as
    restored. At an epoch's start, before it (the uninterrupted run drew in it from them);
    in the middle of an epoch, after it (the Trainer fires it again for the resumed epoch,
    where the uninterrupted run had drawn before the save). Either way, what callbacks drew
    in ``on_train_begin`` after the restore is undone, as the Trainer's own resume does."""
    trainer = cb._trainer
    assert trainer is not None  # unwrapped when training ends
    hooks.unwrap(trainer.callback_handler, "on_epoch_begin")
    saved, cb._restored_rng = cb._restored_rng, None
    resume = cb._resume
    mid_epoch = resume is not None and resume[1] > 0 and not trainer.args.ignore_data_skip
    if saved is not None and not mid_epoch:
        rng.restore(*saved)
    result = original(*args, **kwargs)
    if saved is not None and mid_epoch:
        rng.restore(*saved)
    return result
