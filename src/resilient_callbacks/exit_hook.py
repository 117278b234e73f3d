"""The end of a Checkpointer that its script did not close: the ``atexit`` hook that closes one
still open at the interpreter's exit (pending saves commit, the history records how the process
ended) and what ``__del__`` releases of one dropped unclosed. :func:`.closing.close` does the
close itself, and reads :data:`at_exit_closing` (a SystemExit raised in an atexit hook is
ignored: a close from this hook exits with ``os._exit``).

Which ranks call what: every rank registers its own hook (:func:`at_exit`, at construction) and
runs it at its own exit, as each rank's ``close()`` would; :func:`dropped` touches this rank's
threads, handlers and lock only (no collective).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from .closing_steps import failing

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")

at_exit_closing = False  # flush_at_exit is closing a Checkpointer (at interpreter exit)


def at_exit(ck: Checkpointer) -> Callable[[], None] | None:
    """Register :func:`flush_at_exit` for ``ck`` (a writer): saves in flight at exit commit,
    telemetry is flushed, and the history gets how the process ended (``end``, or ``failed``),
    synchronous saves or not: without it a finished run's re-run counted as a failure. The
    hook, for :func:`.closing._release` to unregister (one per Checkpointer otherwise stayed registered
    for the life of the process: one per trial of a sweep)."""
    if ck.config.read_only:
        return None
    hook = functools.partial(flush_at_exit, weakref.ref(ck))
    atexit.register(hook)
    return hook


def flush_at_exit(ref: weakref.ReferenceType[Checkpointer]) -> None:
    """``atexit`` hook: close a Checkpointer still open at exit, so pending saves commit. An
    exception no one caught ended the program (the interpreter sets ``sys.last_value`` as it
    prints it): the history records a failure with its name, not a clean end. A close() that
    a Ctrl-C interrupted (the program went on to its end) is finished too."""
    global at_exit_closing
    ck = ref()
    if ck is not None and not ck._released:
        uncaught = getattr(sys, "last_value", None)
        if isinstance(uncaught, SystemExit) or not isinstance(uncaught, BaseException):
            uncaught = None
        if uncaught is not None and not ck.failed_with:
            failing(ck, uncaught)
        at_exit_closing = True
        try:
            ck.close()
        except Exception as e:  # at exit there is no caller left to raise to: say it loudly
            # (the exit status stays as it was: call close(), or use `with`, to fail the job)
            log.error("closing %s at exit failed: %s", ck.dirpath, e)
        finally:
            at_exit_closing = False


def dropped(ck: Checkpointer) -> None:
    """``__del__``, best effort: a Checkpointer dropped unclosed (a sweep's trial that raised
    outside a ``with`` block, its close never called) gives back its directory lock, ends its
    background-save, deletion and notice-polling threads and its signal handlers: restored
    from the main thread; from another (its last save ended there), left to forward to the
    ones before them, as after an ``uninstall`` out of order (one of each otherwise stayed per
    such trial, its watcher taking every SIGTERM for a save no one would make). Its saves ran
    before: a queued save holds its Checkpointer. Its upload threads are told to stop after their
    current attempt, before the lock goes (they ran on for the life of the process, uploading
    from the directory the next writer opened, and retention there restarted its deletion
    thread): what was not uploaded, the next writer on the directory uploads. Nothing (no I/O,
    no thread or handler touched) for one whose close() finished its release."""
    if getattr(ck, "_released", False):
        return
    for name in ("sync", "uploader", "committer"):  # (a NodeDirectory: the last two)
        with contextlib.suppress(Exception):
            thread = getattr(ck._dir, name, None)
            if thread is not None:
                thread.stop(join_s=0.0)
    with contextlib.suppress(Exception):
        ck._dir.lock.release()
    with contextlib.suppress(Exception):
        persister = ck._saver.persister
        if persister is not None:
            persister.stop(join_s=0.0)
    with contextlib.suppress(Exception):
        ck._dir.trash.stop(join=False)  # (once what it was given is deleted)
    with contextlib.suppress(Exception):
        if ck._poller is not None:  # (its cloud notice poller polled on, for no one)
            ck._poller.stop(join=False)
    with contextlib.suppress(Exception):
        if ck.watcher is not None:
            ck.watcher.uninstall(quiet=True)
