"""Restore: the candidates across the local and the remote tier, best first, and loading the
first one every rank can read, falling back loudly past damaged ones.

Which ranks call what: every rank calls :meth:`Restorer.restore`. Rank 0 lists the candidates
(it alone reads the directory and the remote tier) and broadcasts them; a remote candidate is
downloaded and verified by rank 0 into the directory. Every rank reads and verifies the files
*it* needs, and the ranks agree (one gather) before anything is loaded: a problem on any rank
skips the candidate on every rank, with a :class:`~.errors.ResumeFallbackWarning` naming what was
skipped and why. No valid checkpoint where some exist is an error, never a silent fresh start.

This module chooses the candidates and their order and tries them in turn; loading one
candidate (and the fallback past it) is :mod:`.restore_load`'s ``CandidateLoader``, the run's
start where nothing of the directory is loaded (``fresh_start``, ``continued_from``)
:mod:`.run_start`'s ``RunStart``: both base classes of ``Restorer``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from . import catalog, dist, gcpause, notices, restore_remote
from .candidates import (
    Candidate,
    merge_tiers,
    number_after_remote,
    repair_hint,
    tried_as,
    warn_abandoned,
)
from .catalog import Depth, Status
from .commit import CKPT_RE
from .config import ResumeMode, missing_resume_hint
from .errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    NoValidCheckpointError,
    relayed,
)
from .manifest import MANIFEST_NAME, read_manifest
from .restore_load import GONE, CandidateLoader
from .restore_report import RestoreReport
from .run_start import RunStart

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")

RELIST = 3  # times a restore lists the directory again when checkpoints went while it read


class Restorer(RunStart, CandidateLoader):
    """The restore path of one Checkpointer."""

    def __init__(self, ck: Checkpointer) -> None:
        self._ck = ck
        self._t0 = 0.0  # the restore being made: its start, tier, checkpoints skipped
        self._tier = "local"
        self._skipped = 0
        self._remote_copies: set[tuple[str, int] | None] = set()  # keys with a remote candidate
        self._no_manifest: list[str] = []  # step_* folders without a manifest (candidates())

    def restore(self, state: Any) -> int:
        """Every rank: load the checkpoint chosen by ``resume`` into ``state``; return its step
        (0: nothing to resume from). With ``resume="auto"``, checkpoints deleted while they
        were read (the retention of a run writing the directory, beside a read-only
        evaluator) are no damage: the directory is listed again, up to ``RELIST`` times."""
        ck = self._ck
        self._t0 = time.perf_counter()
        self._tier = "local"
        self._skipped, self._mapped_since = 0, notices.mappings_made()  # before: not ours
        cands = self._listed(notes=True)
        relist = RELIST if ck.config.read_only and ck.config.resume == ResumeMode.AUTO else 0
        for _ in range(relist):
            if cands:
                break
            # beside a writer, one listing can miss every checkpoint (the newest not yet renamed
            # in, the one before deleted): an evaluator would score an untrained model
            cands = self._listed(notes=True)
        self._remote_copies = {c.key for c in cands if c.remote is not None}
        explicit = ck.config.resume not in (ResumeMode.AUTO, ResumeMode.NEVER)
        for said in self._notes:  # rank 0's, the same on every rank: -W error stops every rank
            notices.say_once(notices.log, said)
        if not cands:
            self.fresh_start()
            return 0
        skipped: list[str] = []
        tried: set[str] = set()  # local paths and remote names skipped for damage: not again
        for listing in range(RELIST + 1):
            before = len(skipped)
            step = self._first_loaded(cands, state, explicit, skipped, tried)
            if step is not None:
                if skipped and ck.is_coordinator:
                    say_restored_instead(ck, skipped)
                return step
            gone_now = any(GONE in s for s in skipped[before:])  # not damage: list again
            if not gone_now or explicit or listing == RELIST:
                break
            log.info("checkpoints were deleted while being read: listing %s again", ck.dirpath)
            cands = [c for c in self._listed() if tried_as(c) not in tried]
        gone = all(GONE in s for s in skipped)
        again = f" (the directory listed {listing + 1} times)" if listing else ""
        raise NoValidCheckpointError(
            f"none of the {len(skipped)} checkpoint(s) of {ck.dirpath} tried{again} can be "
            "restored:\n  - "
            + "\n  - ".join(skipped)
            + (
                "\nEach was deleted while it was read: another process writes this directory "
                "and its retention keeps few checkpoints; try again, or raise its keep_last."
                if gone
                else "\nRefusing to start from scratch silently. Repair or remove them "
                f"({repair_hint(ck.dirpath, ck.config.remote, ck.config.remote_options, tried)}"
                "), pass resume=<path or step> of a good one, or resume='never'."
            )
        )

    def _listed(self, notes: bool = False) -> list[Candidate]:
        """Every rank: the coordinator's candidates (its error raised on every rank); with
        ``notes``, in ``self._notes`` what to say about the listing (:func:`.listing_notes`)."""
        ck, cands, said, error, pending = self._ck, [], [], None, None
        if ck.is_coordinator:
            try:
                cands = self.candidates()
                if notes and ck.config.resume == ResumeMode.AUTO:  # (said on every rank)
                    nm, self._no_manifest, ro = self._no_manifest, [], ck.config.read_only
                    said = notices.listing_notes(ck.dirpath, nm, not cands, ro, ck.dirpath_given)
            except Exception as e:  # reported to every rank, so none is left waiting
                error, pending = {"type": type(e).__name__, "msg": str(e)}, e
        msg = dist.broadcast_json(
            {"cands": [c.to_json() for c in cands], "error": error, "notes": said}
        )
        self._notes: list[str] = msg["notes"]
        if msg["error"] is not None:
            if pending is not None:
                raise pending
            raise relayed(msg["error"]["type"], msg["error"]["msg"])
        return [Candidate.from_json(c) for c in msg["cands"]]

    def _first_loaded(
        self,
        cands: list[Candidate],
        state: Any,
        explicit: bool,
        skipped: list[str],
        tried: set[str],
    ) -> int | None:
        """Every rank: the step of the first of ``cands`` loaded into ``state``, or None; what
        was skipped is appended to ``skipped`` (damaged local paths to ``tried``). An
        ``explicit`` choice (resume=<step>) fails at its last copy only: a damaged local copy
        of that step is followed, loudly, by its remote copy (remote.md)."""
        ck = self._ck
        for i, c in enumerate(cands):
            strict = explicit and i == len(cands) - 1
            remote_url, as_tried = None, tried_as(c)
            if c.remote and not c.problem:
                remote_url = restore_remote.url_of(ck, c)
                c = restore_remote.fetch(ck, c)
            elif c.remote and c.problem and c.path is None:  # found by the listing: say where
                where = f"remote copy {restore_remote.url_of(ck, c)}"  # (as a download's does)
                c = dataclasses.replace(c, problem=f"{where}: {c.problem}")
            if c.problem:
                skipped.append(f"{c.where} (step {c.step}): {c.problem}")
                if strict:
                    raise c.refused()
                self._warn_fallback(c, c.problem)
                tried.add(as_tried)
                continue
            tier = self._tier = "remote" if remote_url else "local"
            self._skipped = len(skipped)
            with gcpause.paused():  # (its collections walked the whole process: gcpause.py)
                step = self._try_load(c, state, strict, skipped)
            if step is not None:
                assert c.path is not None
                notices.warn_if_still_mapped(c.path, self._mapped_since)
                if c.abandoned and not explicit:  # loudly: the run's timeline changes
                    lineage = [f"{x.where} (step {x.step})" for x in cands if not x.abandoned]
                    warn_abandoned(c, lineage, ck.is_coordinator)
                ck.last_restore = RestoreReport(c.path, step, tier, remote_url, tuple(skipped))
                return step
            if not (skipped and GONE in skipped[-1]):
                tried.add(as_tried)
        return None

    # ------------------------------------------------------------------ candidates (rank 0)

    def candidates(self) -> list[Candidate]:
        """Coordinator: the checkpoints to try, best first, each with a size-level problem."""
        ck = self._ck
        r = ck.config.resume
        if r == ResumeMode.NEVER:
            number_after_remote(self._ck._dir)
            return []
        if isinstance(r, str) and r != ResumeMode.AUTO:
            number_after_remote(self._ck._dir)
            path = ck.config.resume_path  # (resolved with dirpath, when the config was made)
            assert path is not None
            if not os.path.exists(path):
                hint = missing_resume_hint(r, ck.dirpath)
                raise CheckpointNotFoundError(f"resume={r!r}: no checkpoint at {path}{hint}")
            if not os.path.exists(os.path.join(path, MANIFEST_NAME)):
                raise CheckpointNotFoundError(
                    f"resume={r!r}: {path} has no {MANIFEST_NAME}, so it is not a committed "
                    "checkpoint (pass a step_* directory written by resilient_callbacks)"
                )
            m = read_manifest(path)
            problem = None
            try:
                catalog.verify(path, m, Depth.SIZE)
            except CheckpointCorruptError as e:
                problem = str(e)
            return [Candidate(path, m.step, problem)]
        entries = catalog.scan(ck.dirpath, Depth.SIZE)  # the listing `inspect` reads
        found = catalog.committed(entries)
        self._no_manifest = [
            e.name for e in entries if e.status is Status.INCOMPLETE and CKPT_RE.match(e.name)
        ]
        # an unreadable manifest has no commit number: maybe the newest, so tried (and named) first
        cands = [Candidate.of(e) for e in found if e.manifest is None]
        cands += merge_tiers(self._ck._dir, [e for e in found if e.manifest is not None])
        if isinstance(r, int):
            chosen = [c for c in cands if c.step == r]
            if not chosen:
                have = sorted({c.step for c in cands if c.step is not None})
                d, ms = ck._dir, [e.manifest for e in found if e.manifest is not None]
                where = ck.dirpath + (f" or {d.remote.url}" if d.remote else "")
                raise CheckpointNotFoundError(
                    f"resume={r}: no checkpoint of step {r} in {where} (steps present: "
                    f"{have or 'none'}){'' if d.remote else notices.remote_tier_hint(ms, r)}"
                )
            # the newest checkpoint of that step (one with a readable manifest), and its other copy
            key = next((c.key for c in chosen if c.key is not None), None)
            cands = [c for c in chosen if key is not None and c.key == key] or chosen[:1]
        return cands


def say_restored_instead(ck: Checkpointer, skipped: list[str]) -> None:
    """Coordinator, after a restore that skipped newer checkpoints: say which one it loaded.
    Each skip was warned about as it happened ("falling back to an older checkpoint"); without
    this line a plain loop's log never named the checkpoint the run went on from."""
    rep = ck.last_restore
    if rep is None:
        return
    names = ", ".join(s.split(" (step ")[0].rsplit("/", 1)[-1] for s in skipped)
    log.warning(
        "resumed at step %d from %s (%s) instead of the %d newer checkpoint(s) skipped as "
        "said above (%s): the steps after %d are trained again",
        rep.step,
        rep.path,
        f"remote copy {rep.remote_url}" if rep.tier == "remote" else "local copy",
        len(skipped),
        names,
        rep.step,
    )
