"""The goodput report of a run, computed from its history (``history.jsonl``) and checkpoints.

One job: the numbers ``resilient-ckpt report`` shows and plots (:mod:`.report_html`), as plain
JSON-able data. No plotting library is needed here.

A run's history is cut into *lives*: one process (or job) from its ``start`` or ``restart``
record to the next. A life that wrote an ``end`` record stopped cleanly (finished, or saved and
exited on a preemption); one that did not is a failure: ``failed`` where the training raised
(a ``failed`` record names the exception), ``killed`` where no record says why. For a failure:

- *work lost* is the useful compute the dead life had done past the checkpoint the next life
  restored, as far as its last record shows (``progress`` heartbeats about once a minute, and
  saves): a lower bound; *unknown* (``lost_work_known`` false) where no record of the life is
  past that checkpoint and none says how it ended (killed before its next heartbeat);
- the rest of the time from that last record to the restart is *unaccounted*: more lost work,
  the time the job was down, and the restart itself (they cannot be told apart).

Goodput is useful compute (see :mod:`.recorder`) over wall time since the run's first start.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from . import history
from .adaptive import DEFAULT_PRIOR_MTBF_HOURS, HOUR
from .interval import _daly
from .lock import writer_alive


@dataclass
class Life:
    """One process of the run: from its start/restart record to the next."""

    index: int
    begin: float
    begin_step: int
    begin_useful_s: float
    how: str  # "start" | "restart"
    records: list[dict[str, Any]] = field(default_factory=list)
    restore: dict[str, Any] | None = None
    running: bool = False  # the newest life, whose process still holds the directory

    @property
    def ended_cleanly(self) -> bool:
        return any(r["event"] == "end" for r in self.records)

    @property
    def failed_with(self) -> str | None:
        """The exception's name when the training this life served raised (a ``failed``
        record: it closed, but as a failure); None otherwise."""
        failed = [r for r in self.records if r["event"] == "failed"]
        return str(failed[-1].get("error") or "an exception") if failed else None

    @property
    def ended(self) -> str:
        """How the life ended: "clean", "failed" (an exception), "killed" (no record), or
        "running" (no record yet: its process is alive, writing the directory)."""
        if self.ended_cleanly:
            return "clean"
        if self.running and self.failed_with is None:
            return "running"
        return "failed" if self.failed_with is not None else "killed"

    @property
    def preempted(self) -> bool:
        return any(r["event"] == "preemption" for r in self.records)

    @property
    def last_time(self) -> float:
        return max([self.begin, *(r["time"] for r in self.records)])

    @property
    def last_step(self) -> int:
        return max([self.begin_step, *(int(r.get("step") or 0) for r in self.records)])

    @property
    def last_useful_s(self) -> float:
        """The useful time this life had at its last record: the largest recorded (a save's
        record, written at its commit, may come after a later heartbeat), counted from its
        last roll-back (a ``restore`` record), which took the work past its checkpoint out."""
        recs, begin = self.records, self.begin_useful_s
        back = [i for i, r in enumerate(recs) if r["event"] == "restore"]
        if back:
            recs = recs[back[-1] :]
            begin = _num(recs[0].get("useful_s")) or 0.0
        vals = [_num(r.get("useful_s")) for r in recs]
        return max([begin, *(v for v in vals if v is not None)])

    def saves(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == "save"]


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _count(v: Any) -> int | None:
    """A record's byte count, None where it holds no whole number (a foreign record)."""
    return v if type(v) is int and v >= 0 else None


def choose_run(records: list[dict[str, Any]], run_id: str | None = None) -> str | None:
    """``run_id``, or the run of the newest start/restart record."""
    if run_id is not None:
        return run_id
    for r in reversed(records):
        if r["event"] in history.LIFECYCLE:
            return r.get("run_id")
    return None


def lives(records: list[dict[str, Any]]) -> list[Life]:
    out: list[Life] = []
    for r in records:
        if r["event"] in history.LIFECYCLE:
            useful = _num(r.get("useful_s")) or 0.0
            out.append(
                Life(
                    len(out),
                    float(r["time"]),
                    int(r.get("step") or 0),
                    useful,
                    r["event"],
                    restore=r if r["event"] == "restart" else None,
                )
            )
        elif r["event"] == "continued" and out:  # continued_from() after a fresh restore()
            out[-1].begin_step = int(r.get("step") or 0)
        elif out:
            out[-1].records.append(r)
    return out


def run_began(ls: list[Life]) -> float:
    """When the run started: its first record here, or earlier, as its checkpoint recorded,
    when this directory's history begins with a restart (a machine that restored the run from
    the remote tier, with none of the history of the machines before it)."""
    first = ls[0]
    saved = _num((first.restore or {}).get("run_start"))
    return min(first.begin, saved) if saved is not None else first.begin


def run_ids(recs: list[dict[str, Any]]) -> list[str]:
    """The runs the history's records ``recs`` name, newest first."""
    return list(dict.fromkeys(str(r["run_id"]) for r in reversed(recs) if r.get("run_id")))


