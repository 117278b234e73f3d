"""What a Checkpointer reports about itself: the metrics (:mod:`.metrics`) and the run history
records ``resilient-ckpt report`` plots (:mod:`.history`).

One job: turn the Checkpointer's events (a save blocked, committed, failed or was skipped; a
restore, a fallback, a preemption; a training step) into metric values and history records.
On the training thread it only does arithmetic and dict writes, plus, about once a second while
a sink is attached, a refresh of the derived values (medians, the goodput), and a heartbeat
record (no fsync) about once a minute. Recording never raises: a history record that cannot be
written is logged.

Which ranks call what: every rank records its own metrics; only the coordinator writes history.

Useful time (the goodput's numerator) is the compute between ``step()`` calls (time blocked in a
save excluded), summed since the run's first start and carried across restarts in each
checkpoint's manifest (``extra["progress"]``), so work lost to a failure drops out of it.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

from .adaptive import DEFAULT_PRIOR_MTBF_HOURS, HOUR
from .interval import _daly
from .metrics import PREFIX, fallback_reason
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .manifest import Manifest

log = logging.getLogger("resilient_callbacks")

PROGRESS_ENV = "RESILIENT_PROGRESS_EVERY_S"  # heartbeat period of the history (default 60 s)
REFRESH_S = 1.0  # derived metrics, while a sink is attached


def _median(xs: Any) -> float | None:
    try:
        vals = list(xs)
    except RuntimeError:  # mutated while copied (another thread): next time
        return None
    return statistics.median(vals) if vals else None


class Recorder:
    def __init__(self, ck: Checkpointer, telemetry: Telemetry) -> None:
        self._ck = ck
        self.t = telemetry
        self.base_useful_s = 0.0  # useful time of the checkpoint restored (0 on a fresh start)
        self.run_start: float | None = None  # wall-clock start of the run (lineage)
        self.created = time.time()  # a run that saves without restore(): it started here
        self.failures = 0
        self.downtime_s = 0.0  # of the run before this process: not exposed to failures
        self.ended = False  # the end record is written (a preemption's, before close())
        self.began = False  # this process's start or restart is known (restore() again: none)
        self._compute_at_base = 0.0
        self._next_refresh = 0.0
        self._committed: dict[str, tuple[int, float]] = {}  # name -> (bytes, commit time)
        # (step, message): the newest commit's work after it failed (after_commit_work.py)
        self.after_commit_error: tuple[int, str] | None = None
        # fallbacks come before the restore that tells the run's id: recorded after its record
        self._deferred: list[tuple[str, int, dict[str, Any]]] = []
        try:
            self._beat_s = float(os.environ.get(PROGRESS_ENV, "60"))
        except ValueError:
            self._beat_s = 60.0
        self._next_beat = time.monotonic() + self._beat_s

    # ------------------------------------------------------------------ derived values

    def useful_s(self) -> float:
        """Training compute that counts so far (see the module docstring)."""
        return self.base_useful_s + self._ck._trigger.compute_s - self._compute_at_base

    def timed(self) -> bool:
        """Whether any training compute was measured (``step()`` calls, here or in the run's
        checkpoint restored): a loop that only calls ``save()`` has none, its goodput unknown."""
        return self._ck._trigger.compute_s > 0 or self.base_useful_s > 0

    def schedule_inputs(self) -> dict[str, Any]:
        """What the interval decision is made of: step time, save cost, MTBF, the interval in
        use and Daly's optimum for them."""
        ck = self._ck
        step_s = _median(ck._trigger.step_seconds)
        sched = ck.schedule
        # the cost the adaptive policy decides with (carried over restarts), else this
        # process's saves
        cost = sched.blocking_cost_s() if sched is not None else None
        if cost is None:
            cost = _median(ck._saver.save_seconds)
        if sched is not None:
            mtbf, source = sched.mtbf_estimate(), sched.mtbf_source()
            steps = sched.current_steps
        else:
            start = self.run_start
            exposure = max(0.0, time.time() - start - self.downtime_s) if start is not None else 0.0
            mtbf = (DEFAULT_PRIOR_MTBF_HOURS * HOUR + exposure) / (1 + self.failures)
            source = "learned" if self.failures else "prior"
            steps = ck.policy.every_n_steps
        out: dict[str, Any] = {
            "step_s": step_s,
            "cost_s": cost,
            "mtbf_s": mtbf,
            "mtbf_source": source,
            "interval_steps": steps,
            "interval_s": steps * step_s if steps and step_s is not None else None,
            "optimal_interval_s": _daly(cost, mtbf) if cost is not None else None,
        }
        return out

    def refresh(self) -> None:
        """Set the derived metrics (training thread, about once a second with a sink)."""
        ck, t = self._ck, self.t
        t.set(PREFIX + "step", t.step)
        s = self.schedule_inputs()
        for key, name in (
            ("step_s", "step_seconds"),
            ("cost_s", "save_cost_seconds"),
            ("mtbf_s", "mtbf_seconds"),
            ("interval_steps", "interval_steps"),
            ("interval_s", "interval_seconds"),
            ("optimal_interval_s", "optimal_interval_seconds"),
        ):
            if s[key] is not None:
                t.set(PREFIX + name, s[key])
        if self.run_start is not None:  # the run's lineage is known (after restore() or a start)
            t.set(PREFIX + "restarts_total", self.failures)
            wall = max(time.time() - self.run_start, 1e-9)
            t.set(PREFIX + "wall_seconds_total", wall)
            if self.timed():  # else unknown, not 0: left out, as the report says "unknown"
                useful = self.useful_s()
                t.set(PREFIX + "useful_seconds", useful)
                t.set(PREFIX + "goodput_ratio", min(1.0, useful / wall))
        waits = ck._saver.save_waits
        t.set(PREFIX + "saves_waited_total", waits.waits)
        t.set(PREFIX + "save_wait_seconds_total", waits.total_seconds)
        self._upload_status()

    def _upload_status(self) -> None:
        st = self._ck.remote_status()
        if st is None:
            return
        t = self.t
        t.set(PREFIX + "upload_backlog_checkpoints", len(st.pending))
        t.set(PREFIX + "uploads_total", st.uploaded)
        t.set(PREFIX + "upload_bytes_total", st.uploaded_bytes)
        t.set(PREFIX + "upload_consecutive_failures", st.failures)
        pending_bytes, oldest = 0, None
        for name in st.pending:
            info = self._committed.get(name) or self._from_manifest(name)
            if info is not None:
                pending_bytes += info[0]
                oldest = info[1] if oldest is None else min(oldest, info[1])
        t.set(PREFIX + "upload_backlog_bytes", pending_bytes)
        t.set(PREFIX + "upload_lag_seconds", time.time() - oldest if oldest is not None else 0.0)

    def _from_manifest(self, name: str) -> tuple[int, float] | None:
        """(bytes, commit time) of a checkpoint an earlier process committed, from its manifest
        (read once: the upload backlog after a restart)."""
        from .manifest import read_manifest

        try:
            m = read_manifest(os.path.join(self._ck.dirpath, name))
        except Exception:  # deleted meanwhile, or unreadable: left out of the backlog figures
            return None
        self._committed[name] = (m.total_bytes, m.created)
        return self._committed[name]

    # ------------------------------------------------------------------ events

    def tick(self, step: int) -> None:
        """Training thread, every step(): cheap unless a refresh or a heartbeat is due."""
        self.t.step = step
        now = time.monotonic()
        if self.t.active and now >= self._next_refresh:
            self._next_refresh = now + REFRESH_S
            self.refresh()
            self.t.notify()
        if now >= self._next_beat:
            self._next_beat = now + self._beat_s
            self._record("progress", step, sync=False, useful_s=round(self.useful_s(), 3))

    def started(self, step: int, at: float | None = None) -> None:
        """A new run (no checkpoint restored): its clock starts now (or ``at``, a wall time),
        and the adaptive schedule's exposure (the time the run survived) with it."""
        self.run_start = time.time() if at is None else at
        self.downtime_s, self.began = 0.0, True
        schedule = self._ck.schedule
        if schedule is not None:
            schedule.set_restart_history([], self.run_start)

    def save_blocked(self, blocking_s: float) -> None:
        self.t.set(PREFIX + "last_save_blocking_seconds", blocking_s)
        self.t.inc(PREFIX + "save_blocking_seconds_total", blocking_s)

    def skipped(self) -> None:
        self.t.inc(PREFIX + "saves_skipped_total")
        self.t.notify()

    def committed(
        self,
        step: int,
        path: str,
        nbytes: int,
        persist_s: float,
        blocking_s: float,
        reason: str,
        useful_s: float,
    ) -> None:
        """Any thread (the background one for background saves), once ``step`` is committed."""
        t = self.t
        name = os.path.basename(path)
        self._committed[name] = (nbytes, time.time())
        if len(self._committed) > 1000:
            self._committed.pop(next(iter(self._committed)))
        t.set(PREFIX + "save_persist_seconds", persist_s)
        t.set(PREFIX + "save_bytes", nbytes)
        if persist_s > 0:
            t.set(PREFIX + "save_throughput_bytes_per_second", nbytes / persist_s)
        t.inc(PREFIX + "saves_total", labels=(reason,))
        if reason == "emergency":
            t.inc(PREFIX + "emergency_saves_total")
        t.set(PREFIX + "last_saved_step", step)
        t.set(PREFIX + "last_save_timestamp_seconds", time.time())
        s = self.schedule_inputs()
        fields: dict[str, Any] = {
            "name": name,
            "reason": reason,
            "bytes": nbytes,
            "blocking_s": round(blocking_s, 6),
            "persist_s": round(persist_s, 6),
            "useful_s": round(useful_s, 3),
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in s.items()},
        }
        t.event("save", step=step, **fields)
        self._record("save", step, fields=fields)

    def save_failed(self, step: int, error: BaseException) -> None:
        self.t.inc(PREFIX + "save_failures_total")
        msg = f"{type(error).__name__}: {error}"[:500]
        self.t.event("save_failed", step=step, error=msg)
        self._record("save_failed", step, error=msg)

    def after_commit(self, step: int, error: str | None) -> None:
        """Any thread, once ``step`` is committed: its work after the commit failed with
        ``error`` (said where it ran), or succeeded (None): kept until the next commit."""
        self.after_commit_error = None if error is None else (step, error)
        if error is not None:
            self.t.inc(PREFIX + "after_commit_failures_total")
            self.t.event("after_commit_failed", step=step, error=error[:500])

    def fallback(self, step: int | None, where: str | None, problem: str) -> None:
        reason = fallback_reason(problem)
        self.t.inc(PREFIX + "restore_fallbacks_total", labels=(reason,))
        self.t.event("fallback", step=step, checkpoint=where, reason=reason, problem=problem[:500])
        self._record(
            "fallback",
            step or 0,
            fields={"checkpoint": where, "reason": reason, "problem": problem[:500]},
        )

    def restored(
        self, manifest: Manifest, inside: bool, seconds: float, tier: str, skipped: int
    ) -> dict[str, Any]:
        """Every rank, once a checkpoint is loaded: carry its useful time on; returns the
        fields of the ``restart`` history record."""
        t = self.t
        progress = manifest.extra.get("progress") if inside else None
        useful = 0.0
        if isinstance(progress, dict):
            try:
                useful = float(progress.get("useful_s", 0.0))
            except (TypeError, ValueError):
                useful = 0.0
        self.base_useful_s = useful if math.isfinite(useful) else 0.0
        self._compute_at_base = self._ck._trigger.compute_s
        t.set(PREFIX + "restore_seconds", seconds)
        t.set(PREFIX + "restored_step", manifest.step)
        t.step = manifest.step  # the run is at that step until the next step() says otherwise
        if inside:  # the newest checkpoint of the run is that one until the next save
            t.set(PREFIX + "last_saved_step", manifest.step)
            t.set(PREFIX + "last_save_timestamp_seconds", manifest.created)
        t.inc(PREFIX + "restores_total", labels=(tier,))
        fields: dict[str, Any] = {
            "seconds": round(seconds, 6),
            "tier": tier,
            "fallbacks": skipped,
            "useful_s": round(self.base_useful_s, 3),
        }
        t.event("restore", step=manifest.step, **fields)
        start = progress.get("run_start") if isinstance(progress, dict) else None
        if isinstance(start, (int, float)) and math.isfinite(start):
            # the report's wall time counts from it where this directory's history begins
            # here (a new machine that restored from the remote tier)
            fields["run_start"] = start
        return fields

    def lineage(
        self,
        manifest: Manifest,
        inside: bool,
        start: float | None,
        restarts: list[float],
        downtime_s: float,
    ) -> None:
        """Every rank, after a restore, with the same values (the run's start and restarts
        from the history, this restart included): wall time and failures count from them. A
        directory without the run's history (restored from the remote tier on a new machine)
        has the start the checkpoint recorded. The adaptive schedule learns the same failures
        (another run's checkpoint: none, the restarts of the directory's earlier runs neither)."""
        if not inside:  # another run's checkpoint: this run starts now
            start, restarts = None, []
        schedule = self._ck.schedule
        if schedule is not None:
            if start is None:  # (no history of the run here: it is exposed from now)
                schedule.set_restart_history([], time.time())
            else:
                schedule.set_restart_history(restarts, start, downtime_s=downtime_s)
        # without the run's history here (restored from the remote tier), this restart is one
        self.failures = (len(restarts) if start is not None else 1) if inside else 0
        self.downtime_s = downtime_s if inside and start is not None else 0.0
        progress = manifest.extra.get("progress") if inside else None
        saved = progress.get("run_start") if isinstance(progress, dict) else None
        if isinstance(saved, (int, float)) and math.isfinite(saved):
            start = saved if start is None else min(start, saved)
        self.run_start = start if start is not None else time.time()
        self.began = True

    def continued_unsaved(self, start: float, restarts: list[float], downtime_s: float) -> None:
        """Every rank: the run goes on from nothing saved (:meth:`Restorer.fresh_start`), with
        its start, its restarts (this one included) and the time it was down."""
        self.failures = len(restarts)
        self.run_start, self.downtime_s, self.began = start, downtime_s, True
        schedule = self._ck.schedule
        if schedule is not None:
            schedule.set_restart_history(restarts, start, downtime_s=downtime_s)

    def preemption(self, step: int, source: str) -> None:
        self.t.inc(PREFIX + "preemptions_total")
        self.t.event("preemption", step=step, source=source)
        self._record("preemption", step, source=source)

    def progress_extra(self) -> dict[str, Any]:
        """The manifest's ``extra["progress"]``, taken on the training thread at the save."""
        out: dict[str, Any] = {"useful_s": round(self.useful_s(), 6)}
        if self.run_start is not None:
            out["run_start"] = round(self.run_start, 3)  # wall time counts from here
        return out

    def stopping(self) -> None:
        """A preemption's emergency checkpoint is committed and the process stops: its ``end``
        record now, not after close() waited for uploads with what is left of the grace
        period. A kill during that wait loses nothing, so the restart is no failure."""
        self.ended = True
        self._record("end", self.t.step, fields={"useful_s": round(self.useful_s(), 3)})

    def closed(self, deadline: float | None = None) -> None:
        """close(): the last values, an ``end`` record (``failed``, with the exception's name,
        when training failed: :meth:`Checkpointer.abort`; none after :meth:`stopping`), then
        the sinks flush and stop (none waited for past ``deadline``, a ``time.monotonic()``
        time)."""
        try:
            self.refresh()
        except Exception as e:  # metrics never stop a close
            log.debug("metrics refresh at close failed: %s", e)
        self.record_end()
        self.t.close(deadline=deadline)

    def record_end(self) -> None:
        """The ``end`` record (``failed`` when training failed), once: by :meth:`closed`, or
        by a release that a Ctrl-C interrupted before it (:mod:`.closing`)."""
        if self._ck._dir.run_id is None or self.ended:
            return
        failed = self._ck.failed_with
        event = "failed" if failed else "end"
        fields: dict[str, Any] = {"useful_s": round(self.useful_s(), 3)}
        if failed:
            fields["error"] = failed
        self._record(event, self.t.step, fields=fields)
        self.ended = True

    def _record(
        self,
        event: str,
        step: int,
        *,
        sync: bool = True,
        fields: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        ck = self._ck
        if not ck.is_coordinator:
            return
        if ck._dir.run_id is None:
            if event == "fallback":
                self._deferred.append((event, step, {**(fields or {}), **kw}))
            return
        ck._dir.record(event, step, sync=sync, **(fields or {}), **kw)

    def record_deferred(self) -> None:
        """Coordinator, once the run's start or restart is recorded: the records made before
        its id was known (the fallbacks of the restore)."""
        deferred, self._deferred = self._deferred, []
        for event, step, fields in deferred:
            self._record(event, step, fields=fields)
