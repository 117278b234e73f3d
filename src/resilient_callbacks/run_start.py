"""The start of a run where a restore loads nothing from the directory: a fresh start (or,
with ``resume="auto"``, going on as a run whose last process died before its first save), and
``continued_from`` (a checkpoint loaded elsewhere: the run starts at its step).

``RunStart`` is a base class of :class:`~.restoring.Restorer`; moved from ``restoring.py``
unchanged. Which ranks call what: every rank calls ``fresh_start`` (one broadcast, with
``resume="auto"`` on a writer: rank 0's reading of the history) and ``continued_from`` (one
broadcast: rank 0's run id, the run it goes on, a newer checkpoint it skips, said on every
rank); the coordinator alone writes the history.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from . import dist, history, notices
from .config import ResumeMode
from .errors import CheckpointError, error_type
from .manifest import read_manifest
from .reader import current
from .saving import choose_run_id

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")


class RunStart:
    """A run's start without a checkpoint of the directory loaded (a base class of
    :class:`~.restoring.Restorer`, which sets ``_ck``)."""

    _ck: Checkpointer

    def fresh_start(self) -> None:
        """Every rank: nothing to resume from. With ``resume="auto"``, a run whose last process
        died before its first save (the history has its start, no save and no clean end) goes
        on as that run: its wall time from its start, this restart a failure (the report, the
        metrics and the MTBF estimate count it). Otherwise a new run starts now."""
        ck = self._ck
        ck._trigger.clock.reset()
        unsaved = None
        if ck._dir.run_id is not None:  # this process started the run: a restore() again
            return
        if ck.config.resume == ResumeMode.AUTO and not ck.config.read_only:
            if ck.is_coordinator:
                unsaved = history.unsaved_run(ck.dirpath)
            unsaved = dist.broadcast_json(unsaved)
        if unsaved is None:
            ck._start_run(0)
            return
        run_id, start, restarts, down = unsaved
        ck._dir.run_id = run_id
        if ck.is_coordinator:
            ck._dir.record("restart", 0, useful_s=0.0, saved=False)
            log.warning(
                "%s: the run's last process (started %s) ended before its first checkpoint; "
                "starting it again from the beginning (restart %d of the run)",
                ck.dirpath,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)),
                len(restarts),
            )
        ck._recorder.continued_unsaved(start, restarts, down)
        ck._trigger.clock.reset(restarts[-1] - start - down)  # every_seconds: its time ran

    def continued_from(self, step: int, source: str, same_run: bool = False) -> None:
        """Every rank (see ``Checkpointer.continued_from``): start this run at ``step`` of a
        checkpoint loaded elsewhere. With ``same_run``, the run goes on as the one of the
        newest valid checkpoint in dirpath. Every rank makes one broadcast here (rank 0's:
        that run, a new run's id, a newer valid checkpoint it skips, or its error reading
        dirpath, which every rank raises), and says that newer one: with ``-W error`` every
        rank raises it. Said or raised by rank 0 alone, it stopped rank 0 while the others
        waited for it in their next collective."""
        ck = self._ck
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be an int >= 0, got {step!r}")
        told: list[Any] | None = None
        new, pending = ck._dir.run_id is None, None
        if ck.is_coordinator:
            try:
                p = ck._dir.latest_valid() if same_run and new else None
                m = read_manifest(p) if p else None
                newer = current(ck._dir.checkpoints(), same_run)  # (not an abandoned branch)
                said = notices.newer_skipped(ck.dirpath, newer, step, source)
                run = [m.run_id, m.seq, m.lineage] if m else [None] * 3
                told = [choose_run_id(), run, said, None]
            except Exception as e:  # reported to every rank, so none is left waiting
                pending, told = e, [None, [None] * 3, None, [type(e).__name__, str(e)]]
        run_id, (run, seq, line), said, error = dist.broadcast_json(told)
        if pending is not None:
            raise pending
        if error is not None:
            t = error_type(error[0])  # (its name said once: in the text where it differs)
            why = error[1] if t.__name__ == error[0] else f"{error[0]}: {error[1]}"
            raise t(
                f"continued_from() stopped on every rank: rank 0 could not read {ck.dirpath} "
                f"({why}); nothing was recorded. Make it readable to this job and start it again."
            )
        if same_run and new:
            ck._dir.run_id = run
            ck._dir.tip.rebase(seq, line)  # its saves descend from it, as does its lineage
        # after a restore() that found nothing, before any save: the run goes on from ``step``
        fresh = ck.restored_from is None and ck.last_saved_step is None
        if ck._dir.run_id is not None and not (fresh and ck._saver.committed_saves == 0):
            raise CheckpointError(
                f"continued_from({step}, {source!r}) comes after this Checkpointer restored or "
                "saved a checkpoint: call it instead of restore(), or right after a restore() "
                "that returned 0, before the first save"
            )
        if said is not None:
            notices.say_once(log, said)
        ck._trigger.clock.reset()
        if ck._dir.run_id is None:
            ck._start_run(step, run_id=run_id, source=source)
            return
        ck._recorder.started(step)  # the run's clock and schedule start again here
        if ck.is_coordinator:  # the report moves this life's start to ``step``
            ck._dir.record("continued", step, source=source)
