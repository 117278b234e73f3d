"""When to save, adaptively: the checkpoint interval that wastes the least wall time.

One job: turn measurements (step time, blocking save cost, background persist time) and the failure
rate (given, or learned from the run's restart history) into a checkpoint interval, in steps, that
minimises the expected waste, and say why. It imports no training framework (not even torch).

The model and the formulas (Young's and Daly's optimum, the expected waste, the exact minimiser)
are in :mod:`.interval`; they are re-exported here. With asynchronous saves ``C`` is the
*blocking* part: the background persist time adds a constant to the work lost per failure but
does not change the optimum.

:class:`AdaptiveSchedule` is the per-run state the Checkpointer keeps. Which ranks call what:

- every rank may call the ``observe_*`` methods (cheap; only rank 0's values matter);
- every rank calls :meth:`AdaptiveSchedule.interval_steps` at points every rank knows and
  proposes the result; all ranks call :meth:`AdaptiveSchedule.adopt` with the largest proposal
  (:mod:`.trigger`: one ``all_reduce(MAX)`` at decision steps). Between those points
  every rank uses the same latched decision (:meth:`AdaptiveSchedule.should_save` on "steps since
  the last save"), so no collective is needed per step; :meth:`~AdaptiveSchedule.decision_changed`
  says when to broadcast again.

The decision from the measurements (the optimum, clamped, in steps) is :mod:`.schedule_decision`'s;
the schedule's explanations in words (log lines, notes) are in :mod:`.schedule_text`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import schedule_decision, schedule_text
from .errors import ConfigError
from .interval import (
    daly_interval,
    expected_waste_fraction,
    optimal_interval,
    young_interval,
)
from .numbers_check import (
    check_number,
    check_schedule_options,
    check_time,
    durations,
    median,
    opt_int,
)

HOUR = 3600.0
DEFAULT_PRIOR_MTBF_HOURS = 24.0
DEFAULT_MAX_OVERHEAD: float | None = None  # opt-in: the cap can cost more than it saves
_STATE_FORMAT = 1


# --------------------------------------------------------------------------- the schedule


@dataclass(kw_only=True)
class AdaptiveSchedule:
    """Chooses how many steps to train between checkpoints, from measurements, and explains it.

    Options (all keyword-only):

    - ``mtbf_hours``: mean time between failures of this job. ``None`` (default) learns it from the
      restart history (:meth:`set_restart_history`), starting from ``prior_mtbf_hours``.
    - ``prior_mtbf_hours`` (24): the assumption before any failure is observed; it counts as one
      pseudo-failure in the estimator, so a few early failures do not swing the estimate wildly.
    - ``max_overhead`` (``None``: no cap): an opt-in cap on the expected checkpoint overhead
      ``blocking cost / interval``, i.e. the interval is at least ``cost / max_overhead``. Note that
      the cap *lengthens* the interval beyond the goodput optimum whenever failures are frequent
      enough that the optimum overhead is larger (``~sqrt(C / 2M)``); see :meth:`explain`.
    - ``min_interval_s`` / ``max_interval_s``: explicit clamps on the interval (seconds of compute).
    - ``warmup_steps`` (20): steps to observe before the first decision. Until then, and until one
      save has been measured, :meth:`interval_steps` returns ``warmup_steps``: the first save comes
      right after the warm-up, and measures what a save costs.
    - ``step_window`` (50) / ``save_window`` (9): how many recent step times / saves the running
      medians use.
    - ``change_tolerance`` (0.05): a new decision within this relative distance of the current one is
      not taken (waste is flat near the optimum: 5% off costs ~0.1% more waste), so noise in the
      medians does not flip the decision and force re-broadcasts.

    Never shorter than the background persist time of recent saves (median), so saves are not
    scheduled faster than the previous one can persist; this floor beats ``max_interval_s``.
    """

    mtbf_hours: float | None = None
    prior_mtbf_hours: float = DEFAULT_PRIOR_MTBF_HOURS
    max_overhead: float | None = DEFAULT_MAX_OVERHEAD
    min_interval_s: float | None = None
    max_interval_s: float | None = None
    warmup_steps: int = 20
    step_window: int = 50
    save_window: int = 9
    change_tolerance: float = 0.05

    _steps: deque[float] = field(init=False, repr=False, compare=False)
    _costs: deque[float] = field(init=False, repr=False, compare=False)
    _persists: deque[float] = field(init=False, repr=False, compare=False)
    _n_steps: int = field(init=False, repr=False, compare=False, default=0)
    _n_saves: int = field(init=False, repr=False, compare=False, default=0)
    _failures: int = field(init=False, repr=False, compare=False, default=0)
    _exposure_s: float = field(init=False, repr=False, compare=False, default=0.0)
    # the run's start when the exposure runs on with the clock (no now/exposure_s given)
    _exposure_origin: float | None = field(init=False, repr=False, compare=False, default=None)
    _latest_persist: float | None = field(init=False, repr=False, compare=False, default=None)
    _decision: int | None = field(init=False, repr=False, compare=False, default=None)
    _version: int = field(init=False, repr=False, compare=False, default=0)
    _seen_version: int = field(init=False, repr=False, compare=False, default=0)
    _was_adaptive: bool = field(init=False, repr=False, compare=False, default=False)
    # whether this process saved yet (its first save sets things up: not a steady cost) and
    # how the last one's cost was taken: "first" (replaced by the next), "sample", or None
    _saved_here: bool = field(init=False, repr=False, compare=False, default=False)
    _last_taken: str | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        check_schedule_options(self, DEFAULT_PRIOR_MTBF_HOURS)
        self._steps = deque(maxlen=self.step_window)
        self._costs = deque(maxlen=self.save_window)
        self._persists = deque(maxlen=self.save_window)

    # ------------------------------------------------------------------ measurements

    def observe_step(self, seconds: float, steps: int = 1) -> None:
        """Record one training step's duration (compute only: leave out time blocked in a
        save); ``steps`` step numbers of ``seconds`` each went by (the warm-up counts them)."""
        self._steps.append(check_number("seconds", seconds))
        self._n_steps += steps

    def observe_save(self, blocking_s: float, persist_s: float | None = None) -> None:
        """Record a save: ``blocking_s`` the training thread was blocked (the snapshot, or the whole
        save when synchronous), and, when known, ``persist_s`` the background write/commit/upload
        took after that. A process's first save (one-time set-up: 4-7x the next) is the
        cost only while nothing else is measured, until this process's next save replaces it;
        after a restore of measurements it is not taken."""
        cost = check_number("blocking_s", blocking_s)
        first, self._saved_here = not self._saved_here, True
        if self._last_taken == "first":
            self._costs[-1], self._last_taken = cost, "sample"
        elif not first or not self._costs:
            self._costs.append(cost)
            self._last_taken = "first" if first else "sample"
        else:
            self._last_taken = None
        if persist_s is not None:
            self._persists.append(check_number("persist_s", persist_s))
        self._n_saves += 1

    def observe_persist(self, persist_s: float) -> None:
        """A background save's persist time, when it commits (any thread: one assignment); the
        floor until a save carries the median in, so the first decision after warm-up has one."""
        self._latest_persist = check_number("persist_s", persist_s)

    def amend_last_cost(self, blocking_s: float) -> None:
        """Replace the last blocking cost observed (a synchronous save's, once its commit is in)."""
        if self._costs and self._last_taken is not None:
            self._costs[-1] = check_number("blocking_s", blocking_s)

    def set_restart_history(
        self,
        times: Iterable[float],
        run_start: float,
        *,
        now: float | None = None,
        exposure_s: float | None = None,
        downtime_s: float = 0.0,
    ) -> None:
        """Learn the failure rate from the run's restarts: ``times`` are the wall-clock times
        (``time.time()``) at which the run was resumed after a failure, each one counting as one
        failure; ``run_start`` is when the run was first launched. Only unplanned resumes should be
        listed: a resume after a clean stop (time limit reached, preemption with a final save) is
        not a failure.

        The exposure (running time observed) is ``now - run_start - downtime_s`` (``now``: by
        default the current time; ``downtime_s``: the time the run was not running, e.g. queued
        between a stop and its resume, :func:`.history.downtime`), or ``exposure_s`` when the
        caller knows it better. Without ``now`` and ``exposure_s`` the exposure goes on growing
        with the clock (the estimate sharpens as the run survives); else it is frozen."""
        try:
            ts = [float(t) for t in times]
        except (TypeError, ValueError):
            raise ConfigError(
                f"times={times!r:.200}: must be an iterable of timestamps (time.time())"
            ) from None
        if not all(map(math.isfinite, ts)):
            raise ConfigError(f"times={ts!r:.200}: every restart time must be finite")
        start, down = check_time("run_start", run_start), check_number("downtime_s", downtime_s)
        before = [t for t in ts if t < start]
        if before:
            raise ConfigError(
                f"restart time {before[0]!r} is before run_start={run_start!r}: the restart "
                "history and the run start must be on the same clock (time.time())"
            )
        if exposure_s is None:
            end = time.time() if now is None else check_time("now", now)
            if end < max(ts, default=start):
                raise ConfigError(
                    f"now={end!r} is before the last restart or the run start; pass the current "
                    "time.time()"
                )
            exposure = max(0.0, end - start - down)
        else:
            exposure = check_number("exposure_s", exposure_s)
        self._failures = len(ts)
        self._exposure_s = exposure
        self._exposure_origin = start + down if now is None and exposure_s is None else None

    @property
    def failures_observed(self) -> int:
        return self._failures

    def learned_mtbf_s(self) -> float:
        """MTBF estimated from the restart history alone (seconds).

        Estimator: failures are a Poisson process of rate ``1/M``; the prior is a Gamma
        distribution worth one pseudo-failure observed over ``prior_mtbf_hours``. After ``n``
        failures in ``E`` seconds of exposure the posterior mean rate is ``(1 + n) / (M0 + E)``,
        and the estimate is its reciprocal ``(M0 + E) / (1 + n)``: the prior ``M0`` before anything
        is observed, the plain ``E / n`` once many failures have been.
        """
        return (self.prior_mtbf_hours * HOUR + self.exposure_s) / (1 + self._failures)

    @property
    def exposure_s(self) -> float:
        """The running time observed (seconds): as of the last :meth:`set_restart_history`, or
        up to now when that call left it running with the clock."""
        if self._exposure_origin is None:
            return self._exposure_s
        return max(self._exposure_s, time.time() - self._exposure_origin)

    def blocking_cost_s(self) -> float | None:
        """The save cost (median blocking seconds) the decision uses; None before a save."""
        return median(self._costs) if self._costs else None

    def mtbf_estimate(self) -> float:
        """The MTBF (seconds) the schedule uses: ``mtbf_hours`` when given, else the learned one."""
        if self.mtbf_hours is not None:
            return float(self.mtbf_hours) * HOUR
        return self.learned_mtbf_s()

    def mtbf_source(self) -> str:
        """``"user"`` (mtbf_hours given), ``"learned"`` (>= 1 failure observed) or ``"prior"``."""
        if self.mtbf_hours is not None:
            return "user"
        return "learned" if self._failures else "prior"

    @property
    def ready(self) -> bool:
        """True once ``warmup_steps`` steps and one save have been observed."""
        return self._n_steps >= self.warmup_steps and self._n_saves >= 1

    # ------------------------------------------------------------------ the decision

    def interval_seconds(self) -> float:
        """The interval (seconds of compute between saves) the current measurements call for: the
        Daly optimum for (median blocking cost, MTBF), then clamped by ``max_overhead``,
        ``min_interval_s``, ``max_interval_s`` and the persist time, in that order. During warm-up,
        ``warmup_steps`` times the median step time (NaN before any step is observed)."""
        return float(schedule_decision.decide(self)["interval_s"])

    def interval_steps(self) -> int:
        """Decide: the number of steps between saves, >= 1 (``round(interval_seconds() / median
        step time)``, rounding towards the binding clamp). Latches the decision (see
        :meth:`should_save`), bumping :attr:`version` if it changed; a new value within
        ``change_tolerance`` of the current one is not taken. On several ranks, every rank calls
        this and proposes the result; all call :meth:`adopt` with the largest."""
        info = schedule_decision.decide(self)
        new = int(info["interval_steps"])
        cur = self._decision
        if cur is not None and new != cur and info["phase"] == "adaptive" and self._was_adaptive:
            lo, hi = schedule_decision.hard_step_bounds(info)
            within = abs(new - cur) <= self.change_tolerance * cur
            if within and cur >= lo and (hi is None or cur <= hi):
                return cur
        self._was_adaptive = info["phase"] == "adaptive"
        self._set_decision(new)
        return new

    def _set_decision(self, steps: int) -> None:
        if steps != self._decision:
            self._decision = steps
            self._version += 1

    def adopt(self, steps: int) -> None:
        """Take the ranks' agreed decision (the largest proposal) as this rank's decision."""
        opt_int("steps", steps, 1)
        self._was_adaptive = self.ready
        self._set_decision(steps)

    @property
    def current_steps(self) -> int | None:
        """The latched decision (None before the first :meth:`interval_steps` or :meth:`adopt`)."""
        return self._decision

    @property
    def version(self) -> int:
        """Incremented every time the latched decision changes."""
        return self._version

    def decision_changed(self) -> bool:
        """True if the decision changed since the last call of this method (then re-broadcast)."""
        changed = self._version != self._seen_version
        self._seen_version = self._version
        return changed

    def should_save(self, steps_since_save: int) -> bool:
        """True when ``steps_since_save`` (steps since the last save, or since the start/restore)
        reaches the latched decision. Deciding first if nothing is latched yet."""
        n = self._decision if self._decision is not None else self.interval_steps()
        return steps_since_save >= n

    # ------------------------------------------------------------------ reporting

    def explain(self) -> dict[str, Any]:
        """Every input and intermediate of the current recommendation: measurements (medians of
        step time, blocking cost, persist time), MTBF and its source, the Young and raw Daly
        intervals, each clamp's bound and which applied, the final interval in seconds and steps,
        and the latched decision with its version."""
        info = schedule_decision.decide(self)
        info["max_overhead"] = self.max_overhead
        info["change_tolerance"] = self.change_tolerance
        info["decision_steps"] = self._decision
        info["version"] = self._version
        info["notes"] = schedule_text.notes(info, self.warmup_steps, self.prior_mtbf_hours)
        return info

    def describe(self) -> str:
        """One line for logs."""
        return schedule_text.one_line(self.explain(), self.warmup_steps)

    def __str__(self) -> str:
        return self.describe()

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """The measurements and the decision, JSON-serialisable, to store in a checkpoint so that
        a resumed run needs no new warm-up and every rank starts from the same decision. The
        restart history is not included: it lives in the checkpoint directory."""
        return {
            "format": _STATE_FORMAT,
            "steps": list(self._steps),
            "n_steps": self._n_steps,
            "costs": list(self._costs),
            "persists": list(self._persists),
            "n_saves": self._n_saves,
            "decision": self._decision,
            "adaptive": self._was_adaptive,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (windows are truncated to this config's)."""
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ConfigError(
                f"not an AdaptiveSchedule state (format {_STATE_FORMAT} expected): {state!r:.200}"
            )
        try:
            steps = durations("steps", state["steps"])
            costs = durations("costs", state["costs"])
            persists = durations("persists", state["persists"])
            n_steps, n_saves = int(state["n_steps"]), int(state["n_saves"])
            decision = state["decision"]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"corrupt AdaptiveSchedule state: {e}") from None
        self._steps = deque(steps, maxlen=self.step_window)
        self._costs = deque(costs, maxlen=self.save_window)
        self._persists = deque(persists, maxlen=self.save_window)
        self._n_steps, self._n_saves = n_steps, n_saves
        self._saved_here, self._last_taken = False, None  # (a restore: a process's start)
        self._was_adaptive = bool(state.get("adaptive", False))
        if decision is not None:
            opt_int("decision", decision, 1)
            self._set_decision(decision)


def __getattr__(name: str) -> Any:
    """``LossJumpTrigger`` moved to :mod:`.trigger`; the old import path keeps working."""
    if name == "LossJumpTrigger":
        from .trigger import LossJumpTrigger

        return LossJumpTrigger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdaptiveSchedule",
    "daly_interval",
    "expected_waste_fraction",
    "optimal_interval",
    "young_interval",
]
