"""Whether this process is being preempted, for code that ends without a step loop of its own
to act on a request (the DCP writer's ``close()``): the requests pending on the watchers
installed in this process (a ``PreemptionWatcher`` of the user's, a ``Checkpointer``'s) and on
one it was given.

Thread contract: any thread may ask; the answer reads the watchers' request lists, which the
signal handlers append to atomically.
"""

from __future__ import annotations

import os

from .request import PreemptionRequest
from .signals import PreemptionWatcher, _installed


def _watchers(watcher: PreemptionWatcher | None) -> set[PreemptionWatcher]:
    """``watcher`` and every watcher installed in this process (not those of the process this
    one was forked from)."""
    pid = os.getpid()
    watchers = {w for w in list(_installed) if w._active and w._pid == pid}
    if watcher is not None:
        watchers.add(watcher)
    return watchers


def requests(watcher: PreemptionWatcher | None = None) -> list[PreemptionRequest]:
    """The first pending request of ``watcher`` and of every watcher installed in this
    process (not those of the process this one was forked from)."""
    return [r for r in (w.request for w in _watchers(watcher)) if r is not None]


def remaining_grace_s(watcher: PreemptionWatcher | None = None) -> float | None:
    """Seconds left before the hard kill of the soonest request pending on ``watcher`` and on
    every watcher installed in this process (>= 0); None when none is pending or none says
    when its kill comes."""
    left = [s for s in (w.remaining_grace_s() for w in _watchers(watcher)) if s is not None]
    return min(left) if left else None
