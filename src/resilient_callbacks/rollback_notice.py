"""A roll-back the run's last process made and did not keep: said when ``resume="auto"`` undoes it.

A process that resumes from an older checkpoint on purpose (``resume=40`` while 50 and 60
exist) starts a new branch only with its first save (:mod:`.branches`). Killed before that save
(or with it still in flight), it leaves no checkpoint of the branch, only its ``restart``
record in the history; the next ``resume="auto"`` restores the newest commit, 60, the timeline
the user rolled back from. That is the rule ("newest committed"): 60 is the newest valid state
and nothing newer exists, and a later re-run cannot tell an intended roll-back from an
inspection that was abandoned. But it must not happen in silence, so :func:`notice` words a
:class:`~.errors.ResumeFallbackWarning` for it.

Coordinator only (reads the history); pure otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

from . import history
from .errors import AT_CALLER, ResumeFallbackWarning, warn_and_log

log = logging.getLogger("resilient_callbacks")


def resume_field(resume: Any) -> Any:
    """``resume`` as the ``restart`` record keeps it (JSON: a step, "auto", a path)."""
    return resume if type(resume) is int else str(getattr(resume, "value", resume))


def notice(root: str, run_id: str | None, step: int, seq: int) -> str | None:
    """The warning for an automatic resume about to load the checkpoint ``step`` (commit number
    ``seq``) of the run ``run_id``, or None: said only when the last life of that run (its last
    ``start`` or ``restart`` record) restarted from an older step and committed no checkpoint
    after that (no ``save`` record of the run after it, and the one loaded now was committed
    before it: ``seq`` not above the record's ``top``, the newest commit number then). A plain
    crash-resume (a restart at the newest step) is never named."""
    if run_id is None:
        return None
    recs = [
        r for r in history.records(root, ("start", "restart", "save")) if r.get("run_id") == run_id
    ]
    lives = [i for i, r in enumerate(recs) if r["event"] in history.LIFECYCLE]
    if not lives:
        return None
    last = recs[lives[-1]]
    back = last.get("step")
    if last["event"] != "restart" or type(back) is not int or back >= step:
        return None
    if any(r["event"] == "save" for r in recs[lives[-1] + 1 :]):
        return None
    top = last.get("top")  # the newest commit number when it restarted
    if type(top) is not int:
        return None  # a restart that restored nothing (a run started again from step 0)
    if seq > top:
        return None  # committed after the roll-back (its save record lost): its branch
    resume = last.get("resume")
    how = f"resume={resume!r}" if resume not in (None, "auto") else "a fallback"
    return (
        f"the last process of this run rolled back to step {back} ({how}) and stopped before "
        f"its first save; restoring {step}, the newest: pass resume={back} to roll back again"
    )


def on_restart(ck: Any, manifest: Any, fields: dict[str, Any], inside: bool) -> str | None:
    """Every rank, at a restore: on the coordinator, at the process's first restore of a
    checkpoint ``inside`` the directory of the Checkpointer ``ck``, adds what a later
    :func:`notice` needs to the ``restart`` record's ``fields`` (``resume``, the newest commit
    number ``top``) and returns the notice for this restore when ``resume`` is "auto"; None
    otherwise (a restore again in the process is a roll-back: a ``restore`` record)."""
    if not (ck.is_coordinator and inside) or ck._recorder.began:
        return None
    resume = resume_field(ck.config.resume)
    fields.update(resume=resume, top=ck._dir.seq)
    if resume != "auto" or ck.config.read_only:  # (read-only: a writer may be running)
        return None
    return notice(ck.dirpath, manifest.run_id, manifest.step, manifest.seq)


def say(note: str | None, coordinator: bool) -> None:
    """Every rank: the notice (if any) as a warning on the coordinator, logged on every rank."""
    if note:
        warn_and_log(log, note, ResumeFallbackWarning, stacklevel=AT_CALLER, warn=coordinator)
