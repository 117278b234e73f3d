"""A plain Hugging Face Accelerate loop (``accelerator.accumulate(model)``) in a ``Checkpointer``
state: :class:`Accumulation` keeps the gradient-accumulation position exact.

The prepared model, ``AcceleratedOptimizer`` and ``AcceleratedScheduler`` go into the state
as they are (their state dicts are the wrapped module's, optimizer's and scheduler's, and the
scheduler's step count already holds accelerate's extra steps); ``accelerator.scaler`` too,
where accelerate made one (fp16 on a GPU). The data loader does not: accelerate's prepared
loaders do not resume exactly and are refused; a ``ResumableDataLoader`` iterated without
``prepare`` is what resumes (docs/accelerate.md). This module imports no framework: it reads
two attributes of the ``Accelerator`` it is given.
"""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedStateError

__all__ = ["Accumulation"]


class Accumulation:
    """The accumulation position of an ``Accelerator`` (``accelerator.step``, the micro-step
    count that decides which ``accumulate()`` block synchronizes), as a state entry:
    ``state["accumulation"] = Accumulation(accelerator)``.

    Contract: a checkpoint holds the state after a completed optimizer step. Saving inside an
    accumulation window (``accelerator.sync_gradients`` is False: the gradients of the window's
    first micro-batches live only in ``.grad``, which no checkpoint holds) raises
    :class:`~resilient_callbacks.errors.UnsupportedStateError` before anything is written,
    instead of resuming a run that silently drops those micro-batches and shifts every later
    window. Call ``ckpt.step`` when ``accelerator.sync_gradients`` is True. Every rank
    holds the same value, so it is shared state."""

    def __init__(self, accelerator: Any) -> None:
        if not hasattr(accelerator, "gradient_state") or not hasattr(accelerator, "step"):
            raise TypeError(
                f"Accumulation takes an accelerate.Accelerator, not {type(accelerator).__name__}"
            )
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        if not acc.sync_gradients:
            raise UnsupportedStateError(
                f"saving inside a gradient accumulation window (accelerator.step={acc.step}, "
                f"gradient_accumulation_steps={acc.gradient_accumulation_steps}): the window's "
                "gradients so far are in .grad and no checkpoint holds them, so a resumed run "
                "would drop them. Save after the optimizer step: call ckpt.step(...) only when "
                "accelerator.sync_gradients is True, counting optimizer steps."
            )
        return {"step": int(acc.step), "num_steps": int(acc.gradient_accumulation_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accelerator.step = int(state["step"])
