"""Deleting checkpoints without making a save wait for the filesystem to free their space.

Retention removes a checkpoint in two steps (:func:`~.commit.remove_checkpoints`): a rename to a
hidden ``.trash-*`` name, which is atomic and instant (the checkpoint stops being one at once:
no listing, restore or retention sees it again) and made durable (the directory is fsynced:
a power loss cannot bring it back once its files go), then deleting its files. Deleting is not
instant: unlinking a 1.5 GB file took 1.0 s on the development machine's disk and 0.63 s on a
GPU node's (profiled inside a save, docs/performance.md), and it ran inside the background
persist, so the next save could wait for its slot on it.

:class:`TrashBin` takes the second step off that path: one background worker (the core's
:class:`~.background.BackgroundPersister`) deletes the trashed directories in order. Nothing
about the checkpoints depends on when it finishes; the disk space comes back when it does.
``close()`` waits for it (with its timeout), so a run that ends leaves no hidden copies behind;
a crash mid-delete leaves a ``.trash-*`` directory that the next writer's sweep removes.

Which ranks call what: the coordinator (rank 0), which alone applies retention.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import threading
from collections.abc import Callable

from .background import BackgroundPersister

log = logging.getLogger("resilient_callbacks")


class TrashBin:
    """Deletes trashed checkpoint directories in a background thread, started at the first
    :meth:`put`."""

    def __init__(self) -> None:
        self._worker: BackgroundPersister | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        self._deleting = 0  # directories put and not yet deleted (not the checks of then())
        self._stopped = False

    def put(self, trash: str) -> None:
        """Delete the directory ``trash`` (already renamed out of sight) in the background;
        after :meth:`stop` in the caller's thread (an upload thread's retention that outlived
        the close: a worker started then was never stopped). Submitted under the lock: a
        :meth:`stop` at the same time ends the worker after it, never before (the directory
        was never deleted)."""
        with self._lock:
            self._deleting += 1
            worker = self._worker
            if worker is None and not self._stopped:
                worker = self._worker = BackgroundPersister(max_in_flight=1 << 30, name="rc-trash")
            if worker is not None:
                worker.submit(lambda: self._delete(trash))
        if worker is None:
            self._delete(trash)

    def _delete(self, trash: str) -> None:
        try:
            _delete(trash)
        finally:
            with self._lock:
                self._deleting -= 1

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the directories put so far are deleted: in the worker, or at once
        when nothing is pending. An error of ``fn`` is logged, never raised."""
        with self._lock:  # (as put: never submitted after a stop() ended the worker)
            worker = self._worker
            if worker is not None and worker.pending and not self._abandoned:
                worker.submit(lambda: _quietly(fn))
                return
        _quietly(fn)

    @property
    def pending(self) -> int:
        """The trashed directories not yet deleted."""
        with self._lock:
            return self._deleting

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every trashed directory is deleted; False if ``timeout`` passed first,
        or at once after :meth:`abandon`."""
        if self._worker is None:
            return True
        if self._abandoned:
            return not self.pending
        return self._worker.wait_all(timeout)

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def abandon(self) -> None:
        """From now on :meth:`wait` does not wait (a preempted process exits without waiting
        for disk space to come back; deleting goes on until it exits)."""
        self._abandoned = True

    def stop(self, join: bool = True) -> None:
        """End the worker once what was put is deleted (call after :meth:`wait`); ``join``
        False: without waiting for it."""
        with self._lock:
            self._stopped = True
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop(join_s=0.0 if self._abandoned or not join else 5.0)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # (a check after the deletions: never the save's failure)
        log.warning("%s failed: %s", getattr(fn, "__qualname__", fn), e)


def _delete(trash: str) -> None:
    shutil.rmtree(trash, ignore_errors=True)
    if os.path.exists(trash):
        log.error(
            "retention: could not delete %s completely (a file in it that this process may not "
            "remove: its permissions, a read-only mount). It is no checkpoint any more (renamed "
            "out of sight); the next writer's sweep of the directory removes it, or delete it by "
            "hand: rm -r %s",
            trash,
            shlex.quote(trash),
        )
