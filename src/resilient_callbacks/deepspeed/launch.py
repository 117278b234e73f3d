"""Checkpointing with no code change: run a script with ``deepspeed.initialize`` patched.

::

    python -m resilient_callbacks.deepspeed.run train.py --deepspeed_config ds.json ...
    deepspeed --module resilient_callbacks.deepspeed.run train.py --deepspeed_config ds.json

In that process ``deepspeed.initialize`` behaves as :func:`resilient_callbacks.deepspeed.initialize`:
a config with a ``"resilient_checkpoint"`` section gets an engine that restores the newest valid
checkpoint and saves on schedule (like ``opentelemetry-instrument`` for tracing). A config
without the section gets plain DeepSpeed.
"""

from __future__ import annotations

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
        out = initialize(*args, **kwargs)
        handle = getattr(out[0], "resilient_checkpoint", None)
        if handle is not None:
            _HANDLES.append(handle)
        return out

    resilient_initialize.__doc__ = initialize.__doc__
    _ORIGINAL.append(deepspeed.initialize)
    deepspeed.initialize = resilient_initialize


def handles() -> list[Any]:
    """The ``DeepSpeedCheckpoint`` of every engine the patched ``initialize`` made."""
    return list(_HANDLES)


def unpatch() -> None:
    import deepspeed

    if _ORIGINAL:
        deepspeed.initialize = _ORIGINAL.pop()
