"""Restore: the candidates across the local and the remote tier, best first, and loading the
first one every rank can read, falling back loudly past damaged ones.

Which ranks call what: every rank calls :meth:`Restorer.restore`. Rank 0 lists the candidates
(it alone reads the directory and the remote tier) and broadcasts them; a remote candidate is
downloaded and verified by rank 0 into the directory. Every rank reads and verifies the files
*it* needs, and the ranks agree (one gather) before anything is loaded: a problem on any rank
skips the candidate on every rank, with a :class:`~.errors.ResumeFallbackWarning` naming what was
skipped and why. No valid checkpoint where some exist is an error, never a silent fresh start.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from . import (
    catalog,
    dist,
    fit,
    gcpause,
    history,
    inplace,
    layout,
    nodelocal,
    notices,
    restore_remote,
    rng,
    rollback_notice,
    statetree,
    structure,
)
from .candidates import (
    Candidate,
    merge_tiers,
    number_after_remote,
    repair_hint,
    tried_as,
    warn_abandoned,
)
from .catalog import Depth, Status, lineage_of
from .commit import CKPT_RE
from .config import ResumeMode, missing_resume_hint
from .errors import (
    AT_CALLER,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigError,
    ForeignCheckpointsWarning,
    NoValidCheckpointError,
    ResumeFallbackWarning,
    error_type,
    warn_and_log,
)
from .filepart import PartReader
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .part_reads import part_info, read_part_files
from .reader import current
from .restore_report import RestoreReport
from .retention import RetentionPolicy
from .saving import choose_run_id

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")

RELIST = 3  # times a restore lists the directory again when checkpoints went while it read
GONE = "deleted while being read"


class Restorer:
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
            raise error_type(msg["error"]["type"])(msg["error"]["msg"])
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

    def continued_from(self, step: int, source: str, same_run: bool = False) -> None:
        """Every rank (see ``Checkpointer.continued_from``): start this run at ``step`` of a
        checkpoint loaded elsewhere. With ``same_run``, the run goes on as the one of the
        newest valid checkpoint in dirpath. Every rank makes one broadcast here (rank 0's:
        that run, a new run's id, a newer valid checkpoint it skips), and says that newer
        one: with ``-W error`` every rank raises it. Said by rank 0 alone, it stopped rank 0
        while the others waited for it in their next collective."""
        ck = self._ck
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be an int >= 0, got {step!r}")
        told, new = None, ck._dir.run_id is None
        if ck.is_coordinator:
            m = read_manifest(p) if same_run and new and (p := ck._dir.latest_valid()) else None
            newer = current(ck._dir.checkpoints(), same_run)  # (not an abandoned branch)
            said = notices.newer_skipped(ck.dirpath, newer, step, source)
            told = [choose_run_id(), [m.run_id, m.seq, m.lineage] if m else [None] * 3, said]
        run_id, (run, seq, line), said = dist.broadcast_json(told)
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

    def _warn_fallback(self, c: Candidate, problem: str) -> None:
        if c.remote is None and c.path is not None and GONE not in problem:  # kept, to inspect
            self._ck._dir.found_corrupt.add(os.path.basename(c.path))
        self._ck._recorder.fallback(c.step, c.where, problem)
        self._say_fallback(c, problem)

    def _say_fallback(self, c: Candidate, problem: str) -> None:
        then = "falling back to an older checkpoint"
        if c.remote is None and c.key is not None and c.key in self._remote_copies:
            then = "trying its copy in the remote tier next"
        msg = f"skipping checkpoint {c.where} (step {c.step}): {problem}; {then}"
        coordinator = self._ck.is_coordinator
        warn_and_log(log, msg, ResumeFallbackWarning, stacklevel=AT_CALLER, warn=coordinator)

    def _try_load(self, c: Candidate, state: Any, explicit: bool, skipped: list[str]) -> int | None:
        ck = self._ck
        path = c.path
        assert path is not None
        part, full, problem, refusal, decoded = None, None, None, None, {}  # type: ignore[var-annotated]
        fileparts = statetree.fileparts(state)
        readers: dict[str, PartReader] = {}
        try:
            manifest = read_manifest(path)
            part = layout.read_part(path, manifest, ck.rank, statetree.rank0_for_new_ranks(state))
            # Every value decodes and the RNG states apply, before anything is loaded: content
            # that does not (written by something else, or tampered with) is corrupt, and the
            # restore falls back with nothing overwritten.
            full = structure.inline_per_rank(part.structure, part.per_rank)
            structure.decode(full, part.tensors, memo=decoded)  # (loaded from, not decoded again)
            if ck.config.capture_rng and part.rng is not None:
                rng.check(part.rng, part.tensors)
            for pid, fp in fileparts.items():  # each part's files, verified before any load
                info = part_info(pid, manifest, ck.rank, ck.world_size, ck.config.read_only)
                if info.listed:  # none: a checkpoint without this part (check_fits says so)
                    readers[pid] = read_part_files(path, manifest, fp, info)
        except CheckpointMismatchError as e:  # a part refuses this checkpoint: no fallback
            refusal = str(e)
        except (CheckpointCorruptError, OSError) as e:  # (or another node's files: it says)
            problem = nodelocal.other_nodes_files(path, ck.rank) or str(e)
        except Exception as e:  # malformed content: as corrupt; every rank must reach the gather
            problem = f"unreadable checkpoint ({type(e).__name__}: {e})"
        if problem is not None and not os.path.exists(os.path.join(path, MANIFEST_NAME)):
            problem = f"{GONE} ({problem})"  # by a writer's retention, as this rank read it
        gathered = dist.all_gather_json([problem, refusal])
        refused = [f"rank {r}: {x}" for r, (_, x) in enumerate(gathered) if x]
        if refused:  # agreed: every rank raises, nothing was loaded
            raise CheckpointMismatchError(
                f"cannot resume from {path} (step {c.step}): {'; '.join(refused)}"
            )
        problems = [p for p, _ in gathered]
        bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
        if bad:
            why = "; ".join(bad)
            skipped.append(f"{path} (step {c.step}): {why}")
            if explicit:
                raise CheckpointCorruptError(f"cannot resume from {path}: {why}")
            self._warn_fallback(c, why)
            return None
        assert part is not None and full is not None
        local_exc: BaseException | None = None
        warns: list[str] = []
        once: list[str] = []  # notices the same on every rank: said once, on rank 0 (notices.py)
        mine = ck.config.capture_rng and part.rng is not None  # (this rank's are restored)
        try:
            meta = {
                k: (str(t.dtype).removeprefix("torch."), list(t.shape))
                for k, t in part.tensors.items()
            }
            fit.check_fits(state, full, meta, ck.config.read_only, ck.restore_advice.through)
            # objects that keep what they load get private copies (mapped.py)
            inplace.apply(
                state,
                full,
                lambda n: structure.decode(n, part.tensors, memo=decoded),
                ck.restore_advice,
                coordinator=ck.is_coordinator,
                rollback=ck._recorder.began and not ck.config.read_only,  # restore() again
            )
            for pid, fp in fileparts.items():
                if pid not in readers:
                    raise CheckpointMismatchError(f"the checkpoint holds no files of part {pid!r}")
                fp.load(readers[pid])
            if ck.config.capture_rng:
                warns, once = rng.restore_saved(
                    part.rng, part.tensors, ck.rank, manifest.world_size
                )
            warns = warns + ck.load_notices()  # (an adapter's, about this rank: as the RNG's)
        except Exception as e:
            local_exc = e
        local_exc = local_exc or notices.first_raising(warns)  # (-W error: every rank stops)
        failure = None if local_exc is None else f"{type(local_exc).__name__}: {local_exc}"
        # (and whether the ranks gone's state is dropped: any rank's part tells)
        gathered = dist.all_gather_json([failure, mine, bool(part.per_rank)])
        errors = [e for e, *_ in gathered]
        if any(errors):
            if local_exc is not None:
                raise local_exc
            first = next(r for r, e in enumerate(errors) if e)
            raise CheckpointMismatchError(f"restore failed on rank {first}: {errors[first]}")
        for w in warns:
            warn_and_log(log, w, UserWarning, stacklevel=AT_CALLER)
        per_rank, rngs = any(g[2] for g in gathered), any(g[1] for g in gathered)
        once += structure.gone_state(ck.world_size, manifest.world_size, per_rank, rngs)
        once += rng.replacing(ck, ck.dirpath, manifest.step) if mine else []
        for said in once:  # (INFO on the other ranks; said once every rank restored)
            warn_and_log(log, said, UserWarning, stacklevel=AT_CALLER, warn=ck.is_coordinator)
        self._restored(path, manifest)
        return manifest.step

    def _restored(self, path: str, manifest: Manifest) -> None:
        """Every rank, once ``path`` is loaded: carry on the run it belongs to (if it is in the
        directory), its schedule's measurements and the retention a crash interrupted."""
        ck, d = self._ck, self._ck._dir
        parent = os.path.dirname(os.path.abspath(path))  # (spelled through a link, maybe)
        inside = parent == ck.dirpath or os.path.realpath(parent) == os.path.realpath(ck.dirpath)
        d.run_id, d.restored = (manifest.run_id, os.path.basename(path)) if inside else (None, None)
        d.restored_copy.restored((manifest.run_id, manifest.seq) if inside else None)
        d.tip.rebase(*((manifest.seq, lineage_of(ck.dirpath, manifest)) if inside else (None,)))
        ck.last_saved_step = manifest.step if inside else None
        ck.restored_from = path
        ck._trigger.mark(manifest.step)
        ck._trigger.restored()
        ck._saver.forget_unchanged()  # the live tensors were just written
        if inside and ck._saver.part_blobs is not None:
            ck._saver.part_blobs.restored(manifest)  # its blobs stay until the next commit
        schedule, saved_schedule = ck.schedule, manifest.extra.get("schedule")
        if schedule is not None and inside and isinstance(saved_schedule, dict):
            try:
                schedule.load_state_dict(saved_schedule)
            except Exception as e:  # measurements only: start measuring afresh
                log.warning("could not restore the adaptive schedule's measurements: %s", e)
        fields = ck._recorder.restored(
            manifest, inside, time.perf_counter() - self._t0, self._tier, self._skipped
        )
        note = rollback_notice.on_restart(ck, manifest, fields, inside)  # (the coordinator's)
        life, foreign = inside and not ck._recorder.began, []  # a restart (not a roll-back)
        if ck.is_coordinator and inside:
            # a resume (the run stopped early), or this process's roll-back: not a new life
            d.record("restore" if ck._recorder.began else "restart", manifest.step, **fields)
            ck._recorder.record_deferred()  # the fallbacks on the way to this checkpoint
            foreign = d.check_foreign()  # (said by every rank, below)
        lineage = None  # every rank: the run's start, restarts, time down, run since the save
        if ck.is_coordinator:
            lines = history.read_lines(ck.dirpath)  # (once: both read the whole history)
            ran = history.running_since_save(ck.dirpath, d.run_id, lines=lines) if life else 0.0
            lineage = [*history.lineage(ck.dirpath, d.run_id, lines=lines), note, ran, foreign]
        start, restarts, down, note, ran, foreign = dist.broadcast_json(lineage)
        for said in foreign:  # (rank 0's listing: -W error stops every rank)
            notices.say_once(notices.log, said, ForeignCheckpointsWarning)
        ck._trigger.clock.reset(ran)
        rollback_notice.say(note, ck.is_coordinator)
        ck._recorder.lineage(manifest, inside, start, restarts, down)  # (and the schedule's)
        if ck.is_coordinator and inside and d.sync is not None:
            restore_remote.reconcile_uploads(ck)
        if ck.is_coordinator and inside and ck.config.resume == ResumeMode.AUTO:
            # Catch up on a retention pass a crash interrupted (killed between commit and
            # deletion), so repeated crashes cannot pile up checkpoints beyond the limits: the
            # pass of the policy the run had (recorded in the checkpoint), not of this
            # process's options (an evaluation that opens the directory with keep_last=1 and
            # only restores deleted the best and archive checkpoints); its saves apply those.
            self._catch_up(path, manifest)
        log.info("restored step %d from %s", manifest.step, path)

    def _catch_up(self, path: str, manifest: Manifest) -> None:
        """The retention pass after a restore (see :meth:`_restored`)."""
        self._ck._dir.apply_retention(protect=os.path.basename(path), policy=_recorded(manifest))

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


def _recorded(manifest: Manifest) -> RetentionPolicy | None:
    """The retention policy a checkpoint recorded (None: none, or one this version rejects)."""
    try:
        return RetentionPolicy.from_json(manifest.retention) if manifest.retention else None
    except (ConfigError, TypeError):
        return None
