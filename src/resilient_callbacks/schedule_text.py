"""The adaptive schedule's decision in words: the notes of
:meth:`~.adaptive.AdaptiveSchedule.explain` and the one log line of
:meth:`~.adaptive.AdaptiveSchedule.describe`, from the figures ``explain`` computed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .interval import expected_waste_fraction

HOUR = 3600.0


def notes(info: Mapping[str, Any], warmup_steps: int, prior_mtbf_hours: float) -> list[str]:
    """What a reader of the figures should know: warming up, MTBF still the prior, a cap that
    costs goodput."""
    out = []
    if info["phase"] == "warmup":
        out.append(
            f"warming up: the first save comes after {warmup_steps} steps and measures "
            "the save cost"
        )
    if info["mtbf_source"] == "prior":
        out.append(
            f"no failure observed yet: MTBF is the prior {prior_mtbf_hours:g} h "
            "(plus any failure-free exposure)"
        )
    if info["clamp"] == "max_overhead":
        daly_waste = expected_waste_fraction(
            max(info["daly_interval_s"], 1e-9), info["blocking_cost_s"], info["mtbf_s"]
        )
        out.append(
            f"max_overhead={info['max_overhead']:g} lengthens the interval beyond the goodput "
            f"optimum: expected waste {100 * info['expected_waste_fraction']:.2f}% instead of "
            f"{100 * daly_waste:.2f}% (pass max_overhead=None to optimise goodput only)"
        )
    return out


def one_line(i: Mapping[str, Any], warmup_steps: int) -> str:
    """One line for logs."""
    if i["phase"] == "warmup":
        return (
            # (step times: the first step() of a run or a life has no step before it to time)
            f"adaptive checkpointing: warming up ({i['steps_observed']}/{warmup_steps} "
            f"step times, {i['saves_observed']} save(s) measured); saving every "
            f"{warmup_steps} steps until a save has been measured"
        )
    src = {
        "user": "given",
        "learned": f"learned from {i['failures_observed']} failure(s)",
        "prior": "prior, no failure observed yet",
    }[i["mtbf_source"]]
    clamp = "no clamp" if i["clamp"] is None else f"clamped by {i['clamp']}"
    persist = "" if i["persist_s"] is None else f", persist {i['persist_s']:.3g} s"
    steps = i.get("decision_steps") or i["interval_steps"]  # the decision in force
    # the seconds are those of the interval computed now: said with its steps when the
    # decision in force was kept against it (it read "every 415 steps (kept: 407 now, ...)
    # (407's seconds)", as if 407 were kept)
    now = f"{i['interval_s']:.4g} s"
    if steps == i["interval_steps"]:
        kept = f" ({now})"
    elif abs(steps - i["interval_steps"]) <= i.get("change_tolerance", 0.0) * steps:
        kept = (
            f" (kept: the {i['interval_steps']} steps ({now}) computed now are within the "
            "change tolerance)"
        )
    else:  # adopted: another rank proposed a longer interval (its save cost, its steps)
        mine = f"{i['interval_steps']} steps ({now})"
        kept = f" (the largest of the ranks' proposals; this rank's: {mine})"
    return (
        f"adaptive checkpointing: every {steps} steps{kept} "
        f"= Daly {i['daly_interval_s']:.4g} s for save cost {i['blocking_cost_s']:.3g} s, "
        f"MTBF {i['mtbf_s'] / HOUR:.3g} h ({src}), step {i['step_time_s']:.3g} s{persist}; "
        f"{clamp}; expected overhead {100 * i['expected_overhead']:.2f}%"
    )
