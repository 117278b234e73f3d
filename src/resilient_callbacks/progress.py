"""Progress of long transfers (uploads, downloads, waiting for them): a bar on a terminal, a log
line every few seconds otherwise (batch jobs' logs stay readable)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fsspec.callbacks import Callback

from . import progress_lines

log = logging.getLogger("resilient_callbacks")

#: the slowest link a transfer is still taken as moving on: a store that counts bytes only per
#: part (s3fs: a file under 100 MiB when it ends, a larger one per 50 MiB part, 10 parts at
#: once) moves no counted byte for as long as the bytes in flight take at this rate, and is
#: not stalled meanwhile (:meth:`Progress.allowance_s`); 32 KiB/s, a 256 kbit/s link
SLOWEST_LINK_BPS = 32 * 1024

#: the longest a put may move no counted byte and still be taken as moving, whatever its bytes
#: in flight: a store that hangs without failing a request holds ``close()``, a node's upload
#: wait and the next writer's hand-over wait at most this long (or the outage limit, if
#: longer). 1 h: s3fs's default 10 requests of 50 MiB parts (500 MiB) take it at 146 KB/s, of
#: files just under 100 MiB (1000 MiB) at 291 KB/s; a slower link uploads no real checkpoint
#: in hours, and an upload given up on stays local for the next run
MAX_ALLOWANCE_S = 3600.0


#: how often a transfer without a bar says how far it is (a line: the log, or the CLI's stderr)
LOG_EVERY_S = 10.0


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class Progress:
    """Thread-safe byte counter with a display. ``bar=None`` shows a bar only when stderr is a
    terminal and tqdm is installed."""

    def __init__(
        self, total: int, desc: str, *, bar: bool | None = None, log_every_s: float | None = None
    ) -> None:
        self.total = total
        self.desc = desc
        self.done = 0
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._last_log = self._t0
        self.last_update = self._t0  # when the last byte moved (a stalled transfer: long ago)
        self.unit = 0  # the most bytes one count has carried (a store counting per part)
        self.in_flight = 0  # the most bytes the put under way may move before it counts one
        self._putting = False  # a put under way (:meth:`putting`): the allowance holds
        self._log_every = LOG_EVERY_S if log_every_s is None else log_every_s
        self._say = progress_lines.say()
        self._bar: Any = None
        if bar is None:
            bar = sys.stderr.isatty()
        if bar:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(
                    total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024
                )
            except ImportError:
                self._bar = None

    def update(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self.done += n
            self.unit = max(self.unit, n)
            self.last_update = time.monotonic()
            if self._bar is not None:
                self._bar.update(n)
                return
            now = time.monotonic()
            if now - self._last_log >= self._log_every:
                self._last_log = now
                rate = self.done / max(now - self._t0, 1e-9)
                line = f"{self.desc}: {_mb(self.done)} of {_mb(self.total)} ({rate / 1e6:.0f} MB/s)"
                if self._say is not None:
                    self._say(line)
                else:
                    log.info("%s", line)

    def expect(self, n: int) -> None:
        """``n`` more bytes to move than the total said (the blobs an upload puts)."""
        with self._lock:
            self.total += n
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()

    def allowance_s(self) -> float:
        """Seconds this transfer may move no counted byte and still be moving: while a put is
        under way (:meth:`putting`), the bytes one count may carry (its :attr:`in_flight`, or
        the most one count has carried) at :data:`SLOWEST_LINK_BPS`, at most
        :data:`MAX_ALLOWANCE_S`; 0 otherwise (the steps after a put, its settle and commit,
        have no bytes in flight). A stall is judged after the longer of this and the outage
        limit."""
        with self._lock:
            if not self._putting:
                return 0.0
            return min(MAX_ALLOWANCE_S, max(self.unit, self.in_flight) / SLOWEST_LINK_BPS)

    @contextlib.contextmanager
    def putting(self, in_flight: int = 0) -> Iterator[None]:
        """A put under way, which may move ``in_flight`` bytes before its client counts one
        (:func:`.remote_put.in_flight`); the allowance ends with it, however it ends."""
        with self._lock:
            self.in_flight, self._putting = in_flight, True
        try:
            yield
        finally:
            with self._lock:
                self.in_flight, self._putting = 0, False

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def callback(self) -> Callback:
        """An fsspec callback for one file's ``put_file``/``get_file``: counts its bytes."""
        return _Forward(self)

    def multi_callback(self) -> Callback:
        """An fsspec callback for a multi-file ``put``/``get``: the bytes of each file's
        transfer are counted (the per-file completions the parent sees are not bytes)."""
        return files_callback(self)


def files_callback(progress: Progress | None, check: Callable[[], None] | None = None) -> Callback:
    """An fsspec callback for a multi-file ``put``/``get``: each file's bytes counted in
    ``progress`` (if any); ``check()`` called as each file's transfer begins and at each count
    of its bytes (it may run in fsspec's event loop; it stops the transfer by raising)."""
    return _Forward(progress, count=False, check=check)


class _Forward(Callback):
    """The parent (``count=False``: its counts are files done, not bytes) or a file's own
    callback (:meth:`branched`), which counts bytes and calls ``check``."""

    def __init__(
        self,
        progress: Progress | None,
        count: bool = True,
        check: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._progress = progress
        self._count = count
        self._check = check
        self._seen = 0

    def relative_update(self, inc: int = 1) -> None:
        if self._count:
            if self._progress is not None:
                self._progress.update(inc)
            if self._check is not None:
                self._check()

    def absolute_update(self, value: int) -> None:
        inc, self._seen = value - self._seen, value
        self.relative_update(inc)

    def set_size(self, size: int) -> None:
        pass

    def branched(self, path_1: Any, path_2: Any, **kwargs: Any) -> Callback:
        if self._check is not None:
            self._check()
        return _Forward(self._progress, check=self._check)
