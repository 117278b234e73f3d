"""LR scheduler settings a restore takes from the checkpoint over those the new code passed.

torch's LR schedulers keep their settings in their state dict (``CosineAnnealingLR``'s
``T_max``, ``OneCycleLR``'s ``total_steps``, ``StepLR``'s ``step_size``, ``SequentialLR``'s
milestones and its schedulers' own), and their ``load_state_dict`` puts the checkpoint's in
place of the live ones without a word. A restore loads exactly what torch loads (nothing that
torch accepts is refused); :func:`changed` names the settings that differ, so a change made to
the script for the resumed run is not dropped silently. A setting is a key that names a
parameter of the scheduler's ``__init__``: what else it keeps (a user's subclass's counters,
what torch derives from the settings, a key an older torch did not save) says nothing. ``LambdaLR``'s and
``MultiplicativeLR``'s functions are not in the state dict (code, not state): the new code's
apply from the saved step, and a change of them cannot be seen here.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch

from .errors import caller_stacklevel, warn_and_log
from .values import same_value

log = logging.getLogger("resilient_callbacks")

#: state-dict keys of torch's schedulers that say where the schedule is, not how it goes, even
#: where they name a parameter (``last_epoch``)
#: (``base_lrs`` comes from the optimizer's groups, restored with it, except in a class that
#: takes ``base_lr`` (``CyclicLR``): a setting there, :func:`_progress`; ``T_cur`` and ``T_i``:
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


def _progress(key: Any, params: frozenset[str]) -> bool:
    """Whether state-dict ``key`` is :data:`PROGRESS` for a class whose ``__init__`` takes
    ``params``: ``CyclicLR``'s ``base_lrs`` is its ``base_lr``, a setting."""
    return key in PROGRESS and not (key == "base_lrs" and "base_lr" in params)


#: the resumes a restore loads schedulers as (:func:`message`)
LIKE = "torch's, Lightning's and the Trainer's own resume do"


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's LR schedulers (``ReduceLROnPlateau`` too)."""
    s = torch.optim.lr_scheduler
    return isinstance(obj, (s.LRScheduler, s.ReduceLROnPlateau))


def changed(scheduler: Any, saved: Mapping[str, Any], path: str = "") -> list[str]:
    """The settings of ``scheduler`` (one of torch's, or a subclass) that loading the
    checkpoint's state dict ``saved`` replaces with other values: ``"T_max=10 from the
    checkpoint (100 here)"``; those of the schedulers a ``SequentialLR`` or
    ``ChainedScheduler`` holds by their path (``_schedulers[1].milestones=...``).

    A setting is a state-dict key that names a parameter of the class's ``__init__`` (of any
    class in its MRO; a leading underscore and a plural ``s`` aside: ``_milestones``,
    ``min_lrs``), less :data:`PROGRESS`: what else a scheduler keeps (a subclass's own
    counters, what torch derives from the settings) is where it is or how torch computes it.
    A key the checkpoint lacks (an older torch's) keeps the live value: nothing replaced.
    ``lr_lambdas``: torch loads a saved callable object's attributes into the live one (a
    function's entry, ``None``, loads nothing), so only attributes both hold are compared."""
    out = []
    for name, _, theirs, mine in _diffs(scheduler, saved, path):
        a, b = _shown(theirs, mine)
        out.append(f"{name}={a} from the checkpoint ({b} here)")
    return out


