"""One decision for all ranks, without a collective at every step.

Some save triggers differ between ranks: a preemption signal reaches ranks at different
moments, wall clocks and measured step times differ. Ranks must still save at the same step.
At *decision steps* every rank contributes its flags and integer proposals to one small
``all_reduce(MAX)``, and its proposed spacing to the next decision step (the smallest wins);
all ranks then act on the same result. Between decision steps nothing is
exchanged: a condition raised there waits for the next decision step.

The spacing between decision steps adapts so that the collective costs at most ``budget`` of
the training time (default 0.1%), capped so that a signal waits at most ``max_delay_s`` at the
step times measured when the spacing was agreed: steps that suddenly get slower lengthen the
wait in proportion until the next decision step (at most ``max_every`` steps), which then
spaces by the slower steps.

Which ranks call what: every rank calls :meth:`Decider.decide` at every step, with the same
step numbers. With a single process every step is a decision step and nothing is exchanged.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch

from . import dist

RECENT_STEPS = 5


def spacing_step_time(step_seconds: Sequence[float]) -> float:
    """The step time the spacing of decision steps is computed from: the median, or the
    slowest of the last :data:`RECENT_STEPS` if that is longer. The spacing bounds how long a
    preemption request waits; steps that became slower count at once (the median of 50 would
    take 25 of them to notice, and spacings made for fast steps would go on)."""
    recent = list(step_seconds)[-RECENT_STEPS:]
    return max(statistics.median(step_seconds), max(recent))


def pack(values: Sequence[int], proposal: int) -> torch.Tensor:
    """One rank's part of the decision collective (``all_reduce(MAX)``): its values, and its
    proposed spacing negated, so that the spacing agreed is the *smallest* proposed. A rank that
    waits for a slower one inside the collective measures fast steps and a long collective, and
    proposes a wide spacing; the largest proposal made a SIGTERM wait 20 s."""
    return torch.tensor([*values, -proposal], dtype=torch.int64, device=dist._device())


class Decider:
    def __init__(
        self, *, budget: float = 1e-3, max_delay_s: float = 1.0, max_every: int = 100
    ) -> None:
        self.budget = budget
        self.max_delay_s = max_delay_s
        self.max_every = max_every
        self.every = 1
        self._next = 0
        self._collective_s = 0.0

    def is_decision_step(self, step: int) -> bool:
        return dist.world_size() == 1 or step >= self._next

    def decide(
        self, step: int, values: Sequence[int], step_time_s: float | None
    ) -> list[int] | None:
        """``values``: this rank's non-negative ints (flags as 0/1, proposals). Returns the
        element-wise maximum over ranks on a decision step, ``None`` otherwise."""
        if dist.world_size() == 1:
            return list(values)
        if step < self._next:
            return None
        t0 = time.perf_counter()
        t = pack(values, self._propose(step_time_s))
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        self._collective_s = time.perf_counter() - t0
        out = [int(x) for x in t.tolist()]
        self.every = max(1, -out[-1])
        self._next = step + self.every
        return out[:-1]

    def _propose(self, step_time_s: float | None) -> int:
        if not step_time_s or step_time_s <= 0 or not self._collective_s:
            return 1
        k = math.ceil(self._collective_s / (self.budget * step_time_s))
        k = min(k, max(1, int(self.max_delay_s / step_time_s)), self.max_every)
        return max(1, k)
