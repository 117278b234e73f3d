"""Two steps of closing a Checkpointer (:mod:`.closing`): waiting for the files retention
removed to be deleted, and the warning of a ``keep_best`` whose metric no save reported.

Which ranks call what: every rank calls :func:`empty_trash` (each has its own trash bin, empty
but the coordinator's); :func:`warn_unmonitored` acts on the coordinator only."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from . import catalog
from .catalog import Depth

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
