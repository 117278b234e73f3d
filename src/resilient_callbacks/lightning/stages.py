"""A script of several ``fit()`` stages on one Trainer, re-run after it was killed in a later
stage: the newest checkpoint then lies past an earlier stage's end.

The usual shape::

    trainer = L.Trainer(max_epochs=2, callbacks=[ResilientCheckpoint("ckpts/run1")])
    trainer.fit(model, dm)                # stage 1
    model.lr = 1e-4
    trainer.fit_loop.max_epochs = 4
    trainer.fit(model, dm)                # stage 2: goes on from the live state

Killed in stage 2 and run again, stage 1's ``fit()`` restores stage 2's checkpoint. Lightning
then trains nothing when that checkpoint is in stage 1's last epoch, and raises ("You restored
a checkpoint with current_epoch=3, but you have set Trainer(max_epochs=2)") when it is later.
So a checkpoint past a fit's end (:func:`past_end`) is restored with the fit loop's epoch
counters held at ``max_epochs`` (the weights, optimizers and callbacks are restored; the fit
trains nothing), and that fit does not count as finished (:mod:`.refit`): the next ``fit()``
resumes from the checkpoint as a re-run would, rather than going on from the live state with
fresh optimizers. A checkpoint at a fit's end (the last step of stage 1, saved as its end) is
not past it: stage 1 trains nothing, and stage 2 goes on from the live state, as it did.

Every rank decides alike (from the same checkpoint and Trainer); nothing here is collective.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info


def past_end(trainer: pl.Trainer, checkpoint: dict[str, Any], step: int) -> str | None:
    """Whether ``checkpoint`` (Lightning's dictionary, of step ``step``, as restored) lies
    past the end of this ``fit()``: the limit it is past, in words, or ``None``. Past
    ``max_epochs``, the fit loop's epoch counters in ``checkpoint`` are held at it (in place),
    so that Lightning ends the fit there instead of refusing the checkpoint."""
    why = _past(trainer, checkpoint, step)
    if why is not None:
        rank_zero_info(
            f"ResilientCheckpoint: the checkpoint of step {step} is past this fit()'s end "
            f"({why}; a later fit() of the script wrote it): this fit() trains nothing, and "
            "the next fit() resumes from it"
        )
    return why


def _past(trainer: pl.Trainer, checkpoint: dict[str, Any], step: int) -> str | None:
    max_steps = trainer.max_steps
    if max_steps not in (-1, None) and step > max_steps:
        return f"max_steps={max_steps}"
    max_epochs = trainer.max_epochs
    if max_epochs in (-1, None):
        return None
    current = epoch_counters(checkpoint)
    processed = current.get("processed")
    # (a checkpoint of an epoch's last batch records that epoch as not processed yet: the one
    # that ends stage 1 is not past its end)
    if not isinstance(processed, int) or processed < max_epochs:
        return None
    for key in ("ready", "started", "processed", "completed"):
        if isinstance(current.get(key), int) and current[key] > max_epochs:
            current[key] = max_epochs
    return f"max_epochs={max_epochs}"


def epoch_counters(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The fit loop's epoch counters (``epoch_progress.current``) in Lightning's restored
    ``checkpoint``, the dictionary itself; ``{}`` where it has none."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return fit_loop.get("epoch_progress", {}).get("current", {})
