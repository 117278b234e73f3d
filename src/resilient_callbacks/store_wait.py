"""A line on stderr when a remote store's listing is not done after a few seconds: a hook the
CLI sets. A store that is down (a wrong endpoint, a closed port) makes its client retry for
seconds (botocore: about 10) before the error, and ``resilient-ckpt ls --remote``, ``verify
URL``, ``push`` and ``pull`` printed nothing meanwhile. The line does not tell that case from a
store that answers, page by page, a listing of many objects: it says both. A no-op unless a caller set a hook; per
context (a thread started with :func:`carried` has its starter's), so a training process,
which sets none, never calls one."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar

#: seconds without an answer before the hook is called
AFTER_S = 2.0

_HOOK: ContextVar[Callable[[str, float], None] | None] = ContextVar("store_wait", default=None)


@contextlib.contextmanager
def said_by(hook: Callable[[str, float], None]) -> Iterator[None]:
    """Within this block (in this context), :func:`waiting` calls ``hook(what, seconds)``."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def carried(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` to run in another thread with the hook set here (``stall.run``'s reader)."""
    hook = _HOOK.get()
    if hook is None:
        return fn

    def run() -> None:
        with said_by(hook):
            fn()

    return run


@contextlib.contextmanager
def waiting(what: str, quiet: bool = False) -> Iterator[None]:
    """The block waits for the store (``what``: a few words on it, e.g. "listing URL"): the
    hook, if any, is called once if it has not ended after :data:`AFTER_S` seconds (never
    when ``quiet``)."""
    hook = _HOOK.get()
    if hook is None or quiet:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        if not done.wait(AFTER_S):
            hook(what, AFTER_S)

    threading.Thread(target=watch, name="rc-store-wait", daemon=True).start()
    try:
        yield
    finally:
        done.set()
