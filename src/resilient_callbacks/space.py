"""Disk-space preflight: warn before a save that will not fit is attempted.

A save writes the new checkpoint before retention deletes the oldest, so the next save needs
about as much free space as the last checkpoint took. A disk that filled up (other jobs' files,
logs, a ``keep_last`` too large for it) was found only when a save failed with ENOSPC, often
at the end of an epoch. Two checks, both comparing the free space of ``dirpath`` with the last
checkpoint's size:

- :func:`after_commit`: called by the first ``step()`` after a commit that saves nothing
  (training goes on), once the commit's retention has freed what it deletes: a warning that
  the *next* save will not fit, a save interval ahead (not after the run's last save: a final
  one, an emergency one (a preemption's, an exception's: the process stops after it), one
  committed once ``close()`` began, or one followed directly by ``close()``);
- :func:`before_write`: before a save writes its first byte, a warning that this save will
  likely fail (what filled the disk since; the first save of a restarted process compares with
  the checkpoint it restored from).

Warnings only: the save is still attempted (its failure is a ``CheckpointWriteError`` with
``errno == ENOSPC``; estimates can be wrong, and a failed save loses nothing).

Which ranks call what: the coordinator (rank 0), which alone applies retention.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable

from .trash import TrashBin

log = logging.getLogger("resilient_callbacks")


def free_bytes(path: str) -> int | None:
    """The free space of the filesystem of ``path`` available to this user; None if unknown."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def checkpoint_size(path: str) -> int | None:
    """The bytes of the files the manifest of the checkpoint ``path`` lists; None if it cannot
    be read (the size of the checkpoint a process restored from: what its first save needs)."""
    from .manifest import read_manifest

    try:
        return sum(f.size for f in read_manifest(path).files)
    except Exception:  # (deleted by hand meanwhile; a restore that read it verified it)
        return None


def before_write(dirpath: str, step: int, free: int, need: int) -> None:
    """Coordinator, before the save of ``step`` writes: warn that ``dirpath`` has ``free``
    bytes, less than ``need`` (the last checkpoint's size)."""
    log.warning(
        "the save of step %d will likely fail: %s has %.1f MB free and the last checkpoint "
        "took %.1f MB. %s",
        step,
        dirpath,
        free / 1e6,
        need / 1e6,
        _HOW,
    )


def after_commit(
    dirpath: str, step: int, need: int, trash: TrashBin, closed: Callable[[], bool]
) -> None:
    """Coordinator, once step ``step`` (``need`` bytes) is committed and training went on:
    once retention's deletions have run (in the trash bin's thread), warn when ``dirpath`` has
    less free space than another checkpoint of that size needs, unless the Checkpointer is
    ``closed()`` by then (its close began: no next save follows)."""

    def check() -> None:
        if closed():
            return
        free = free_bytes(dirpath)
        if free is not None and free < need:
            log.warning(
                "the next save will not fit: %s has %.1f MB free after committing step %d, "
                "which took %.1f MB (a save writes the new checkpoint before retention deletes "
                "the oldest). %s",
                dirpath,
                free / 1e6,
                step,
                need / 1e6,
                _HOW,
            )

    trash.then(check)


_HOW = (
    "Free space on that disk, lower keep_last, or point dirpath at a larger disk; "
    "otherwise the save fails with CheckpointWriteError (ENOSPC), and the checkpoints "
    "committed before it are kept."
)
