"""Which checkpoint a check is about to read every checksum of: a hook the CLI sets to say so
on stderr (``ls``, ``verify``, ``inspect`` and ``gc`` read every byte; a checkpoint of hundreds
of GB takes minutes, which printed nothing until the end). A no-op unless a caller set one;
a hook is per context (thread), so the training process, which sets none, never calls one."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from .manifest import Manifest

_HOOK: ContextVar[Callable[[str, int], None] | None] = ContextVar("checking", default=None)


def reading(path: str, manifest: Manifest, every_checksum: bool) -> None:
    """The checkpoint at ``path`` is about to be checked: where ``every_checksum`` (not sizes
    alone), tell the hook (the path, the bytes of its files and of the blobs it names)."""
    hook = _HOOK.get()
    if hook is not None and every_checksum:
        hook(path, sum(f.size for f in manifest.files) + sum(b.size for b in manifest.blobs))


@contextlib.contextmanager
def said_by(hook: Callable[[str, int], None]) -> Iterator[None]:
    """Within this block (in this context), :func:`reading` calls ``hook``."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)
