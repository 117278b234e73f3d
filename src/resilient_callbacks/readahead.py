"""Reading a file sequentially at the disk's speed, not at the speed of one page fault at a time.

A verified restore reads every byte of a checkpoint once, front to back (hashing it). Left to
itself the kernel reads ahead only a small window (128 KiB by default) of a ``read()`` loop or a
memory mapping, and a mapping is faulted in by the one thread that hashes it, so a cold
checkpoint is read with little I/O in flight.

- :class:`Readahead` (a file read with ``read()``) asks the kernel
  (``posix_fadvise(WILLNEED)``) to read up to ``ahead`` bytes beyond the reader's position and
  keeps that window sliding as the reader advances. The first window is requested from a
  short-lived thread, so reading starts at once.
- :class:`MappedPrefetch` (a memory mapping) has helper threads fault the mapping in ahead of
  the hashing thread, so page faults and the reads behind them run in parallel with the hash.

Both stay a bounded distance ahead, so a file larger than memory does not evict its own
beginning before it is read. Where ``posix_fadvise`` does not exist (macOS, Windows) or the
filesystem refuses it, :class:`Readahead` does nothing and reading is merely slower.

Measured by ``benchmarks/bench_async.py`` (restore from a cold page cache).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import Any

AHEAD = 1 << 30  # bytes requested beyond the reader's position
STEP = 64 << 20  # the window slides in steps of this many bytes

_advise = getattr(os, "posix_fadvise", None)


def _willneed(fd: int, offset: int, length: int) -> None:
    if _advise is None or length <= 0:
        return
    with contextlib.suppress(OSError):  # a filesystem without readahead advice: reads still work
        _advise(fd, offset, length, os.POSIX_FADV_WILLNEED)


class Readahead:
    """Keep the kernel reading ``ahead`` bytes beyond a sequential reader of ``fd``.

    Call :meth:`advance` with the reader's position as it goes; use it as a context manager
    (or call :meth:`close`) inside the file descriptor's lifetime."""

    def __init__(self, fd: int, size: int, *, ahead: int = AHEAD) -> None:
        self._fd, self._size, self._ahead = fd, size, ahead
        self._requested = min(size, ahead)
        self._thread: threading.Thread | None = None
        if _advise is None or size <= 0:
            return
        with contextlib.suppress(OSError):  # SEQUENTIAL also widens the kernel's own window
            _advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._thread = threading.Thread(
            target=_willneed, args=(fd, 0, self._requested), name="rc-readahead", daemon=True
        )
        self._thread.start()

    def advance(self, pos: int) -> None:
        """The reader has consumed the file up to ``pos``: extend the window."""
        if self._thread is None:
            return
        want = min(self._size, pos + self._ahead)
        if want - self._requested >= STEP or (want == self._size > self._requested):
            _willneed(self._fd, self._requested, want - self._requested)
            self._requested = want

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Readahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MappedPrefetch:
    """Fault ``mapping`` in ahead of a thread reading it front to back.

    ``workers`` threads each touch one byte per page of successive ``STEP``-byte windows (the
    fault also makes the kernel read ahead), never more than ``ahead`` bytes beyond the position
    passed to :meth:`advance`. Touching releases the GIL (a torch reduction), so the faults of
    the helpers and the reader's own work overlap. Use it as a context manager (or call
    :meth:`close`) inside the mapping's lifetime."""

    def __init__(self, mapping: Any, size: int, *, workers: int = 2, ahead: int = 512 << 20):
        self._size, self._ahead = size, ahead
        self._pos = 0
        self._next = 0
        self._stop = False
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._bytes: Any = None
        if size < 2 * STEP:
            return  # small: the reader's own faults are enough
        import torch  # (here: checksums alone, Readahead, need no torch)

        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8, count=size)
        for i in range(workers):
            t = threading.Thread(target=self._run, name=f"rc-prefetch-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._next > self._pos + self._ahead:
                    self._cond.wait(0.05)
                if self._stop or self._next >= self._size:
                    return
                lo = self._next
                self._next += STEP
            try:
                self._bytes[lo : min(lo + STEP, self._size) : mmap.PAGESIZE].sum()
            except Exception:  # prefetching is only an optimisation; the reader faults itself
                return

    def advance(self, pos: int) -> None:
        with self._cond:
            self._pos = pos
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []
        self._bytes = None

    def __enter__(self) -> MappedPrefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
