"""Steps of closing a Checkpointer (:mod:`.closing`, which re-exports the public ones): waiting
for the files retention removed to be deleted, the warning of a ``keep_best`` whose metric no
save reported, the release of a construction that failed part-way, the check that a
Checkpointer is open, marking training as failed, and a ``with`` block's close.

Which ranks call what: every rank calls :func:`empty_trash` (each has its own trash bin, empty
but the coordinator's); :func:`warn_unmonitored` acts on the coordinator only;
:func:`say_after_commit` on the process that did the work after the commits (rank 0; in
node-local mode each node's leader). No collective."""

from __future__ import annotations

import atexit
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import catalog, dist
from .catalog import Depth
from .errors import CheckpointError, ConfigError
from .nodelocal import NodeDirectory

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")


def empty_trash(ck: Checkpointer, timeout: float | None) -> None:
    """Wait for the files of checkpoints retention removed to be deleted (see
    :mod:`.trash`), so a run that ends leaves no hidden copies; say so when it takes long."""
    trash = ck._dir.trash
    if not trash.pending:
        return
    t0 = time.perf_counter()
    done = trash.wait(timeout)
    waited = time.perf_counter() - t0
    if not done:
        # a preempted process does not wait for disk space it will not use (emergency.py):
        # expected, and its restart sweeps the rest; a close(timeout) of a run that may not
        # come back leaves hidden copies behind, which is worth a warning
        log.log(
            logging.INFO if trash.abandoned else logging.WARNING,
            "close(): the files of %d checkpoint(s) retention removed were still being deleted "
            "%s; the next writer of %s removes what is left (.trash-*)",
            trash.pending,
            "as the preempted process exits" if trash.abandoned else f"after {waited:.1f} s",
            ck.dirpath,
        )
    elif waited >= 0.5:
        log.info("close(): deleting the files of older checkpoints took %.2f s more", waited)


def warn_unmonitored(ck: Checkpointer) -> None:
    """Coordinator: keep_best asked for a metric that no save of this run reported."""
    cfg, saver = ck.config, ck._saver
    monitor = cfg.monitor
    if not (ck.is_coordinator and cfg.keep_best and monitor and saver.committed_saves):
        return
    if monitor in saver.metric_names:
        return
    try:  # a process resumed late in the run may not reach the next evaluation: look further
        mine = [
            e.manifest
            for e in catalog.scan(ck.dirpath, Depth.NONE)
            if e.manifest is not None and e.manifest.run_id == ck._dir.run_id
        ]
    except OSError:
        return
    if any(m.metrics.get(monitor) is not None for m in mine):
        return
    log.warning(
        "keep_best=%d, monitor=%r: none of this run's %d checkpoint(s) in %s reported %r "
        "(the metrics saved: %s), so none was kept as the best. Pass it with the saves "
        "(metrics={%r: ...}); with a framework, log it before the save that should carry it.",
        cfg.keep_best,
        monitor,
        len(mine),
        ck.dirpath,
        monitor,
        ", ".join(sorted(saver.metric_names)) or "none",
        monitor,
    )


def say_after_commit(ck: Checkpointer) -> None:
    """The work after the commit of the run's newest checkpoint (its retention pass, queueing
    its upload) failed, said then by the process that did it: said again at close, as an
    ERROR (an upload not queued leaves the run's last state on this disk only, and a job's log
    must show it at its end); close does not raise for it (:mod:`.after_commit_work`)."""
    failed = ck._recorder.after_commit_error
    d = ck._dir
    if failed is None or not (
        d.topology.is_leader if isinstance(d, NodeDirectory) else ck.is_coordinator
    ):
        return
    log.error(
        "close(): the work after the commit of the newest checkpoint (step %d) failed, and no "
        "commit after it tried again. What was said then: %s",
        *failed,
    )


def release_unopened(ck: Checkpointer) -> None:
    """A construction that failed part-way (a KeyboardInterrupt, an error after the directory
    was opened): stop what it started and release the lock. The half-built Checkpointer, which
    no one can close, stayed alive in the exception's traceback (a notebook keeps the last
    one) with the directory locked ("this process already has a writer open") and its
    background thread running. Never raises: the construction's error propagates."""
    ck._closed = True
    parts = vars(ck)
    steps: list[Callable[[], object]] = []
    if parts.get("_at_exit") is not None:
        steps.append(functools.partial(atexit.unregister, parts["_at_exit"]))
    if "telemetry" in parts:
        steps.append(functools.partial(parts["telemetry"].close, timeout=0.0))
    if "_saver" in parts:
        steps.append(parts["_saver"].release)
        if parts["_saver"].persister is not None:
            steps.append(functools.partial(parts["_saver"].persister.stop, join_s=0.0))
    if "_dir" in parts:
        d = parts["_dir"]
        steps.append(d.trash.stop)
        steps.append(d.release if isinstance(d, NodeDirectory) else d.release_opened)
    for step in steps:
        try:
            step()
        except Exception as e:  # (best effort: the rest is still released)
            log.debug("releasing a Checkpointer whose construction failed: %s", e)
    ck._released = True  # (__del__: nothing more to do)


def check_open(ck: Checkpointer, writes: bool = False) -> None:
    """Raise unless ``ck`` may be used (``writes``: to save): not closed, and not read-only."""
    if ck._closed:
        raise CheckpointError("this Checkpointer is closed; create a new one to save again")
    dist.check_same_world(ck.world_size, ck.dirpath)
    if writes and ck.config.read_only:
        raise ConfigError(f"this Checkpointer of {ck.dirpath} is read_only: it never saves")


def failing(ck: Checkpointer, exc: BaseException) -> None:
    """Training failed with ``exc`` (``abort``, an adapter's exception hook, an exception no
    one caught at exit): the history records a failure with its name, not an end; a signal
    that came meanwhile is said so at close, with what the message tells. Never raises: an
    exception whose ``str()`` fails must still get its emergency save, and the close."""
    ck.failed_with = type(exc).__name__
    try:
        ck.failed_detail = str(exc)
    except Exception:  # a broken __str__ (an attribute it reads was never set)
        ck.failed_detail = ""


def clean_exit(exc: BaseException) -> bool:
    """Whether ``exc`` ends the process with status 0 (``sys.exit()``, ``sys.exit(0)``): no
    failure, so close()'s error (uploads given up, a failed background save) is raised, not
    logged beside it and lost to a success status."""
    return isinstance(exc, SystemExit) and exc.code in (0, None)


def close_on_exit(close: Callable[[], None], exc: object) -> None:
    """A ``with`` block's end: ``close()``; while the exception ``exc`` propagates, a failure of
    the close is logged, never raised in its place (the user's error is the one to see), unless
    ``exc`` is a :func:`clean_exit` (the close's error is raised: no success status)."""
    try:
        close()
    except Exception as e:
        if exc is None or (isinstance(exc, BaseException) and clean_exit(exc)):
            raise
        log.error("closing after %s failed: %s", type(exc).__name__, e)
