"""How long background saves waited for the previous one, and when that is worth saying.

A background save waits when the previous checkpoint is still being written: saves are due
faster than the disk persists them. A few milliseconds per save is noise; a wait that takes a
visible share of the training time between two saves is a problem the user should hear about,
once, not on every save and every rank (a 3000-step DDP run used to print one line per save per
rank). :class:`SaveWaits` keeps the counts on every rank, warns on the coordinator only when a
wait matters, at most once per ``warn_every`` seconds, and gives a summary for ``close()``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("resilient_callbacks")

#: A wait "matters" when it is at least this share of the time between two saves ...
MATTERS_FRACTION = 0.05
#: ... and at least this long (shorter waits are scheduling noise whatever the interval).
MATTERS_SECONDS = 0.02


@dataclass
class SaveWaits:
    """Counts and totals of the waits of background saves for the previous save.

    Rank contract: every rank calls :meth:`observe` for its own waits and keeps its own counts;
    only an instance made with ``speak=True`` (the coordinator's) logs anything.
    """

    speak: bool = True
    warn_every: float = 600.0
    saves: int = 0
    waits: int = 0
    mattered: int = 0
    total_seconds: float = 0.0
    longest: float = 0.0
    _interval_seconds: float = 0.0
    _last_warned: float | None = None
    _quiet_since_warned: int = 0

    def observe(self, step: int, waited: float, interval: float) -> None:
        """One background save at ``step`` waited ``waited`` s; ``interval`` is the wall time
        since the previous save returned (the wait included)."""
        self.saves += 1
        self._interval_seconds += max(interval, waited)
        if waited <= 0.001:
            return
        self.waits += 1
        self.total_seconds += waited
        self.longest = max(self.longest, waited)
        share = waited / interval if interval > 0 else 1.0
        if waited < MATTERS_SECONDS or share < MATTERS_FRACTION:
            log.debug("step %d waited %.3f s for the previous checkpoint", step, waited)
            return
        self.mattered += 1
        if not self.speak:
            return
        now = time.monotonic()
        if self._last_warned is not None and now - self._last_warned < self.warn_every:
            self._quiet_since_warned += 1
            return
        more = (
            f"; {self._quiet_since_warned} more such wait(s) since the last warning"
            if self._quiet_since_warned
            else ""
        )
        log.warning(
            "step %d waited %.2f s (%.0f%% of the %.2f s since the previous save) for the "
            "previous checkpoint to finish writing: saves are due faster than the disk persists "
            "them. Save less often, or pass if_busy='skip'%s",
            step,
            waited,
            100 * share,
            interval,
            more,
        )
        self._last_warned = now
        self._quiet_since_warned = 0

    def summary(self) -> str | None:
        """One line for ``close()``, or None when no save waited."""
        if not self.waits:
            return None
        share = self.total_seconds / self._interval_seconds if self._interval_seconds else 0.0
        return (
            f"{self.waits} of {self.saves} background saves waited for the previous one to "
            f"finish writing: {self.total_seconds:.2f} s in all ({100 * share:.1f}% of the time "
            f"between saves), longest {self.longest:.2f} s; {self.mattered} of them long enough "
            "to matter"
        )

    def log_summary(self) -> None:
        """Log :meth:`summary` on the speaking rank: a warning if any wait mattered."""
        line = self.summary()
        if line is None or not self.speak:
            return
        log.log(logging.WARNING if self.mattered else logging.INFO, line)
