"""A signal no ``step()`` acted on (it came after the last one, or, with several ranks, the run
ended before the next decision step): how :func:`.closing.close` ends the process for it. With
``exit_on_preemption`` and the default action behind the watcher, the process exits with the
preemption code (75) rather than die of the signal; not where the program is ending by its own
``sys.exit`` with a failure code, or from a thread other than the main one. With a second
Checkpointer in the process, the signal is passed on from watcher to watcher: the close that
passes it on to another watcher defers its code to that one's close.

Thread contract: called from ``close()``'s release (the main thread decides the exit).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from .preemption import exiting
from .preemption.signals import PreemptionWatcher, _unwrap

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .preemption import PreemptionRequest

# (pid, code): a close passed an unanswered signal on to another Checkpointer's watcher rather
# than exit with code; that one's close exits with it (exit_code_for)
_deferred_exit: tuple[int, int] | None = None


def exit_code_for(
    ck: Checkpointer, unanswered: PreemptionRequest | None, users: SystemExit | None
) -> int | None:
    """The code to exit with for ``unanswered``, a signal that came after the last step()
    that could act on it, when passing it on would end the process by the signal (no handler
    of the user's was there before ours) and ``exit_on_preemption`` is on: the preemption code
    (75), as a step() acting on it would have exited; None to pass it on (or when another
    path answers it: another Checkpointer's exit, a failed emergency save, an exception, the
    program's own ``sys.exit`` with a failure code; or from a thread other than the main one).
    A code deferred to another Checkpointer's watcher is used by that one's close."""
    w = ck.watcher
    if unanswered is None or unanswered.signum is None or w is None:
        return None
    if w.answered_elsewhere or ck._emergency.failed is not None or ck.failed_with:
        return None
    if users is not None:  # (:func:`users_exit`, which the caller read)
        return None
    if threading.current_thread() is not threading.main_thread():
        return None  # (a SystemExit would end this thread only; the signal ends the process)
    global _deferred_exit
    deferred = _deferred_exit[1] if _deferred_exit and _deferred_exit[0] == os.getpid() else None
    code = int(ck.config.preemption_exit_code) if ck.config.exit_on_preemption else deferred
    if w.passing_on_ends_the_process(unanswered.signum):
        _deferred_exit = None
        return code
    # passed on to another Checkpointer's watcher (a second one in this process): its close
    # exits with this code, also with its own exit_on_preemption=False
    _deferred_exit = (
        (os.getpid(), code) if code is not None and _to_a_watcher(w, unanswered) else None
    )
    return None


def _to_a_watcher(w: PreemptionWatcher, request: PreemptionRequest) -> bool:
    """Whether ``request``'s signal, passed on by ``w`` at its close, reaches another watcher:
    one installed after ``w`` whose handler is current, or the one ``w`` replaced."""
    assert request.signum is not None
    h = signal.getsignal(request.signum)
    if h is w._handler:
        h = _unwrap(request.signum, w._previous.get(request.signum))
    return isinstance(getattr(h, "__self__", None), PreemptionWatcher)


def users_exit() -> SystemExit | None:
    """The program's own ``sys.exit`` with a failure code (not 0 or None, not this library's
    preemption exit) that this close runs inside, at a with block's end or in a ``finally``."""
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit) and exc.code not in (0, None) and exiting.code() is None:
        return exc
    return None
