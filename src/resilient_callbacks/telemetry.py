"""The collector of the checkpoint metrics (:class:`Telemetry`, the values of the names in
:mod:`.metrics`) and the threads that feed its sinks (:class:`Sink`).

Which ranks call what: every rank owns a :class:`Telemetry` (recording is a few dict writes under a
lock, so the training thread pays next to nothing); the sinks run on the coordinator only, unless
a sink asks for every rank (``per_rank``), each in its own daemon thread, so a slow or failing
sink never blocks or stops training: a failing one is retried with back-off, said when it fails
and when it is back, and switched off only when it keeps failing (:mod:`.sink_retry`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from .metrics import BY_NAME, METRICS, RUN_COUNTERS, Metric, flat_key
from .sink_retry import SinkHealth

log = logging.getLogger("resilient_callbacks")


class Sink(Protocol):
    """Where metrics go. ``start`` (once) and ``emit`` run in the sink's own thread (never the
    training thread); ``emit`` gets every metric's current value (``flat`` keys, see
    :func:`flat_key`; ``samples`` for sinks that keep labels), the events since the last call and
    the step, when something changed (at most every ``period_s``) and at close; ``close`` once
    at the end. ``per_rank``: run on every rank, not only on rank 0.

    A ``start`` or ``emit`` that raises is called again later (with back-off; ``start`` until it
    succeeds once), so both must be safe to repeat; ``events`` are given once: a sink that
    records them keeps those it could not send."""

    name: str
    per_rank: bool

    def start(self, telemetry: Telemetry) -> None: ...

    def emit(
        self,
        flat: Mapping[str, float],
        samples: Sequence[tuple[Metric, tuple[str, ...], float]],
        events: Sequence[Mapping[str, Any]],
        step: int,
    ) -> None: ...

    def close(self) -> None: ...


class Telemetry:
    """The current value of every metric of one Checkpointer, and the sinks fed from it."""

    def __init__(self, sinks: Iterable[Sink] = (), *, rank: int = 0, period_s: float = 5.0) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        # counters exist from the start, at 0: an alert on increase() sees the first event too.
        # Not the run's: a process that resumes a run knows them after restore() (0 before it
        # would read as a counter reset at every restart: increase() counting 1+2+...+N)
        self._values: dict[tuple[str, tuple[str, ...]], float] = {
            (m.name, ()): 0.0
            for m in METRICS
            if m.kind == "counter" and not m.labels and m.name not in RUN_COUNTERS
        }
        self._events: deque[dict[str, Any]] = deque(maxlen=1000)
        self._n_events = 0
        self.step = 0
        self._runners = [
            _Runner(s, self, period_s) for s in sinks if rank == 0 or getattr(s, "per_rank", False)
        ]
        for r in self._runners:
            r.start()

    @property
    def active(self) -> bool:
        """True when a sink is attached (on this rank)."""
        return bool(self._runners)

    # ------------------------------------------------------------------ recording (cheap)

    def set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        with self._lock:
            self._values[(name, labels)] = float(value)

    def inc(self, name: str, by: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        with self._lock:
            key = (name, labels)
            self._values[key] = self._values.get(key, 0.0) + by

    def get(self, name: str, labels: tuple[str, ...] = ()) -> float | None:
        with self._lock:
            return self._values.get((name, labels))

    def event(self, kind: str, **fields: Any) -> None:
        """A checkpoint event (a save, a restore, a fallback, a preemption) for sinks that
        record events (MLflow tags)."""
        rec = {"event": kind, "time": time.time(), **fields}
        with self._lock:
            self._events.append(rec)
            self._n_events += 1
        self.notify()

    def notify(self) -> None:
        """Tell the sinks there is something new (they send it from their own threads)."""
        for r in self._runners:
            r.wake()

    # ------------------------------------------------------------------ reading

    def samples(self) -> list[tuple[Metric, tuple[str, ...], float]]:
        with self._lock:
            items = list(self._values.items())
        return [(BY_NAME[n], labels, v) for (n, labels), v in sorted(items)]

    def values(self) -> dict[str, float]:
        """Every metric set so far, as ``{flat key: value}`` (labelled counters also summed
        under their plain name)."""
        out: dict[str, float] = {}
        for m, labels, v in self.samples():
            if labels:
                out[m.name] = out.get(m.name, 0.0) + v
            out[flat_key(m.name, labels)] = v
        return out

    def events_since(self, seen: int) -> tuple[list[dict[str, Any]], int]:
        with self._lock:
            n = self._n_events
            new = min(n - seen, len(self._events))
            return (list(self._events)[len(self._events) - new :] if new > 0 else []), n

    # ------------------------------------------------------------------ the end

    def close(self, timeout: float = 10.0, deadline: float | None = None) -> None:
        """Send what is left and stop. The sinks finish concurrently, each in its own thread:
        each gets ``timeout`` seconds (or its own ``close_timeout_s``) from now, none past
        ``deadline`` (a ``time.monotonic()`` time: a preempted process's grace period), so the
        wait is the longest of them, not their sum; the sinks that did not finish are named."""
        runners, self._runners = self._runners, []
        for r in runners:
            r.stop()
        t0 = time.monotonic()
        late: list[str] = []
        for r in runners:
            wait = float(getattr(r.sink, "close_timeout_s", timeout))
            until = t0 + wait if deadline is None else min(t0 + wait, deadline)
            r.join(max(0.0, until - time.monotonic()))
            if r.is_alive():
                late.append(f"{getattr(r.sink, 'name', '?')} (within {max(0.0, until - t0):.0f} s)")
        if late:
            log.warning(
                "metrics sink%s %s did not finish sending; not waiting for %s",
                "s" if len(late) > 1 else "",
                ", ".join(late),
                "them" if len(late) > 1 else "it",
            )


class _Runner(threading.Thread):
    """One sink's thread: sends the values when told something changed, at most every
    ``period_s`` (and at close). A sink that raises is retried with back-off
    (:class:`~.sink_retry.SinkHealth`: said when it fails and when it is back) and switched
    off only when it keeps failing; at close a failing sink is tried once more."""

    def __init__(self, sink: Sink, telemetry: Telemetry, period_s: float) -> None:
        super().__init__(name=f"rc-metrics-{getattr(sink, 'name', 'sink')}", daemon=True)
        self.sink = sink
        self._t = telemetry
        self._period = period_s
        self._cond = threading.Condition()
        self._dirty = True
        self._halt = False
        self._seen = 0
        self._sink_started = False
        self.health = SinkHealth(self._sink_name())

    @property
    def failed(self) -> bool:
        """Failing now, or switched off."""
        return self.health.failing or self.health.off

    def _sink_name(self) -> str:
        return str(getattr(self.sink, "name", type(self.sink).__name__))

    def wake(self) -> None:
        with self._cond:
            self._dirty = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._halt = True
            self._cond.notify()

    def run(self) -> None:
        last = -float("inf")
        while True:
            with self._cond:
                while not self._halt and not self._dirty:
                    self._cond.wait()
                stopping = self._halt
            if not stopping:  # at most one send every period, none during a back-off
                wait = max(last + self._period, self.health.next_try) - time.monotonic()
                if wait > 0:
                    with self._cond:
                        self._cond.wait_for(lambda: self._halt, wait)
                        stopping = self._halt
            with self._cond:
                self._dirty = False
            last = time.monotonic()
            if self._attempt(final=stopping):
                if stopping:
                    self._close()
                    return
            elif self.health.off:  # kept failing, or failed at close
                with contextlib.suppress(Exception):  # already reported as failed
                    self.sink.close()
                return
            else:
                with self._cond:  # what it could not send is sent at the next try
                    self._dirty = True

    def _attempt(self, final: bool) -> bool:
        """Start the sink if it has not started, then send; False when it failed."""
        t = self._t
        try:
            if not self._sink_started:
                self.sink.start(t)
                self._sink_started = True
            events, self._seen = t.events_since(self._seen)
            self.sink.emit(t.values(), t.samples(), events, t.step)
        except Exception as e:
            self.health.failed(e, final=final)
            return False
        self.health.ok()
        return True

    def _close(self) -> None:
        try:
            self.sink.close()
        except Exception as e:
            log.warning(
                "metrics sink %s failed as it closed (training is not affected): %s: %s",
                self._sink_name(),
                type(e).__name__,
                e,
            )