def _missing(recs: list[dict[str, Any]], run_id: str | None) -> str:
    """Why the history has nothing to report: no run at all, or none with the id asked for
    (naming the runs it has, newest first)."""
    runs = run_ids(recs)
    if run_id is None or not runs:
        return "no history records of a run in this directory (history.jsonl)"
    return f"no run {run_id!r} in history.jsonl; its runs, newest first: {', '.join(runs)}"


def analyse(
    root: str,
    *,
    run_id: str | None = None,
    checkpoints: list[dict[str, Any]] | None = None,
    now: float | None = None,
    lines: list[str] | None = None,
) -> dict[str, Any]:
    """Everything the report shows, as JSON-able data. ``checkpoints``: rows of the
    checkpoints-by-tier table (see :func:`checkpoint_rows`); ``lines``: the history's, read
    already."""
    recs = history.records(root, lines=lines)
    run = choose_run(recs, run_id)
    mine = [r for r in recs if r.get("run_id") == run]
    ls = lives(mine)
    if not ls:
        return {
            "dir": root,
            "run_id": run,
            "lives": [],
            "summary": {},
            "failures": [],
            "saves": [],
            "uploads": [],
            "goodput": [],
            "checkpoints": checkpoints or [],
            "missing": _missing(recs, run_id),
        }
    if run == choose_run(recs) and writer_alive(root):
        ls[-1].running = True  # (a live run's report: its last life has not ended)
    t0 = run_began(ls)
    end_t = max(lf.last_time for lf in ls)
    saves: list[dict[str, Any]] = []
    goodput: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    uploads: list[dict[str, Any]] = []  # to the remote tier: did they keep up
    for lf in ls:
        prev_useful = lf.begin_useful_s
        goodput.append({"t": lf.begin - t0, "useful_s": lf.begin_useful_s, "life": lf.index})
        for r in lf.records:
            u = _num(r.get("useful_s"))
            if u is not None and r["event"] in ("save", "progress", "end", "failed"):
                goodput.append({"t": r["time"] - t0, "useful_s": u, "life": lf.index})
            if r["event"] == "upload":
                uploads.append(
                    {
                        "t": r["time"] - t0,
                        "life": lf.index,
                        "step": r.get("step"),
                        "name": r.get("name"),
                        "bytes": _count(r.get("bytes")),
                        "seconds": _num(r.get("seconds")),
                        "lag_s": _num(r.get("lag_s")),
                    }
                )
            if r["event"] != "save":
                continue
            interval = None if u is None else u - prev_useful
            if u is not None:
                prev_useful = u
            saves.append(
                {
                    "t": r["time"] - t0,
                    "life": lf.index,
                    "step": r.get("step"),
                    "name": r.get("name"),
                    "reason": r.get("reason"),
                    "bytes": _count(r.get("bytes")),
                    "blocking_s": _num(r.get("blocking_s")),
                    "persist_s": _num(r.get("persist_s")),
                    "interval_used_s": interval,
                    "cost_s": _num(r.get("cost_s")),
                    "mtbf_s": _num(r.get("mtbf_s")),
                    "mtbf_source": r.get("mtbf_source"),
                    "optimal_interval_s": _num(r.get("optimal_interval_s")),
                    "interval_steps": r.get("interval_steps"),
                }
            )
    # useful time is the compute between step() calls: a loop that only calls save() has
    # none measured, and its goodput is unknown, not 0% (it printed "goodput 0.0%")
    timed = ls[-1].last_useful_s > 0 or not saves
    for g in goodput:
        g["goodput"] = g["useful_s"] / g["t"] if g["t"] > 0 and timed else None
    for prev, nxt in itertools.pairwise(ls):
        if prev.ended_cleanly:
            continue
        restored_useful = nxt.begin_useful_s
        lost = max(0.0, prev.last_useful_s - restored_useful)
        # its records show work past the checkpoint restored (a heartbeat, a save not restored)
        # or how it ended (a failed record); otherwise it was killed after its last record, at
        # a time none says (the demo's SIGKILL 7 steps past a save, before any heartbeat), and
        # the work it lost is unknown: within unaccounted_s, not the 0.0 s its records show
        known = (
            prev.failed_with is not None
            or prev.last_step > nxt.begin_step
            or prev.last_useful_s > restored_useful
        )
        failures.append(
            {
                "life": prev.index,
                "ended": prev.ended,  # "killed", or "failed" (an exception: see "error")
                "error": prev.failed_with,
                "last_seen_t": prev.last_time - t0,
                "last_seen_step": prev.last_step,
                "restored_step": nxt.begin_step,
                "restart_t": nxt.begin - t0,
                "lost_steps_at_least": max(0, prev.last_step - nxt.begin_step),
                "lost_work_s_at_least": lost,
                "lost_work_known": known,
                "unaccounted_s": max(0.0, nxt.begin - prev.last_time),
                "restore_s": _num((nxt.restore or {}).get("seconds")),
                "tier": (nxt.restore or {}).get("tier"),
                "fallbacks": (nxt.restore or {}).get("fallbacks"),
            }
        )
    wall = max(end_t - t0, 1e-9)
    useful = ls[-1].last_useful_s
    blocking = [s["blocking_s"] for s in saves if s["blocking_s"] is not None]
    persist = [s["persist_s"] for s in saves if s["persist_s"] is not None]
    # exposed to failures only while running: not from a life's last record to the next start
    exposure = max(
        0.0, wall - sum(max(0.0, n.begin - p.last_time) for p, n in itertools.pairwise(ls))
    )
    n_fail = len(failures)
    mtbf_obs = exposure / n_fail if n_fail else None
    cost = statistics.median(blocking) if blocking else None
    mtbf_est = (DEFAULT_PRIOR_MTBF_HOURS * HOUR + exposure) / (1 + n_fail)
    given = [s["mtbf_s"] for s in saves if s["mtbf_source"] == "user" and s["mtbf_s"]]
    if given:  # mtbf_hours= was given: the policy used it, not the prior-weighted estimate
        mtbf_est = given[-1]
    used = [s["interval_used_s"] for s in saves if s["interval_used_s"]]
    up_s = [u["seconds"] for u in uploads if u["seconds"] is not None]
    lags = [u["lag_s"] for u in uploads if u["lag_s"] is not None]
    summary = {
        "run_id": run,
        "wall_s": wall,
        "useful_s": useful,
        # > 0: the run's first processes ran on machines whose history is not here
        "history_begins_s": ls[0].begin - t0,
        "goodput": min(1.0, useful / wall) if timed else None,
        "lives": len(ls),
        "failures": n_fail,
        "clean_restarts": sum(1 for lf in ls[:-1] if lf.ended_cleanly),
        "preemptions": sum(1 for lf in ls if lf.preempted),
        "saves": len(saves),
        "saving_blocked_s": sum(blocking),
        "median_blocking_s": cost,
        "median_persist_s": statistics.median(persist) if persist else None,
        "work_lost_s_at_least": sum(f["lost_work_s_at_least"] for f in failures),
        "work_lost_unknown": sum(1 for f in failures if not f["lost_work_known"]),
        "unaccounted_s": sum(f["unaccounted_s"] for f in failures),
        "restore_s": sum(f["restore_s"] or 0.0 for f in failures),
        "final_step": ls[-1].last_step,
        "finished_cleanly": ls[-1].ended_cleanly,
        "running": ls[-1].ended == "running",
        "exposure_s": exposure,
        "mtbf_observed_s": mtbf_obs,
        "mtbf_estimate_s": mtbf_est,
        "mtbf_estimate_source": "user" if given else "prior-weighted",
        "daly_interval_observed_s": _daly(cost, mtbf_obs) if cost and mtbf_obs else None,
        "daly_interval_estimate_s": _daly(cost, mtbf_est) if cost else None,
        "median_interval_used_s": statistics.median(used) if used else None,
        "uploads": len(uploads),
        "median_upload_s": statistics.median(up_s) if up_s else None,
        "max_upload_lag_s": max(lags) if lags else None,
    }
    return {
        "dir": root,
        "run_id": run,
        "generated": now,
        "summary": summary,
        "lives": [
            {
                "index": lf.index,
                "how": lf.how,
                "begin_t": lf.begin - t0,
                "end_t": lf.last_time - t0,
                "begin_step": lf.begin_step,
                "last_step": lf.last_step,
                "ended": lf.ended,
                "error": lf.failed_with,
                "preempted": lf.preempted,
            }
            for lf in ls
        ],
        "failures": failures,
        "saves": saves,
        "uploads": uploads,
        "goodput": goodput,
        "checkpoints": checkpoints or [],
        "other_runs": sorted({str(r.get("run_id")) for r in recs} - {str(run)}),
    }


