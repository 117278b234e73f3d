"""What every framework adapter shares: one check of the options it passes to the Checkpointer,
and how a callback's options are completed by a DeepSpeed config's ``"resilient_checkpoint"``
section.

Imports no framework. An adapter takes its own options plus any :class:`~.Checkpointer` option
as keyword arguments; a misspelt or unknown one is one error type everywhere
(:class:`~.errors.UnknownOptionError`, a ``ConfigError`` and a ``TypeError``, as Python raises
for an unexpected keyword argument), naming the closest option; the Checkpointer's own
``__init__`` raises it too (:func:`keywords_checked`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

from .errors import ConfigError, UnknownOptionError

P = ParamSpec("P")
R = TypeVar("R")


def checkpointer_options() -> frozenset[str]:
    """The keyword options of ``Checkpointer`` an adapter passes on (``dirpath`` aside, and
    ``read_only``: an adapter's Checkpointer trains and saves)."""
    from .checkpointer import Checkpointer

    return frozenset(inspect.signature(Checkpointer).parameters) - {"dirpath", "read_only"}


def keywords_checked(init: Callable[P, R]) -> Callable[P, R]:
    """Decorate an ``__init__`` so that a keyword it does not take is an
    :class:`UnknownOptionError` naming the closest one (Python's own ``TypeError`` names none).
    Its signature, as ``inspect`` and type checkers see it, stays the same."""
    params = inspect.signature(init).parameters
    known = [
        k
        for k, p in params.items()
        if k != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    owner = init.__qualname__.split(".")[0]

    @functools.wraps(init)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise UnknownOptionError(
                f"{owner} got unknown option(s): {_hints(unknown, known)}. It takes "
                f"{', '.join(sorted(known))}."
            )
        return init(*args, **kwargs)

    return checked


# what Lightning's ModelCheckpoint and the Trainer's TrainingArguments call an option of ours
FRAMEWORK_NAMES = {
    "save_top_k": "keep_best here, with monitor",
    "save_total_limit": "keep_last here",
    "save_steps": "every_n_steps here",
    "every_n_train_steps": "every_n_steps here",
    "train_time_interval": "every_seconds here, in seconds",
    "save_last": "not needed here: the newest checkpoint is always kept",
}


def _hints(unknown: list[str], known: list[str]) -> str:
    """``name (did you mean closest?)`` for each unknown name, joined."""
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        if name in FRAMEWORK_NAMES:
            hints.append(f"{name} ({FRAMEWORK_NAMES[name]})")
        else:
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return ", ".join(hints)


def check_options(adapter: str, given: Iterable[str], own: Iterable[str]) -> None:
    """Raise :class:`UnknownOptionError` if ``given`` holds a name that is neither one of the
    adapter's ``own`` options nor a Checkpointer option."""
    known = checkpointer_options()
    own = list(own)
    if "read_only" in given and "read_only" not in own:
        raise ConfigError(
            f"{adapter} saves as it trains: read_only is an option of a Checkpointer that only "
            "restores (an evaluation job: Checkpointer(dirpath, read_only=True).restore(state))"
        )
    unknown = sorted(set(given) - known - set(own))
    if not unknown:
        return
    raise UnknownOptionError(
        f"{adapter} got unknown option(s): {_hints(unknown, [*own, *known])}. It takes "
        f"{', '.join(own)} and "
        f"the Checkpointer options: {', '.join(sorted(known - set(own)))}."
    )


def with_section(
    dirpath: str | None, options: dict[str, Any], section: dict[str, Any] | None
) -> tuple[str | None, dict[str, Any]]:
    """A callback's own ``dirpath`` and options, completed by the DeepSpeed section's where not
    given: the callback's arguments win over the section."""
    if not section:
        return dirpath, options
    merged = dict(options)
    for k, v in section.items():
        if k != "dirpath" and merged.get(k) is None:
            merged[k] = v
    return dirpath or section.get("dirpath"), merged
