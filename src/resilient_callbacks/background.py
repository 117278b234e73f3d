"""Persisting checkpoints in the background, bounded, with no error ever lost.

A single worker thread runs persist jobs (write, checksum, commit, retention) in submission
order, so commits keep their order and, with several ranks, every rank issues its background
collectives in the same order. At most ``max_in_flight`` jobs are pending; the caller decides
what to do when that many are (wait or skip). A job's exception is stored and re-raised by the
next :meth:`raise_error` (called on the next save and on close). The thread is a daemon so a
stuck filesystem cannot hang interpreter exit, and the Checkpointer flushes it at exit.

:meth:`abandon` (``close(timeout)`` ran out): queued jobs are dropped, the running one sees
:attr:`abandoned` before it commits, and only jobs submitted with ``always=True`` (releasing
the directory lock) still run, after it.

Which ranks call what: every rank has its own persister and submits the same jobs in the same
order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from .upload_thread import by_grace

Job = Callable[[], None]


class BackgroundPersister:
    def __init__(self, max_in_flight: int = 1, name: str = "rc-persist") -> None:
        self.max_in_flight = max_in_flight
        self._q: queue.Queue[tuple[Job, bool] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self.abandoned = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Normal priority on purpose: at the lowest priority (nice 19) a busy training loop
        # starved this thread, saves piled up and the loop then waited for them (measured by
        # benchmarks/bench_async.py: loop overhead 30%+ at nice 19, on par with DCP at nice 0).
        while True:
            item = self._q.get()
            if item is None:
                return
            job, always = item
            try:
                if always or not self.abandoned:
                    job()
            except BaseException as e:  # kept for the training thread; first error wins
                with self._cond:
                    if self._error is None:
                        self._error = e
            finally:
                del item, job  # (not kept while waiting: a job holds its Checkpointer)
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    @property
    def busy(self) -> bool:
        return self.pending >= self.max_in_flight

    def submit(self, job: Job, always: bool = False) -> None:
        with self._cond:
            self._pending += 1
        self._q.put((job, always))

    def abandon(self) -> None:
        """Drop the queued jobs; the running one commits nothing (see the module docstring)."""
        self.abandoned = True

    def wait_for_slot(self) -> float:
        """Block until fewer than ``max_in_flight`` jobs are pending; return seconds waited."""
        with self._cond:
            if self._pending < self.max_in_flight:
                return 0.0
            t0 = time.perf_counter()
            while self._pending >= self.max_in_flight:
                self._cond.wait()
            return time.perf_counter() - t0

    def wait_all(
        self, timeout: float | None = None, grace_left: Callable[[], float | None] | None = None
    ) -> bool:
        """Block until no job is pending; False if ``timeout`` passed first, or past
        ``grace_left()`` (a preemption's time to the hard kill, less a margin to exit: one
        whose signal arrives during the wait too)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                until = by_grace(deadline, grace_left)
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if grace_left is not None:  # (a signal may come: look again each second)
                    left = 1.0 if left is None else min(1.0, left)
                self._cond.wait(left)
        return True

    def take_error(self) -> BaseException | None:
        """The stored error, if any, no longer stored (the caller raises it)."""
        with self._cond:
            err, self._error = self._error, None
        return err

    def raise_error(self) -> None:
        err = self.take_error()
        if err is not None:
            raise err

    def stop(self, join_s: float = 5.0) -> None:
        self._q.put(None)
        if join_s > 0:
            self._thread.join(timeout=join_s)
