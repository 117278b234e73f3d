"""Checks of the numbers the adaptive schedule is given (options, measurements, timestamps),
with errors that name the option and say what it must be."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from .errors import ConfigError


def check_number(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r}: must be a number of seconds")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name}={value!r}: must be a finite number {bound} (seconds)")
    return v


def opt_number(name: str, value: Any, *, positive: bool = True, unit: str = "seconds") -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name}={value!r}: must be a finite number {bound} ({unit}), or None")


def opt_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be an int >= {minimum}")


def median(values: Iterable[float]) -> float | None:
    vals = list(values)
    return statistics.median(vals) if vals else None


def durations(name: str, values: Iterable[Any]) -> list[float]:
    out = [float(v) for v in values]
    if not all(map(math.isfinite, out)) or (out and min(out) < 0):
        raise ConfigError(f"{name}={out!r:.200}: durations must be finite and >= 0")
    return out


def check_time(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r}: must be a finite timestamp (time.time())")
    return float(value)


def check_schedule_options(s: Any, default_prior_hours: float) -> None:
    """The options of an :class:`~.adaptive.AdaptiveSchedule` ``s``, checked at construction."""
    opt_number("mtbf_hours", s.mtbf_hours, unit="hours")
    if s.prior_mtbf_hours is None:
        raise ConfigError(
            "prior_mtbf_hours=None: the prior is needed until failures are observed; pass a "
            f"number of hours > 0 (default {default_prior_hours:g}), or set mtbf_hours"
        )
    opt_number("prior_mtbf_hours", s.prior_mtbf_hours, unit="hours")
    if s.max_overhead is not None and (
        isinstance(s.max_overhead, bool)
        or not isinstance(s.max_overhead, (int, float))
        or not 0 < s.max_overhead < 1
    ):
        raise ConfigError(
            f"max_overhead={s.max_overhead!r}: must be a fraction of training time in "
            "(0, 1), e.g. 0.01 for at most 1% of the time blocked in saves, or None for no cap"
        )
    opt_number("min_interval_s", s.min_interval_s)
    opt_number("max_interval_s", s.max_interval_s)
    if (
        s.min_interval_s is not None
        and s.max_interval_s is not None
        and s.min_interval_s > s.max_interval_s
    ):
        raise ConfigError(
            f"min_interval_s={s.min_interval_s:g} > max_interval_s={s.max_interval_s:g}: "
            "no interval satisfies both; swap them or drop one"
        )
    opt_int("warmup_steps", s.warmup_steps, 1)
    opt_int("step_window", s.step_window, 1)
    opt_int("save_window", s.save_window, 1)
    if (
        isinstance(s.change_tolerance, bool)
        or not isinstance(s.change_tolerance, (int, float))
        or not 0 <= s.change_tolerance < 1
    ):
        raise ConfigError(
            f"change_tolerance={s.change_tolerance!r}: must be a fraction in [0, 1), "
            "e.g. 0.05 to keep the current interval while the optimum moves by less than 5%"
        )
