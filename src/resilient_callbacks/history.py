"""The run's own history in its checkpoint directory: starts and restarts, with their times.

A process's first restore that resumes from a checkpoint (a ``restart``) is a failure event
(the run stopped before it finished), unless the process before it closed cleanly (an ``end``
record); the adaptive save policy learns the mean time between failures from these. A
``restore()`` again in the same process (a roll-back) is a ``restore`` record: no new life.
``<dirpath>/history.jsonl`` holds one JSON object per line, appended by the coordinator only:
``{"event": "start" | "restart", "time": <unix seconds>, "step": N, "run_id": "...",
"world_size": W}``; a ``restart`` from a checkpoint also has the ``resume`` option and ``top``,
the newest commit number then (:mod:`.rollback_notice`). A torn last line is ignored.

Besides those two (the lifecycle :func:`read` returns and the failure rate is learned from),
the coordinator appends what ``resilient-ckpt report`` plots, each with more fields (see
docs/monitoring.md): ``save`` (a committed checkpoint: bytes, blocking and persist seconds,
reason, the interval and the schedule's inputs), ``progress`` (a heartbeat about once a minute:
the step and the useful compute so far), ``restore`` (a roll-back: seconds, tier, fallbacks),
``fallback``, ``preemption``, ``save_failed``, ``end`` (a clean close; a preempted process's
once its emergency checkpoint committed), ``failed`` (the training the Checkpointer served
left with an exception) and ``continued`` (``continued_from`` after a ``restore()`` that found
nothing: the run goes on from that step of another tool's checkpoint). Recording is best
effort: a record that cannot be written is logged, never a reason for a save to fail.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

HISTORY_NAME = "history.jsonl"
LIFECYCLE = ("start", "restart")


@dataclass(frozen=True)
class Event:
    event: str
    time: float
    step: int
    run_id: str | None
    world_size: int


def append(
    root: str,
    event: str,
    step: int,
    run_id: str | None,
    world_size: int,
    *,
    sync: bool = True,
    **fields: Any,
) -> None:
    """Append one record (one ``write`` of one line, so concurrent appends by the training and
    the background threads never interleave). ``sync=False`` skips the fsync (heartbeats)."""
    rec = {
        "event": event,
        "time": time.time(),
        "step": step,
        "run_id": run_id,
        "world_size": world_size,
        **{k: _finite(v) for k, v in fields.items()},
    }
    data = (json.dumps(rec, allow_nan=False, default=str) + "\n").encode()
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW  # not through a symlink
    fd = os.open(os.path.join(root, HISTORY_NAME), flags, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a crash tore the last line: this record starts its own
        while data:
            data = data[os.write(fd, data) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _finite(v: Any) -> Any:
    """Non-finite floats as None (the file stays strict JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


def read_lines(root: str) -> list[str]:
    """The history's lines ([] without one). Bytes that are not UTF-8 (bit rot, a foreign
    tool's append) spoil only their own line, which no reader parses then."""
    try:
        with open(os.path.join(root, HISTORY_NAME), encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def records(
    root: str, kinds: tuple[str, ...] | None = None, *, lines: list[str] | None = None
) -> list[dict[str, Any]]:
    """Every record of the history as written (``kinds``: of those kinds only), oldest first;
    torn or foreign lines are skipped. Lines that cannot be of ``kinds`` are not parsed: a
    restore reads the few lifecycle records of a history of many thousand saves. ``lines``:
    the file's, read already. Bytes that are not UTF-8 (bit rot, a foreign tool's append)
    spoil only their own line."""
    lines = read_lines(root) if lines is None else lines
    marks = None if kinds is None else tuple(json.dumps(k) for k in kinds)
    out = []
    for line in lines:
        if marks is not None and not any(m in line for m in marks):
            continue
        d = _stepped(_record(line))
        if d is not None and (kinds is None or d["event"] in kinds):
            out.append(d)
    return out


@dataclass(frozen=True)
class Upload:
    """What a directory's history records of the uploads of one checkpoint name: ``time``,
    that of the newest ``upload`` record (written once the upload ended); ``committed``, the
    newest commit time they give (the record's time less its ``lag_s``, how long after its
    commit the upload ended), None where none has a number there (a foreign or damaged line:
    its checkpoint's commit time is not known); ``seqs``, the commit numbers they record (a
    node-local coordinator's, after each remote commit: a restart uploads none of those again)."""

    time: float
    committed: float | None
    seqs: frozenset[int] = frozenset()


def uploads(root: str, run_id: str | None) -> dict[str, Upload]:
    """The local names of run ``run_id``'s checkpoints whose upload the history of ``root``
    records (``upload`` records: the uploader's after each upload, a node-local coordinator's
    after each remote commit), each with its :class:`Upload` (a name uploaded more than once,
    a later checkpoint under a deleted one's name: the newest of each time)."""
    out: dict[str, Upload] = {}
    for r in records(root, ("upload",)):
        if r.get("run_id") != run_id or not isinstance(name := r.get("name"), str):
            continue
        at, lag = float(r["time"]), r.get("lag_s")
        committed: float | None = None  # (a lag that is no number: not known)
        if isinstance(lag, (int, float)) and not isinstance(lag, bool) and math.isfinite(lag):
            committed = at - lag
        seqs = frozenset([r["seq"]]) if isinstance(r.get("seq"), int) else frozenset()
        if (seen := out.get(name)) is not None:
            at = max(at, seen.time)
            known = [c for c in (committed, seen.committed) if c is not None]
            committed = max(known) if known else None
            seqs |= seen.seqs
        out[name] = Upload(at, committed, seqs)
    return out


def unreadable(root: str, *, lines: list[str] | None = None) -> int:
    """How many lines of the history :func:`records` skips (torn, foreign, malformed); blank
    lines are not counted. ``lines``: the file's, read already."""
    lines = read_lines(root) if lines is None else lines
    return sum(1 for line in lines if line.strip() and _stepped(_record(line)) is None)


def _stepped(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """``d`` if its step is missing or a whole number, else None (malformed)."""
    return d if d is not None and (d.get("step") is None or type(d["step"]) is int) else None


def read(
    root: str, kinds: tuple[str, ...] | None = LIFECYCLE, *, lines: list[str] | None = None
) -> list[Event]:
    """The run's lifecycle (``start`` and ``restart`` records; ``kinds=None``: every kind)."""
    out = []
    for d in records(root, kinds, lines=lines):
        try:
            out.append(
                Event(
                    str(d["event"]),
                    float(d["time"]),
                    int(d.get("step", 0)),
                    d.get("run_id"),
                    int(d.get("world_size", 1)),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue  # a foreign line
    return out


def unsaved_run(root: str) -> tuple[str, float, list[float], float] | None:
    """``(run_id, start, restarts, downtime)`` of the run whose newest process died before its
    first save (its start recorded, no save, no clean ``end`` after its last life began):
    restarted now, with no checkpoint, it is the same run (``restarts`` has this restart, and
    :func:`downtime` counts to it). None otherwise."""
    events = read(root, (*LIFECYCLE, "end", "failed", "save"))
    lives = [e for e in events if e.event in LIFECYCLE]
    if not lives or lives[-1].run_id is None:
        return None
    run = lives[-1].run_id
    mine = [e for e in events if e.run_id == run]
    if any(e.event == "save" for e in mine) or mine[-1].event == "end":
        return None
    start, restarts = failures([e for e in mine if e.event != "save"], run)
    if start is None:
        return None
    now = time.time()
    return run, start, [*restarts, now], downtime(root, run, until=now)


def lineage(
    root: str, run_id: str | None, *, lines: list[str] | None = None
) -> tuple[float | None, list[float], float]:
    """``(start, restarts, downtime)`` of the lineage ``run_id``, as a restore learns them:
    :func:`failures` of its lifecycle and :func:`downtime`."""
    lines = read_lines(root) if lines is None else lines  # read once (many thousand saves)
    start, restarts = failures(read(root, (*LIFECYCLE, "end"), lines=lines), run_id)
    return start, restarts, downtime(root, run_id, lines=lines)


def downtime(
    root: str,
    run_id: str | None,
    until: float | None = None,
    *,
    lines: list[str] | None = None,
    since: float | None = None,
) -> float:
    """Seconds the lineage ``run_id`` was not running: from the last record of each life (of
    any kind: heartbeats come about once a minute) to the ``restart`` record of the next,
    summed; ``until``: the time of a restart not recorded yet, also counted to. Waiting in a
    queue after a preemption or a kill, or a finished run extended weeks later, exposes it to
    no failure: the MTBF learned from the restarts leaves that time out. (Also left out: the
    last minute or so of a killed life, and a restart until its restore finished: the learned
    MTBF errs short, towards saving more often.) ``since``: only the time down after that
    wall time. Only the records just before a restart are parsed, as in :func:`records`."""
    lines = read_lines(root) if lines is None else lines
    marks = tuple(json.dumps(k) for k in LIFECYCLE)
    total, after = 0.0, -math.inf if since is None else since
    begun = False  # the lineage's first life (a restart, where its history began elsewhere)
    for i, line in enumerate(lines):
        if not any(m in line for m in marks):
            continue
        d = _record(line)
        if d is None or d["event"] not in LIFECYCLE:
            continue
        if run_id is not None and d.get("run_id") not in (run_id, None):
            continue
        if not begun or d["event"] != "restart":
            begun = True
            continue
        before = next(
            (r for r in map(_record, reversed(lines[max(0, i - 1000) : i])) if r is not None),
            None,
        )
        if before is not None:
            total += max(0.0, d["time"] - max(before["time"], after))
    if until is not None and lines:
        last = next((r for r in map(_record, reversed(lines[-1000:])) if r is not None), None)
        if last is not None:
            total += max(0.0, until - max(last["time"], after))
    return total


def running_since_save(root: str, run_id: str | None, *, lines: list[str] | None = None) -> float:
    """Seconds the lineage ``run_id`` ran since its last committed save (its newest ``save``
    record) up to now, the time it was down left out (:func:`downtime`): what its processes
    since then trained and lost, which ``every_seconds`` counts on at a restart. 0.0 without
    such a record (a history begun elsewhere: the remote tier on a new machine)."""
    lines = read_lines(root) if lines is None else lines
    mark = json.dumps("save")
    last = next(  # (from the end: only the newest save record is parsed)
        (
            r
            for r in map(_record, (line for line in reversed(lines) if mark in line))
            if r is not None and r["event"] == "save" and r.get("run_id") in (run_id, None)
        ),
        None,
    )
    if last is None:
        return 0.0
    now = time.time()
    at = min(last["time"], now)
    return max(0.0, now - at - downtime(root, run_id, lines=lines, since=at))


def _record(line: str) -> dict[str, Any] | None:
    """One line as a record, or None (torn, foreign)."""
    try:
        d = json.loads(line)
    except ValueError:
        return None
    ok = (
        isinstance(d, dict)
        and isinstance(d.get("event"), str)
        and isinstance(d.get("time"), (int, float))
        and not isinstance(d.get("time"), bool)
        and math.isfinite(d["time"])
    )
    return d if ok else None


def failures(events: list[Event], run_id: str | None) -> tuple[float | None, list[float]]:
    """(time the run started, times of the restarts that followed a failure) for the lineage
    ``run_id``. ``events``: :func:`read` with ``LIFECYCLE + ("end",)``. A restart after an
    ``end`` record (a clean stop: a finished run, a preemption saved before exiting) is no
    failure: no work was lost, and the save interval should not shorten for it."""
    mine = [e for e in events if run_id is None or e.run_id in (run_id, None)]
    start = next((e.time for e in mine if e.event == "start"), None)
    restarts: list[float] = []
    clean = False
    for e in mine:
        if e.event == "restart" and not clean:
            restarts.append(e.time)
        clean = e.event == "end"
    if start is None and mine:
        start = mine[0].time
    if start is None:
        return start, restarts
    # A wall clock stepped back (NTP, a node with a wrong clock) leaves records out of order or
    # in the future: each is clamped into [start, now], in order, so the failure count stays
    # right and the learned rate never sees a negative exposure.
    now = time.time()
    start = min(start, now)
    ordered: list[float] = []
    for t in restarts:
        ordered.append(min(max(t, ordered[-1] if ordered else start), now))
    return start, ordered
