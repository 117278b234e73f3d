"""``TrainerState.epoch`` of a step as the uninterrupted run counts it, seen by every callback.

The Trainer sets ``state.epoch = epoch + (step + 1) / steps_in_epoch`` from its batch counter just
before it fires ``on_step_end``, and nowhere else. A run resumed in the middle of an epoch gets the
rest of that epoch from its first ``_run_epoch`` (:mod:`.hooks`), so there the counter and
``steps_in_epoch`` count from the resume point (1/6, 2/6, ... where the uninterrupted run had
11/16, 12/16, ...). The adapter wraps the Trainer's ``callback_handler.on_step_end`` and sets the
uninterrupted run's value before any callback runs: every callback, whatever its place in the
list, sees it in ``on_step_end`` and in every event until the next step's (``on_log``,
``on_evaluate``, ``on_save``, the next ``on_step_begin``, ``on_substep_end``), as does the
Trainer's log. (Found 2026-12-05 by a user's probe: set in the adapter's own ``on_step_end``
only, the value was wrong for the callbacks listed before it.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import hooks


def epoch_at(epoch: int, updates: int, gas: int, steps_in_epoch: int) -> float:
    """``state.epoch`` after ``updates`` optimizer steps into epoch ``epoch`` of
    ``steps_in_epoch`` batches, ``gas`` a step (the last step may take fewer): the Trainer's own
    expression, with the batches counted from the epoch's start."""
    return epoch + min(updates * gas, steps_in_epoch) / steps_in_epoch


def set_before_callbacks(handler: Any, value: Callable[[], float | None]) -> None:
    """Wrap ``handler.on_step_end`` on this instance: ``state.epoch = value()`` (unless None)
    before the callbacks run; :func:`hooks.unwrap` removes it."""

    def step_end(original: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        epoch = value()
        if epoch is not None:
            state.epoch = epoch
        return original(args, state, control, **kwargs)

    hooks.wrap(handler, "on_step_end", step_end)
