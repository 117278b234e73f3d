"""The optimum checkpoint interval: Young's and Daly's estimates and the exact minimiser.

The model (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", Future Generation Computer Systems 22, 2006): failures arrive as a Poisson process with mean
time between failures ``M``; training alternates ``tau`` seconds of compute with a blocking save of
``C`` seconds; a failure (also one during a save or a restart) loses everything since the last
completed save, and each restart costs ``R`` seconds. The expected wall time to get ``T_s`` seconds
of useful compute is then exactly::

    T_w(tau) = M * exp(R / M) * (exp((tau + C) / M) - 1) * T_s / tau

so the expected wasted fraction of wall time is ``1 - T_s / T_w`` (:func:`expected_waste_fraction`).
:func:`young_interval` is the first-order optimum ``sqrt(2 C M)``, :func:`daly_interval` Daly's
higher-order one, and :func:`optimal_interval` the exact minimiser found numerically (``R`` does not
move it). Pure functions of numbers; :mod:`.adaptive` builds the schedule on them.
"""

from __future__ import annotations

import math

from .numbers_check import check_number


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints: ``sqrt(2 C M)`` seconds."""
    c = check_number("cost_s", cost_s)
    m = check_number("mtbf_s", mtbf_s, positive=True)
    return math.sqrt(2.0 * c * m)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the optimum compute time between checkpoints (FGCS 2006)::

    sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C    if C < 2M
    M                                                         otherwise
    """
    return _daly(check_number("cost_s", cost_s), check_number("mtbf_s", mtbf_s, positive=True))


def _daly(c: float, m: float) -> float:
    if c >= 2.0 * m:
        return m
    r = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - c


def expected_waste_fraction(
    interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """Expected fraction of wall time not spent on useful compute, under Daly's exponential model::

        waste = 1 - tau / (M * exp(R / M) * (exp((tau + C) / M) - 1))

    with ``tau = interval_s`` seconds of compute between blocking saves of ``C = cost_s`` seconds,
    ``M = mtbf_s`` and a restart cost ``R = restart_s`` after every failure (failures may also hit
    saves and restarts). It counts save time, lost work and restart time; 1.0 means no progress.
    """
    return _waste(
        check_number("interval_s", interval_s, positive=True),
        check_number("cost_s", cost_s),
        check_number("mtbf_s", mtbf_s, positive=True),
        check_number("restart_s", restart_s),
    )


def _waste(tau: float, c: float, m: float, r: float = 0.0) -> float:
    try:
        wall_per_useful = m * math.exp(r / m) * math.expm1((tau + c) / m) / tau
    except OverflowError:
        return 1.0
    return max(0.0, 1.0 - 1.0 / wall_per_useful)


def optimal_interval(cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The interval minimising :func:`expected_waste_fraction`, found numerically (a reference for
    :func:`daly_interval`; no scipy). The waste is minimal where the wall time per useful second,
    ``M exp(R/M) expm1((tau + C)/M) / tau``, is; its derivative vanishes where
    ``h(tau) = exp((tau + C)/M) (1 - tau/M) - 1 = 0``. ``h`` is strictly decreasing on ``[0, M]``
    with ``h(0) > 0 > h(M)``, so a bisection on ``[0, M]`` finds the unique optimum to machine
    precision (a golden-section search on the waste itself only reaches ~1e-8, the square root
    of it). The restart cost does not move the optimum. Returns 0.0 for ``cost_s == 0`` (free
    checkpoints: save as often as possible)."""
    c = check_number("cost_s", cost_s)
    m = check_number("mtbf_s", mtbf_s, positive=True)
    check_number("restart_s", restart_s)
    if c == 0.0:
        return 0.0

    def h(tau: float) -> float:
        x = tau / m
        return math.expm1((tau + c) / m) * (1.0 - x) - x  # = e^{(tau+C)/M} (1 - x) - 1

    lo, hi = 0.0, m
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        if h(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0
