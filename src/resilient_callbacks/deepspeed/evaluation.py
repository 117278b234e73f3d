"""Say when an evaluation between a checkpointed step and the next one draws random numbers.

A checkpoint of step N holds the random streams (Python, NumPy, torch, CUDA) as they are inside
the ``engine.step()`` that completed step N. A loop that evaluates after that step, between
``engine.eval()`` and ``engine.train()``, often draws from them without meaning to: every
iteration of a ``DataLoader`` without its own ``generator`` takes its base seed from the global
torch RNG, even unshuffled and without workers. A run resumed from step N does not run that
evaluation again, so its next dropout masks (and every later draw) differ from the run's that
was not interrupted: the resume is silently not exact. The same holds for an evaluation a
resumed script runs before its first step.

The streams are compared when an evaluation starts and when it ends (``engine.eval()`` or
``engine.train(False)``, then ``engine.train()``), only between a checkpointed (or restored)
step and the next ``engine.step()``; nothing else is changed, so the run itself stays as it
is. A change is said once, with what to do: keep evaluation off the training streams.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from ..errors import AT_CALLER, warn_and_log

log = logging.getLogger("resilient_callbacks")


def fingerprint() -> tuple[Any, ...]:
    """The global random streams' states, comparable with ``==`` (cheap: a few KiB)."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # (legacy=True: the tuple form)
    cuda: tuple[bytes, ...] = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple(bytes(s.cpu().numpy()) for s in torch.cuda.get_rng_state_all())
    return (
        random.getstate(),
        bytes(np.asarray(np_state[1]).tobytes()),
        tuple(np_state[2:]),
        bytes(torch.get_rng_state().numpy()),
        cuda,
    )


class EvaluationWatch:
    """Wraps ``engine.eval`` and ``engine.train`` (instance attributes, like the handle's
    ``step``). :meth:`checkpointed` after a save or a restore of step N arms it until the next
    :meth:`stepped`; an evaluation in that window that moves the random streams is warned
    about, once. Training thread only."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.step: int | None = None  # the checkpointed step, while armed
        self.restored = False
        self.at_start: tuple[Any, ...] | None = None  # the streams as the evaluation began
        self.told = False
        self._eval, self._train = engine.eval, engine.train
        engine.eval = self._on_eval
        engine.train = self._on_train

    def checkpointed(self, step: int, *, restored: bool = False) -> None:
        if not self.told:
            self.step, self.restored = step, restored

    def stepped(self) -> None:
        self.step, self.at_start = None, None

    def _on_eval(self, *args: Any, **kwargs: Any) -> Any:
        self._begin()
        return self._eval(*args, **kwargs)

    def _on_train(self, mode: bool = True, *args: Any, **kwargs: Any) -> Any:
        if mode:
            self._end()
        else:
            self._begin()
        return self._train(mode, *args, **kwargs)

    def _begin(self) -> None:
        if self.step is not None and self.at_start is None:
            self.at_start = fingerprint()

    def _end(self) -> None:
        if self.at_start is None or self.step is None:
            return
        moved = fingerprint() != self.at_start
        self.at_start = None
        if moved:
            self.told, step = True, self.step
            self.step = None
            when = (
                f"the resume at step {step} and the first training step"
                if self.restored
                else f"step {step}, which is checkpointed, and the next training step"
            )
            again = (
                "the run that was not interrupted did not evaluate at this point"
                if self.restored
                else f"a run resumed from step {step} does not run this evaluation again"
            )
            warn_and_log(
                log,
                f"resilient_callbacks: the evaluation between {when} drew from the global "
                f"random streams (torch, NumPy or Python): {again}, so its dropout and other "
                "random draws would differ from here on (the resume would not be exact). Keep "
                "evaluation off the training streams: give its DataLoader its own generator "
                "(DataLoader(..., generator=torch.Generator())), and draw anything else inside "
                "torch.random.fork_rng()",
                UserWarning,
                stacklevel=AT_CALLER,
            )

    def unwrap(self) -> None:
        """Give ``engine.eval`` and ``engine.train`` back (DeepSpeedEngine's own)."""
        for name, ours in (("eval", self._on_eval), ("train", self._on_train)):
            if self.engine.__dict__.get(name) == ours:
                del self.engine.__dict__[name]
