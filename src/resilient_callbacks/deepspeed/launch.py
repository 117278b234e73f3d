"""Checkpointing with no code change: run a script with ``deepspeed.initialize`` patched.

::

    python -m resilient_callbacks.deepspeed.run train.py --deepspeed_config ds.json ...
    deepspeed --module resilient_callbacks.deepspeed.run train.py --deepspeed_config ds.json

In that process ``deepspeed.initialize`` behaves as :func:`resilient_callbacks.deepspeed.initialize`:
a config with a ``"resilient_checkpoint"`` section gets an engine that restores the newest valid
checkpoint and saves on schedule (like ``opentelemetry-instrument`` for tracing). A config
without the section gets plain DeepSpeed.

A trainer that calls ``deepspeed.initialize`` itself (the Hugging Face ``Trainer`` through
accelerate, Lightning's ``Trainer`` with ``DeepSpeedStrategy``) keeps its loop's own state (step,
schedule, data position) outside the engine, so the engine's checkpoint alone would not resume
it: there the section is its ``ResilientCheckpoint`` callback's (the call goes to DeepSpeed as
without the launcher, and the callback reads the section), and without that callback the call is
refused with a :class:`~resilient_callbacks.errors.ConfigError` that names it.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

_ORIGINAL: list[Any] = []  # deepspeed.initialize before patch(), once patched
_HANDLES: list[Any] = []  # the checkpointed engines the patched initialize made


def launched() -> bool:
    """Whether this process runs under the launcher (``deepspeed.initialize`` patched)."""
    return bool(_ORIGINAL)


def original_initialize() -> Any:
    """DeepSpeed's own ``initialize`` if :func:`patch` replaced it, else None."""
    return _ORIGINAL[0] if _ORIGINAL else None


def patch() -> None:
    """Make ``deepspeed.initialize`` (and ``from deepspeed import initialize`` after this call)
    resilient_callbacks' ``initialize``. Idempotent."""
    import deepspeed

    from .attach import initialize

    if _ORIGINAL:
        return

    def resilient_initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
        trainer = _calling_trainer()
        if trainer is not None:
            return _trainer_initialize(trainer, original, *args, **kwargs)
        return initialize(*args, **kwargs)  # (its handle registers itself: register())

    resilient_initialize.__doc__ = initialize.__doc__
    original = deepspeed.initialize
    _ORIGINAL.append(original)
    deepspeed.initialize = resilient_initialize


# trainers whose loop state lives outside the engine: (module prefix, name, the callback to use)
_TRAINERS = (
    ("transformers.trainer", "the Hugging Face Trainer", "resilient_callbacks.transformers"),
    ("lightning.pytorch", "Lightning's Trainer", "resilient_callbacks.lightning"),
    ("pytorch_lightning", "Lightning's Trainer", "resilient_callbacks.lightning"),
)


def _calling_trainer() -> tuple[str, str] | None:
    """``(name, callback module)`` of the trainer on the caller's stack, if one calls."""
    frame: FrameType | None = sys._getframe(2)  # the caller of deepspeed.initialize
    for _ in range(40):
        if frame is None:
            return None
        module = str(frame.f_globals.get("__name__", ""))
        for prefix, name, callback in _TRAINERS:
            if module == prefix or module.startswith(prefix + "."):
                return name, callback
        frame = frame.f_back
    return None


def _trainer_initialize(
    trainer: tuple[str, str], original: Any, *args: Any, **kwargs: Any
) -> tuple[Any, Any, Any, Any]:
    """A trainer's own ``deepspeed.initialize`` call: DeepSpeed's, the section left to the
    trainer's callback (the guard takes it out for the callback that claimed it); refused when
    the config has the section and no callback of ours claimed it."""
    import resilient_callbacks_ds_guard as guard

    from ..errors import ConfigError

    found = guard.has_section(
        args[0] if args else kwargs.get("args"), kwargs.get("config"), kwargs.get("config_params")
    )
    if found and not guard.claimed():
        name, callback = trainer
        raise ConfigError(
            f'this DeepSpeed config has a "{guard.SECTION}" section and {name} calls '
            "deepspeed.initialize: the launcher would checkpoint the engine alone, and a re-run "
            "would train again from the trainer's step 0 (its step, schedule and data position "
            f"are not the engine's). Add {callback}.ResilientCheckpoint() to the trainer's "
            "callbacks: it reads this section and resumes the whole run (the launcher is then "
            "not needed; it is for scripts that call deepspeed.initialize themselves)."
        )
    return original(*args, **kwargs)


def register(handle: Any) -> None:
    """Under the launcher: ``handle`` (a ``DeepSpeedCheckpoint`` that restored, made by the
    patched ``deepspeed.initialize``, ``rcds.initialize`` or ``rcds.attach``) is saved and
    closed when the script ends (``run.finish``), or aborted when it raises
    (``run.abort_all``). Only the patched ``initialize``'s engines were: one the script made
    with ``rcds.initialize`` or ``attach`` under the launcher had no ``save_on_exception``
    save, no save of its last step at the end, and no warning about either."""
    if launched() and all(h is not handle for h in _HANDLES):
        _HANDLES.append(handle)


def handles() -> list[Any]:
    """The ``DeepSpeedCheckpoint`` of every engine checkpointed under the launcher
    (:func:`register`)."""
    return list(_HANDLES)


def unpatch() -> None:
    import deepspeed

    if _ORIGINAL:
        deepspeed.initialize = _ORIGINAL.pop()
