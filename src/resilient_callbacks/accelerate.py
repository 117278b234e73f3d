"""A plain Hugging Face Accelerate loop (``accelerator.accumulate(model)``) in a ``Checkpointer``
state: :class:`Accumulation` keeps the gradient-accumulation position exact.

The prepared model, ``AcceleratedOptimizer`` and ``AcceleratedScheduler`` go into the state
as they are (their state dicts are the wrapped module's, optimizer's and scheduler's, and the
scheduler's step count already holds accelerate's extra steps); ``accelerator.scaler``, where
accelerate made one (fp16 on a GPU), is saved by :class:`Accumulation`. The data loader does
not: accelerate's prepared loaders do not resume exactly and are refused; a
``ResumableDataLoader`` iterated without ``prepare``, through :meth:`Accumulation.epoch`, is
what resumes (docs/accelerate.md). This module imports no framework: it reads and sets a few
attributes of the ``Accelerator`` it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from .errors import UnsupportedStateError

__all__ = ["Accumulation"]

log = logging.getLogger("resilient_callbacks")


class Accumulation:
    """The accumulation position of an ``Accelerator`` (``accelerator.step``, the micro-step
    count that decides which ``accumulate()`` block synchronizes), as a state entry:
    ``state["accumulation"] = Accumulation(accelerator)``.

    Contract: a checkpoint holds the state after a completed optimizer step. Saving inside an
    accumulation window (``accelerator.sync_gradients`` is False: the gradients of the window's
    first micro-batches live only in ``.grad``, which no checkpoint holds) raises
    :class:`~resilient_callbacks.errors.UnsupportedStateError` before anything is written,
    instead of resuming a run that silently drops those micro-batches and shifts every later
    window. Call ``ckpt.step`` when ``accelerator.sync_gradients`` is True; a ``ckpt.step``
    inside a window (:attr:`mid_step`) saves nothing, and a periodic save or a preemption's
    emergency save due there is made at the first ``ckpt.step`` after it. Every rank
    holds the same value, so it is shared state. The ``GradScaler`` accelerate made
    (``accelerator.scaler``, fp16 on a GPU) is saved with it: its scale and growth tracker
    go on, whether or not the state holds the scaler too; so are the objects registered with
    ``accelerator.register_for_checkpointing``, as ``save_state()`` saves them, restored in
    the order they were registered."""

    def __init__(self, accelerator: Any) -> None:
        if not hasattr(accelerator, "gradient_state") or not hasattr(accelerator, "step"):
            raise TypeError(
                f"Accumulation takes an accelerate.Accelerator, not {type(accelerator).__name__}"
            )
        self.accelerator = accelerator

    @property
    def mid_step(self) -> bool:
        """True inside an accumulation window: a save due then (periodic, or a preemption's
        emergency save) waits for the first ``ckpt.step`` called with this False."""
        return not self.accelerator.sync_gradients

    @property
    def steps_left(self) -> int:
        """Inside a window, the micro-steps still to come up to its optimizer step, the one
        ending it included (at most: an epoch's last batch ends a window sooner); 0 outside.
        A preemption held for the window is compared with the grace period by this count."""
        if self.accelerator.sync_gradients:
            return 0
        n = max(1, int(self.accelerator.gradient_accumulation_steps))
        return n - int(self.accelerator.step) % n

    def epoch(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of one pass over ``loader`` (a ``ResumableDataLoader`` not passed to
        ``accelerator.prepare``, or any loader with a length), with the accelerator told
        which one is the last, as a prepared loader tells it: ``accumulate()`` then ends a
        window at an epoch's last batch (unless the accumulation plugin says
        ``sync_with_dataloader=False``), so the optimizer steps on a partial window there and
        the windows are those of the loop with a prepared loader. A pass resumed mid-epoch
        counts the batches the loader has still to give (``len(loader) -
        loader.batches_consumed``: a ``ResumableDataLoader``'s position; another loader is
        taken to yield ``len(loader)`` batches)."""
        try:
            left = len(loader) - int(getattr(loader, "batches_consumed", 0))  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"Accumulation.epoch needs a loader with a length, not {type(loader).__name__}: "
                "without one the last batch of the epoch is not known"
            ) from None
        marker = _EpochEnd()  # what accelerate reads of the loader it iterates
        state = self.accelerator.gradient_state
        state._add_dataloader(marker)
        try:
            for i, batch in enumerate(loader):
                marker.end_of_dataloader = i + 1 >= left
                yield batch
        finally:
            state._remove_dataloader(marker)

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        if not acc.sync_gradients:
            raise UnsupportedStateError(
                f"saving inside a gradient accumulation window (accelerator.step={acc.step}, "
                f"gradient_accumulation_steps={acc.gradient_accumulation_steps}): the window's "
                "gradients so far are in .grad and no checkpoint holds them, so a resumed run "
                "would drop them. Save after the optimizer step: call ckpt.step(...) only when "
                "accelerator.sync_gradients is True, counting optimizer steps; iterate the "
                "loader as accumulation.epoch(loader) so that an epoch's last batch ends a "
                "window and the final save comes after an optimizer step (docs/accelerate.md)."
            )
        out: dict[str, Any] = {
            "step": int(acc.step),
            "num_steps": int(acc.gradient_accumulation_steps),
        }
        scaler = getattr(acc, "scaler", None)  # fp16 on a GPU: its scale and growth tracker
        if scaler is not None:
            out["scaler"] = scaler.state_dict()
        # accelerator.register_for_checkpointing's objects, as save_state() saves them, in order
        out["registered"] = [obj.state_dict() for obj in _registered(acc)]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved step. With another ``gradient_accumulation_steps`` than the saved one,
        a step that is not a multiple of it (the first window after the resume would be cut
        short) starts at 0 instead, with a warning, so the next window is whole; a step it
        divides (0: saved at an epoch's end) is restored as it is, nothing said."""
        step, saved, now = int(state["step"]), state.get("num_steps"), self.accelerator
        n = int(now.gradient_accumulation_steps)
        if saved is not None and int(saved) != n and step % max(1, n) != 0:
            log.warning(
                "gradient_accumulation_steps is %s here but was %s in the checkpoint: the "
                "accumulation windows start afresh from the resumed step (accelerator.step=0 "
                "rather than %d, which would make the first window after the resume partial)",
                now.gradient_accumulation_steps,
                saved,
                step,
            )
            step = 0
        self.accelerator.step = step
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and state.get("scaler"):  # ({} from a disabled scaler)
            scaler.load_state_dict(state["scaler"])
        live, saved_objs = _registered(self.accelerator), state.get("registered")
        if saved_objs is None:  # saved before Accumulation saved them
            if live:
                log.warning(
                    "the checkpoint does not hold the %d object(s) registered with "
                    "accelerator.register_for_checkpointing (it was saved before Accumulation "
                    "saved them): they keep the values they have now",
                    len(live),
                )
            return
        if len(live) != len(saved_objs):
            raise UnsupportedStateError(
                f"the checkpoint holds {len(saved_objs)} object(s) registered with "
                f"accelerator.register_for_checkpointing, this accelerator has {len(live)}: "
                "they are restored in the order they were registered, so register the same "
                "objects, in the same order, before restore()"
            )
        for obj, sd in zip(live, saved_objs, strict=True):
            obj.load_state_dict(sd)


def _registered(accelerator: Any) -> list[Any]:
    """The objects registered with ``accelerator.register_for_checkpointing``, in order; an
    ``Accumulation`` registered too (for ``save_state()``) is not one of them (it would hold
    itself)."""
    objs = getattr(accelerator, "_custom_objects", None) or []
    return [o for o in objs if not isinstance(o, Accumulation)]


class _EpochEnd:
    """Stands for the loader in ``accelerator.gradient_state`` while ``Accumulation.epoch``
    iterates it: accelerate reads ``end_of_dataloader`` (sync at the last batch) and
    ``remainder`` (-1: no padding to drop in ``gather_for_metrics``)."""

    def __init__(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1
