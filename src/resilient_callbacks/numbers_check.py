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
