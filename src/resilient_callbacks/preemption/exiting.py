"""A process exiting after its emergency save: further signals keep its exit code.

Once the emergency checkpoint is committed, the process closes its Checkpointer and exits with
the preemption code (75), which tells the scheduler "restart me". Its exit takes a second or
more (the framework's teardown, ``atexit`` hooks, the interpreter's and torch's finalization),
and a second signal can come meanwhile: torchrun passing on a signal sent to its whole process
group, a rank signalled a moment after the others. With the default action restored it killed
the process by the signal (exit 143 in a shell): the scheduler saw a crash.

So, from :func:`mark` until the process is gone, a watched signal whose action would end the
process (the default one, or SIGINT's ``KeyboardInterrupt``) instead:

- while Python code runs (the exception's way out, ``atexit`` hooks): ends the process at once
  with the code (``os._exit``), from the watcher's handler, which stays installed for it;
- from this module's ``atexit`` hook on (registered at import, so it runs after those
  registered later; the interpreter's finalization resets Python-level handlers to the
  default action): is ignored; the scheduler's SIGKILL still ends a process stuck there.

A handler installed before the watcher (the user's) is restored and runs as before. A process
that catches the ``SystemExit`` and goes on is no longer exiting: it installs a watcher again
(:func:`clear`), or a signal comes while no ``SystemExit`` is being handled and the
interpreter is not shutting down (:func:`under_way`), which then gets the action it would have
had without the watcher (a ``KeyboardInterrupt`` in a notebook whose kernel lives on, not an
``os._exit`` of the kernel). A close between :func:`mark` and :func:`exit_with` that raises
(:func:`cleared_if_raised`) means no exit either: its error propagates, and the process is
as one that never saved for a preemption.

Thread contract: :func:`mark` runs in the training thread; the rest in the main thread (signal
handlers, ``uninstall``, ``atexit``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_exiting: tuple[int, int] | None = None  # (pid, exit code)
_raising = False  # marked, its SystemExit not raised yet (the close between them: exit_with)
# signal -> (the watcher's handler that stays while exiting, the handler it replaced)
_kept: dict[int, tuple[Any, Any]] = {}


def mark(code: int) -> None:
    """This process saved for a preemption and now exits with ``code``."""
    global _exiting, _raising
    _exiting = (os.getpid(), int(code))
    _raising = True
    _kept.clear()


def exit_with(code: int) -> NoReturn:
    """Raise the ``SystemExit(code)`` that :func:`mark` announced. Until it is raised (the
    close between them: the uploads, the lock's release) the process is on its way out too
    (:func:`under_way`): a second signal there died of it (143)."""
    global _raising
    try:
        raise SystemExit(code)
    finally:
        _raising = False  # (from here on the SystemExit being handled says so)


def clear() -> None:
    """A watcher is installed again: the process trains on (it caught the ``SystemExit``); the
    handlers kept for the exit give way to those they replaced."""
    global _exiting, _raising
    _raising = False
    if code() is not None:
        for signum, (ours, prev) in _kept.items():
            if signal.getsignal(signum) is ours:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(signum, signal.SIG_DFL if prev is None else prev)
    _exiting = None
    _kept.clear()


def cleared_if_raised(close: Callable[_P, _R]) -> Callable[_P, _R]:
    """``close`` (the Checkpointer's, run between :func:`mark` and :func:`exit_with`) raising an
    ``Exception`` means the process does not exit with the code: its error ends the process or
    a caller catches it and goes on (a notebook). It :func:`clear`s, so a later signal gets the
    action it had before the watcher, not ``os._exit`` with the code. (A ``SystemExit`` passes:
    that is the exit.)"""

    @functools.wraps(close)
    def closing(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return close(*args, **kwargs)
        except Exception:
            if _raising:  # (not another Checkpointer's exit, its SystemExit raised already)
                clear()
            raise

    return closing


def code() -> int | None:
    """The code this process exits with after its emergency save; None when not exiting (or
    in a process forked from it)."""
    return _exiting[1] if _exiting is not None and _exiting[0] == os.getpid() else None


def under_way() -> bool:
    """In a signal handler (main thread), while :func:`code` is set: whether the process is
    still on its way out, not trained on after a caller caught the ``SystemExit``: it is
    not raised yet (:func:`exit_with`), or one is being handled (a ``finally``, an ``except``, a ``__exit__`` it passes through, chained to
    an exception raised there), or the interpreter is shutting down (``threading``'s shutdown,
    ``atexit``, finalization)."""
    if getattr(threading, "_SHUTTING_DOWN", False) or sys.is_finalizing() or _raising:
        return True
    if not threading.main_thread().is_alive():
        return True
    exc, seen = sys.exc_info()[1], 0
    while exc is not None and seen < 100:
        if isinstance(exc, SystemExit):
            return True
        exc, seen = exc.__context__, seen + 1
    return False


def ends_the_process(handler: Any) -> bool:
    """Whether ``handler`` (a previous one) would end the process: the default action, or
    SIGINT's."""
    return handler is None or handler == signal.SIG_DFL or handler is signal.default_int_handler


def keep(signum: int, ours: Any, prev: Any) -> bool:
    """In ``uninstall``: whether the watcher's handler ``ours`` stays for ``signum`` since the
    process is exiting (``prev``, the one it replaced, would end the process)."""
    if code() is None or not ends_the_process(prev):
        return False
    _kept[signum] = (ours, prev)
    return True


def _ignore_while_finalizing() -> None:
    if code() is None:
        return
    for signum in _kept:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signum, signal.SIG_IGN)  # (SIG_IGN survives the finalization)


atexit.register(_ignore_while_finalizing)
