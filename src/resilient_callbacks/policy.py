"""When to save: the fixed triggers shared by every adapter.

``every_n_steps`` saves at multiples of N (or at the first step past one, for a step counter
that jumps); ``every_seconds`` saves when that much wall time has
passed since the last save (or since the run started); archive steps (``keep_every_n_steps``)
are always saved so that the archive retention has something to keep. With several ranks the
time-based decision is agreed (due when any rank's clock says so), so all ranks save at the
same step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class SavePolicy:
    every_n_steps: int | None = None
    every_seconds: float | None = None
    archive_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and (
            isinstance(self.every_n_steps, bool)
            or not isinstance(self.every_n_steps, int)
            or self.every_n_steps < 1
        ):
            raise ConfigError(
                f"every_n_steps={self.every_n_steps!r}: must be an int >= 1, or None to not save "
                "by step count"
            )
        if self.every_seconds is not None and (
            isinstance(self.every_seconds, bool)
            or not isinstance(self.every_seconds, (int, float))
            or not self.every_seconds > 0
        ):
            raise ConfigError(
                f"every_seconds={self.every_seconds!r}: must be a number > 0, or None to not save "
                "by wall time"
            )

    @property
    def has_trigger(self) -> bool:
        return bool(self.every_n_steps or self.every_seconds or self.archive_every_n_steps)

    def due_by_step(self, step: int, previous: int | None = None) -> str | None:
        """Why ``step`` is saved by step count, or None. ``previous``: the step seen before this
        one; a counter that jumps (Lightning's ``global_step`` counts every ``optimizer.step()``
        of a batch: with two optimizers stepping on alternate batches it goes 3, 5, 6, 8, ...)
        may pass over a multiple of ``every_n_steps``: the step that passed it is due."""
        if step <= 0:
            return None  # nothing trained yet: never worth a checkpoint
        n = self.every_n_steps
        if n and (
            step // n > previous // n
            if previous is not None and 0 <= previous < step
            else step % n == 0
        ):
            return f"every_n_steps={n}"
        if self.archive_every_n_steps and step % self.archive_every_n_steps == 0:
            return f"archive step (keep_every_n_steps={self.archive_every_n_steps})"
        return None


class Clock:
    """Tracks the time of the last save for ``every_seconds``."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def reset(self, elapsed: float = 0.0) -> None:
        """The last save is now, or ``elapsed`` seconds of running ago (a restart's: the
        time the run's processes before it ran since their last save)."""
        self.last = time.monotonic() - max(0.0, elapsed)

    def elapsed(self) -> float:
        return time.monotonic() - self.last
