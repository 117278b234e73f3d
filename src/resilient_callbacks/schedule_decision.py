"""The adaptive schedule's decision from its measurements (:func:`decide`): the Daly optimum for
the median blocking cost and the MTBF, clamped by ``max_overhead``, ``min_interval_s``,
``max_interval_s`` and the persist time, in steps rounded towards the binding clamp, with every
input and intermediate; and the bounds in steps that a latched decision must stay within
(:func:`hard_step_bounds`). Imports no training framework (not even torch).

Which ranks call what: every rank, through its :class:`~.adaptive.AdaptiveSchedule`
(``interval_steps``, ``interval_seconds``, ``explain``); nothing here is collective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .interval import _daly, _waste
from .numbers_check import median
from .schedule_text import HOUR

if TYPE_CHECKING:
    from .adaptive import AdaptiveSchedule

# Clamps that raise the interval (converted to steps rounding up) and the one that lowers it.
_FLOORS = ("max_overhead", "min_interval_s", "persist")
_CEILING = "max_interval_s"


def decide(s: AdaptiveSchedule) -> dict[str, Any]:
    """What the measurements of ``s`` call for now, with every input and intermediate (the
    dictionary :meth:`~.adaptive.AdaptiveSchedule.explain` completes); during the warm-up,
    ``warmup_steps``."""
    step = median(s._steps)
    cost = median(s._costs)
    persist = median(s._persists) if s._persists else s._latest_persist
    mtbf = s.mtbf_estimate()
    info: dict[str, Any] = {
        "phase": "adaptive" if s.ready else "warmup",
        "step_time_s": step,
        "steps_observed": s._n_steps,
        "blocking_cost_s": cost,
        "saves_observed": s._n_saves,
        "persist_s": persist,
        "mtbf_s": mtbf,
        "mtbf_source": s.mtbf_source(),
        "mtbf_user_s": None if s.mtbf_hours is None else float(s.mtbf_hours) * HOUR,
        "mtbf_learned_s": s.learned_mtbf_s(),
        "prior_mtbf_s": s.prior_mtbf_hours * HOUR,
        "failures_observed": s._failures,
        "exposure_s": s.exposure_s,
        "young_interval_s": None,
        "daly_interval_s": None,
        "bounds_s": {},
        "clamps_applied": [],
        "clamp": None,
        "interval_s": math.nan,
        "interval_steps": s.warmup_steps,
        "expected_overhead": None,
        "expected_waste_fraction": None,
    }
    if not s.ready or cost is None or step is None:
        if step is not None:
            info["interval_s"] = s.warmup_steps * step
        return info

    raw = _daly(cost, mtbf)
    bounds: dict[str, float] = {}
    if s.max_overhead is not None:
        bounds["max_overhead"] = cost / s.max_overhead
    if s.min_interval_s is not None:
        bounds["min_interval_s"] = float(s.min_interval_s)
    if s.max_interval_s is not None:
        bounds["max_interval_s"] = float(s.max_interval_s)
    if persist is not None:
        bounds["persist"] = persist

    interval, clamp, applied = raw, None, []
    # Floors first, then the user's ceiling, then the persist floor, which nothing overrides.
    for name in ("max_overhead", "min_interval_s", "max_interval_s", "persist"):
        if name not in bounds:
            continue
        b = bounds[name]
        if (name == _CEILING and interval > b) or (name != _CEILING and interval < b):
            interval, clamp = b, name
            applied.append(name)

    per_step = max(step, 1e-9)
    x = interval / per_step
    if clamp in _FLOORS:
        steps = math.ceil(x * (1 - 1e-12))
    elif clamp == _CEILING:
        steps = math.floor(x * (1 + 1e-12))
    else:
        steps = round(x)
    steps = max(1, int(steps))

    info.update(
        young_interval_s=math.sqrt(2.0 * cost * mtbf),
        daly_interval_s=raw,
        bounds_s=bounds,
        clamps_applied=applied,
        clamp=clamp,
        interval_s=interval,
        interval_steps=steps,
        expected_overhead=cost / interval if interval > 0 else math.inf,
        expected_waste_fraction=_waste(interval, cost, mtbf) if interval > 0 else 1.0,
    )
    return info


def hard_step_bounds(info: Mapping[str, Any]) -> tuple[int, int | None]:
    """The steps (at least, at most: None for no limit) that the persist floor,
    ``min_interval_s`` and ``max_interval_s`` of ``info`` (:func:`decide`'s) allow at its step
    time: a latched decision outside them is replaced, even within ``change_tolerance``."""
    per_step = max(info["step_time_s"] or 0.0, 1e-9)
    b = info["bounds_s"]
    lo_s = max(b.get("persist", 0.0), b.get("min_interval_s", 0.0))
    lo = max(1, math.ceil(lo_s / per_step * (1 - 1e-12)))
    hi = None
    if "max_interval_s" in b:
        hi = max(1, math.floor(b["max_interval_s"] / per_step * (1 + 1e-12)))
    return lo, hi
