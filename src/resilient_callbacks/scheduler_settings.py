"""LR scheduler settings a restore takes from the checkpoint over those the new code passed.

torch's LR schedulers keep their settings in their state dict (``CosineAnnealingLR``'s
``T_max``, ``OneCycleLR``'s ``total_steps``, ``StepLR``'s ``step_size``, ``SequentialLR``'s
milestones and its schedulers' own), and their ``load_state_dict`` puts the checkpoint's in
place of the live ones without a word. A restore loads exactly what torch loads (nothing that
torch accepts is refused); :func:`changed` names the settings that differ, so a change made to
the script for the resumed run is not dropped silently. ``LambdaLR``'s and
``MultiplicativeLR``'s functions are not in the state dict (code, not state): the new code's
apply from the saved step, and a change of them cannot be seen here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .values import same_value

#: state-dict keys of torch's schedulers that say where the schedule is, not how it goes
#: (``base_lrs`` comes from the optimizer's groups, restored with it; ``T_cur`` and ``T_i``:
#: ``CosineAnnealingWarmRestarts``' place in its cycle and that cycle's length)
PROGRESS = frozenset(
    {
        "last_epoch",
        "_step_count",
        "_is_initial",
        "_get_lr_called_within_step",
        "_last_lr",
        "base_lrs",
        "best",
        "num_bad_epochs",
        "cooldown_counter",
        "T_cur",
        "T_i",
    }
)


#: the resumes a restore loads schedulers as (:func:`message`)
LIKE = "torch's, Lightning's and the Trainer's own resume do"


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's LR schedulers (``ReduceLROnPlateau`` too)."""
    s = torch.optim.lr_scheduler
    return isinstance(obj, (s.LRScheduler, s.ReduceLROnPlateau))


def changed(live: Mapping[str, Any], saved: Mapping[str, Any], path: str = "") -> list[str]:
    """The settings of a scheduler's state dict ``live`` (the new code's) that the
    checkpoint's ``saved`` replaces with other values: ``"T_max=10 from the checkpoint (100
    here)"``; those of the schedulers a ``SequentialLR`` or ``ChainedScheduler`` holds by
    their path (``_schedulers[1].milestones=...``)."""
    out: list[str] = []
    for k, mine in live.items():
        if k in PROGRESS:
            continue
        name = f"{path}.{k}" if path else str(k)
        if k not in saved:  # (torch keeps the live value)
            out.append(f"{name} not in the checkpoint, yours kept (another scheduler's state?)")
            continue
        theirs = saved[k]
        if (
            isinstance(mine, list)
            and isinstance(theirs, list)
            and len(mine) == len(theirs)
            and all(isinstance(v, Mapping) for v in (*mine, *theirs))
            and mine
        ):  # the state dicts of the schedulers it holds
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                out += changed(a, b, f"{name}[{i}]")
        elif not same_value(_plain(mine), _plain(theirs)):
            out.append(f"{name}={_short(theirs)} from the checkpoint ({_short(mine)} here)")
    return out


def described(where: str, scheduler: Any, saved: Any) -> list[str]:
    """``["<where> (<class>): <each setting changed>"]`` when loading ``saved`` into
    ``scheduler`` (one of torch's) replaces settings it has; ``[]`` when it replaces none or
    ``scheduler`` is not one of torch's (DeepSpeed's keep only their iteration)."""
    if not is_scheduler(scheduler) or not isinstance(saved, Mapping):
        return []
    diff = changed(scheduler.state_dict(), saved)
    return [f"{where} ({type(scheduler).__name__}): {', '.join(diff)}"] if diff else []


def message(settings: list[str], how: str, like: str = LIKE) -> str:
    """The one warning about ``settings`` (``"<where> (<class>): <what changed>"`` each, from
    :func:`changed`) that every restore gives, ``like`` the framework's own resume, ``how``
    to resume with the new ones there."""
    return (
        "the checkpoint's LR scheduler settings replace those your code passed: "
        f"{'; '.join(settings)}. A scheduler's load_state_dict takes its settings from the "
        f"checkpoint, as {like}; to resume with the new ones, {how}"
    )


def _plain(v: Any) -> Any:
    return dict(v) if isinstance(v, Mapping) else v  # (a Counter, MultiStepLR's milestones)


def _short(v: Any) -> str:
    s = repr(_plain(v))
    return s if len(s) <= 60 else s[:57] + "..."