def checkpoint_rows(root: str, remote: Any = None, verify: bool = False) -> list[dict[str, Any]]:
    """The checkpoints of ``root`` (sizes checked: status ``unverified``; every checksum with
    ``verify``) and, with ``remote`` (a RemoteStore), of the remote tier: one row per
    checkpoint and tier, with the status ``resilient-ckpt ls`` gives."""
    from .catalog import Depth, scan
    from .cli_scan import state

    depth = Depth.FULL if verify else Depth.SIZE
    rows = []
    for e in scan(root, depth):
        m = e.manifest
        rows.append(
            {
                "tier": "local",
                "name": e.name,
                "step": e.step,
                "status": state(e, depth)[0],
                "bytes": m.total_bytes if m else None,
                "created": m.created if m else None,
                "run_id": m.run_id if m else None,
                "reason": m.reason if m else None,
            }
        )
    if remote is not None:
        for r in remote.scan():
            m = r.manifest
            rows.append(
                {
                    "tier": "remote",
                    "name": r.name,
                    "step": m.step if m else None,
                    "status": "committed" if m and not r.problem else (r.problem or "incomplete"),
                    "bytes": m.total_bytes if m else None,
                    "created": m.created if m else None,
                    "run_id": m.run_id if m else None,
                    "reason": m.reason if m else None,
                }
            )
    return rows


def history_exists(root: str) -> bool:
    return os.path.exists(os.path.join(root, history.HISTORY_NAME))
