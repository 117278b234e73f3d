"""Deleting checkpoints without making a save wait for the filesystem to free their space.

Retention removes a checkpoint in two steps (:func:`~.commit.remove_checkpoint`): a rename to a
hidden ``.trash-*`` name, which is atomic and instant (the checkpoint stops being one at once:
no listing, restore or retention sees it again), then deleting its files. Deleting is not
instant: unlinking a 1.5 GB file took 1.0 s on the development machine's disk and 0.63 s on a
GPU node's (profiled inside a save, docs/performance.md), and it ran inside the background
persist, so the next save could wait for its slot on it.

:class:`TrashBin` takes the second step off that path: one daemon thread deletes the trashed
directories in order. Nothing about the checkpoints depends on when it finishes; the disk space
comes back when it does. ``close()`` waits for it (with its timeout), so a run that ends leaves
no hidden copies behind; a crash mid-delete leaves a ``.trash-*`` directory that the next
writer's sweep removes.

Which ranks call what: the coordinator (rank 0), which alone applies retention.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time

log = logging.getLogger("resilient_callbacks")


class TrashBin:
    """Deletes trashed checkpoint directories in a background thread, started at the first
    :meth:`put`."""

    def __init__(self) -> None:
        self._q: queue.Queue[str | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self.seconds = 0.0  # spent deleting, in all
        self._abandoned = False

    def put(self, trash: str) -> None:
        """Delete the directory ``trash`` (already renamed out of sight) in the background."""
        with self._cond:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rc-trash", daemon=True)
                self._thread.start()
        self._q.put(trash)

    def _run(self) -> None:
        while True:
            trash = self._q.get()
            if trash is None:
                return
            t0 = time.perf_counter()
            try:
                shutil.rmtree(trash, ignore_errors=True)
                if os.path.exists(trash):
                    log.warning(
                        "retention: could not delete %s completely; the next writer's sweep "
                        "removes it",
                        trash,
                    )
            finally:
                with self._cond:
                    self.seconds += time.perf_counter() - t0
                    self._pending -= 1
                    self._cond.notify_all()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every trashed directory is deleted; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                if self._abandoned:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def abandon(self) -> None:
        """From now on :meth:`wait` does not wait (a preempted process exits without waiting
        for disk space to come back; deleting goes on until it exits)."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def stop(self) -> None:
        """End the thread once what was put is deleted (call after :meth:`wait`)."""
        with self._cond:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(None)