def kept(scheduler: Any, saved: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` with the settings :func:`changed` names set back to those ``scheduler`` has,
    for a roll-back (a ``restore()`` again in the running process): where the run is comes
    from the checkpoint, how it schedules stays the run's. In torch's own classes (not a
    subclass) what torch derives from the settings (``OneCycleLR``'s ``_schedule_phases``,
    ``CyclicLR``'s ``total_size``) stays the run's too: it goes with them."""
    out = copy.deepcopy(dict(saved))
    live = scheduler.state_dict()
    for _, keys, _, mine in _diffs(scheduler, saved):
        _put(out, keys, mine)
    _keep_derived(scheduler, live, out, saved)
    return out


def _keep_derived(scheduler: Any, live: Mapping[str, Any], out: Any, saved: Any) -> None:
    """What a torch class derives from its settings, the live values, where any setting of it
    differs (``out``: the copy of ``saved`` that :func:`kept` returns)."""
    if not _diffs(scheduler, saved) or not type(scheduler).__module__.startswith("torch."):
        return
    params = _init_params(type(scheduler))
    for k, mine in live.items():
        bare = str(k).lstrip("_")
        if k in PROGRESS or k not in saved or bare in params or bare.removesuffix("s") in params:
            continue
        if k == "_schedulers" and isinstance(out[k], list):  # (a SequentialLR's): each its own
            held = getattr(scheduler, "_schedulers", [])
            for h, m, o, b in zip(held, mine, out[k], saved[k], strict=False):
                if is_scheduler(h) and isinstance(o, dict) and isinstance(b, Mapping):
                    _keep_derived(h, m, o, b)
            continue
        if k != "lr_lambdas":  # (factors: compared one by one)
            out[k] = copy.deepcopy(mine)


def _put(out: Any, keys: tuple[Any, ...], value: Any) -> None:
    for k in keys[:-1]:
        out = out[k]
    out[keys[-1]] = copy.deepcopy(value)


def _diffs(
    scheduler: Any, saved: Mapping[str, Any], path: str = ""
) -> list[tuple[str, tuple[Any, ...], Any, Any]]:
    """Each setting of :func:`changed`: its name, its keys in the state dict, the checkpoint's
    value and the live one."""
    live = scheduler.state_dict()
    params = _init_params(type(scheduler))
    out: list[tuple[str, tuple[Any, ...], Any, Any]] = []
    for k, mine in live.items():
        if _progress(k, params) or k not in saved:
            continue
        name = f"{path}.{k}" if path else str(k)
        theirs = saved[k]
        if k == "lr_lambdas" and isinstance(mine, list) and isinstance(theirs, list):
            out += [(n, (k, *keys), a, b) for n, keys, a, b in _factors(mine, theirs, name)]
            continue
        bare = str(k).lstrip("_")
        if bare not in params and bare.removesuffix("s") not in params:
            continue
        held = getattr(scheduler, str(k), None)
        if (
            isinstance(held, list)
            and isinstance(mine, list)
            and isinstance(theirs, list)
            and len(held) == len(mine) == len(theirs)
            and all(is_scheduler(h) for h in held)
            and all(isinstance(v, Mapping) for v in theirs)
        ):  # the schedulers it holds, with their state dicts
            for i, (h, b) in enumerate(zip(held, theirs, strict=True)):
                out += [(n, (k, i, *ks), x, y) for n, ks, x, y in _diffs(h, b, f"{name}[{i}]")]
        elif not same_value(_plain(mine), _plain(theirs)):
            out.append((name, (k,), theirs, mine))
    return out


def _factors(
    mine: list[Any], theirs: list[Any], name: str
) -> list[tuple[str, tuple[Any, ...], Any, Any]]:
    """The attributes of ``LambdaLR``/``MultiplicativeLR`` callable objects that torch's load
    replaces (it updates a live factor's ``__dict__`` with the saved entry's keys)."""
    out: list[tuple[str, tuple[Any, ...], Any, Any]] = []
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
            continue  # a function on either side: the new code's stays in place
        for k, v in b.items():
            if k in a and not same_value(_plain(a[k]), _plain(v)):
                out.append((f"{name}[{i}].{k}", (i, k), v, a[k]))
    return out


def _init_params(cls: type) -> frozenset[str]:
    """The parameter names of every ``__init__`` a scheduler class and its bases define."""
    names: set[str] = set()
    for c in cls.__mro__:
        init = c.__dict__.get("__init__")
        if init is None or c is object:
            continue
        try:
            sig = inspect.signature(init)
        except (TypeError, ValueError):
            continue
        names.update(
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)
        )
    names.discard("self")
    names.discard("optimizer")
    return frozenset(names)


def held(obj: Any) -> Any:
    """The torch scheduler that ``obj``'s ``load_state_dict`` loads: ``obj`` itself, or the
    one a wrapper that loads the whole state dict into it holds as ``scheduler`` (it says so
    with ``HOLDS_SCHEDULER``: DeepSpeed's ``SchedulerState``); None if neither."""
    if is_scheduler(obj):
        return obj
    inner = getattr(obj, "scheduler", None) if getattr(obj, "HOLDS_SCHEDULER", False) else None
    return inner if is_scheduler(inner) else None


def say(msg: str, coordinator: bool, through: tuple[str, ...] = ()) -> None:
    """Say ``msg`` once: a warning on the coordinator (rank 0), at the user's line (outside
    this package and the directories ``through``), logged there too where logging is set up;
    the other ranks log it at INFO (every rank loads the same settings: each printing it
    said it once per rank)."""
    warn_and_log(log, msg, stacklevel=caller_stacklevel(*through), warn=coordinator)


def described(where: str, scheduler: Any, saved: Any) -> list[str]:
    """``["<where> (<class>): <each setting changed>"]`` when loading ``saved`` into
    ``scheduler`` (one of torch's) replaces settings it has; ``[]`` when it replaces none or
    ``scheduler`` is not one of torch's (DeepSpeed's keep only their iteration)."""
    if not is_scheduler(scheduler) or not isinstance(saved, Mapping):
        return []
    diff = changed(scheduler, saved)
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


def _shown(theirs: Any, mine: Any, width: int = 60) -> tuple[str, str]:
    """The reprs of two values that differ, each cut to about ``width`` characters around
    where they first differ (two long values differing at their end still read apart)."""
    a, b = repr(_plain(theirs)), repr(_plain(mine))
    if len(a) <= width and len(b) <= width:
        return a, b
    pairs = enumerate(zip(a, b, strict=False))
    first = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
    start = max(0, first - width // 3)
    return _cut(a, start, width), _cut(b, start, width)


def _cut(s: str, start: int, width: int) -> str:
    head = "..." if start else ""
    body = s[start : start + width]
    return head + body + ("..." if start + width < len(s) else "")
