"""The checkpoint metrics: one documented set of names and units (the collector that holds their
values: :mod:`.telemetry`).

Every sink (Prometheus, MLflow, the frameworks' loggers, a plain callable; :mod:`.sinks`) sees the
same names. They follow Prometheus' conventions so a Grafana panel needs no renaming: a
``resilient_ckpt_`` prefix, base units in the name (``_seconds``, ``_bytes``, ``_ratio``), and
``_total`` on counters. docs/monitoring.md has the table; :data:`METRICS` is its source.
Plain data and functions of names: no thread, no collective, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "resilient_ckpt_"
# counters of the run (its lineage over restarts), set once its start is known
RUN_COUNTERS = frozenset({PREFIX + "restarts_total", PREFIX + "wall_seconds_total"})


@dataclass(frozen=True)
class Metric:
    """One metric: its full name, ``kind`` (``"gauge"`` or ``"counter"``), unit, meaning and
    label names (the ``rank`` label a per-rank Prometheus exporter adds is not listed)."""

    name: str
    kind: str
    unit: str
    help: str
    labels: tuple[str, ...] = ()


def _m(name: str, kind: str, unit: str, help: str, labels: tuple[str, ...] = ()) -> Metric:
    return Metric(PREFIX + name, kind, unit, help, labels)


METRICS: tuple[Metric, ...] = (
    # saving
    _m(
        "last_save_blocking_seconds",
        "gauge",
        "seconds",
        "time the last save blocked the training loop",
    ),
    _m(
        "save_blocking_seconds_total",
        "counter",
        "seconds",
        "time saves blocked the training loop in all (this process)",
    ),
    _m(
        "save_persist_seconds",
        "gauge",
        "seconds",
        "time from the last save's start until it was committed (background write and commit)",
    ),
    _m("save_bytes", "gauge", "bytes", "size of the last committed checkpoint"),
    _m(
        "save_throughput_bytes_per_second",
        "gauge",
        "bytes/second",
        "the last committed checkpoint's size over its persist time",
    ),
    _m(
        "saves_total",
        "counter",
        "checkpoints",
        "checkpoints committed, by reason (periodic, final, forced, emergency)",
        ("reason",),
    ),
    _m(
        "saves_skipped_total",
        "counter",
        "saves",
        "periodic saves skipped because the previous one was still being written (if_busy='skip')",
    ),
    _m(
        "saves_waited_total",
        "counter",
        "saves",
        "saves that waited for the previous background save to finish",
    ),
    _m(
        "save_wait_seconds_total",
        "counter",
        "seconds",
        "time saves waited for the previous background save",
    ),
    _m("save_failures_total", "counter", "saves", "saves that failed (nothing was committed)"),
    _m(
        "after_commit_failures_total",
        "counter",
        "checkpoints",
        "committed checkpoints (valid) whose work after the commit then failed: the retention "
        "pass or queueing the upload",
    ),
    _m("last_saved_step", "gauge", "step", "training step of the newest committed checkpoint"),
    _m(
        "last_save_timestamp_seconds",
        "gauge",
        "unix seconds",
        "when the newest checkpoint was committed (time() - this: age of the newest checkpoint)",
    ),
    # the remote tier
    _m(
        "upload_backlog_checkpoints",
        "gauge",
        "checkpoints",
        "committed checkpoints only local: not yet uploaded to the remote tier",
    ),
    _m("upload_backlog_bytes", "gauge", "bytes", "bytes of the checkpoints only local"),
    _m(
        "upload_lag_seconds",
        "gauge",
        "seconds",
        "age of the oldest checkpoint not yet uploaded (0 when none is waiting)",
    ),
    _m("uploads_total", "counter", "checkpoints", "checkpoints uploaded by this process"),
    _m("upload_bytes_total", "counter", "bytes", "bytes uploaded by this process"),
    _m(
        "upload_consecutive_failures",
        "gauge",
        "attempts",
        "failed upload attempts in a row (0 while the remote store answers)",
    ),
    # restore
    _m("restore_seconds", "gauge", "seconds", "time the last restore took (verify and load)"),
    _m("restored_step", "gauge", "step", "training step the last restore resumed at"),
    _m(
        "restores_total",
        "counter",
        "restores",
        "restores from a checkpoint, by the tier it came from (local, remote)",
        ("tier",),
    ),
    _m(
        "restore_fallbacks_total",
        "counter",
        "checkpoints",
        "newer checkpoints restore skipped, by reason (corrupt, incomplete, remote, unreadable)",
        ("reason",),
    ),
    # preemption
    _m("preemptions_total", "counter", "preemptions", "preemption notices acted on"),
    _m(
        "emergency_saves_total",
        "counter",
        "checkpoints",
        "emergency saves committed (preemption, exception, emergency_save())",
    ),
    # the schedule
    _m("step", "gauge", "step", "the training step last passed to step() or save()"),
    _m(
        "step_seconds",
        "gauge",
        "seconds",
        "median compute time of a training step (recent; per step number)",
    ),
    _m(
        "interval_steps",
        "gauge",
        "steps",
        "steps between periodic saves the policy uses now (adaptive decision or every_n_steps)",
    ),
    _m(
        "interval_seconds",
        "gauge",
        "seconds",
        "compute time between periodic saves the policy uses now (interval_steps x step time)",
    ),
    _m(
        "save_cost_seconds",
        "gauge",
        "seconds",
        "median blocking time of recent saves: the cost C in Young's and Daly's formulas",
    ),
    _m(
        "mtbf_seconds",
        "gauge",
        "seconds",
        "estimated mean time between failures (given, or learned from the restart history)",
    ),
    _m(
        "optimal_interval_seconds",
        "gauge",
        "seconds",
        "Daly's optimum interval for the measured save cost and the estimated MTBF",
    ),
    _m(
        "restarts_total",
        "counter",
        "restarts",
        "resumes of this run after a failure (a process that did not close cleanly); the MTBF "
        "estimate counts each as a failure",
    ),
    # goodput
    _m(
        "useful_seconds",
        "gauge",  # goes down at a resume after a failure: the lost steps no longer count
        "seconds",
        "training compute that counts: steps not lost to a failure, since the run's start "
        "(drops at a resume after a failure)",
    ),
    _m(
        "wall_seconds_total",
        "counter",
        "seconds",
        "wall time since the run's first start, restarts and time down included",
    ),
    _m(
        "goodput_ratio",
        "gauge",
        "ratio",
        "useful_seconds / wall_seconds_total: 1 means no time lost to checkpoints, "
        "failures or restarts",
    ),
)
BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}

# label values are a small fixed set (Prometheus: bounded cardinality)
FALLBACK_REASONS = ("corrupt", "incomplete", "remote", "unreadable")


def fallback_reason(problem: str) -> str:
    """The label of a restore fallback, from the problem restore reported."""
    p = problem.lower()
    if p.startswith("remote copy"):
        return "remote"
    if "missing" in p or "incomplete" in p or "no such file" in p or "size" in p:
        return "incomplete"
    if "checksum" in p or "corrupt" in p or "mismatch" in p:
        return "corrupt"
    return "unreadable"


def flat_key(name: str, labels: tuple[str, ...]) -> str:
    """The key of a sample in a flat dict: ``name``, or ``name/value`` per label value."""
    return "/".join((name, *labels))
