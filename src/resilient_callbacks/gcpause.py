"""Python's cyclic garbage collector paused while a restore builds a state of many objects.

One job: :func:`paused`. A restore creates objects by the tens of thousands that all stay alive
until it returns (the parsed headers and structure, a tensor per entry, the optimizer's state
dicts). Each few hundred of them start a collection, and every tenth young one may become a full
one, which walks every object of the process (the user's model, the imported frameworks).
Measured on a state of 20,000 small tensors (``benchmarks/bench_fixed_cost.py``, CPU): about
0.45 s of a 1.1 s restore went to collections that freed next to nothing. Nothing a restore
makes depends on the collector (its own reference cycles are broken where they are made, and
:func:`.notices.warn_if_still_mapped` collects before it warns), so it is paused for the load
and restored after; what the restore left as cyclic garbage is collected at the next
collection, as before.

Thread contract: any thread. The collector's switch is process-wide, so the pauses of several
threads nest: it is disabled while any pause lasts, and enabled again when the last one ends,
if it was enabled when the first began (a program that runs with it disabled keeps it so).
A process forked while a pause lasts (another thread starting DataLoader workers) gets the
collector as it was before the pause: it runs none of the pauses, and would otherwise keep it
disabled for its whole life. Code the restore runs (a ``load_state_dict``) that calls
``gc.disable()`` to keep the collector off has that undone when the pause ends: call it after
the restore.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # pauses under way, in every thread
_was_enabled = False  # the collector's state as the first of them began


def _after_fork_in_child() -> None:
    """The forked child runs none of its parent's pauses: the collector as before them, and a
    fresh lock (another thread of the parent may have held it at the fork)."""
    global _lock, _depth
    _lock = threading.Lock()
    if _depth:
        _depth = 0
        if _was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):  # (not on Windows, which does not fork)
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector disabled inside the ``with`` block (see the module's docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
