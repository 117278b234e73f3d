"""Loading one restore candidate: read and verify on every rank, agree, load, then carry on
the run it belongs to; and the loud fallback past a candidate that cannot be loaded.

``CandidateLoader`` is a base class of :class:`~.restoring.Restorer` (which chooses the
candidates and their order, and tries them in turn through :meth:`CandidateLoader._try_load`);
moved from ``restoring.py`` unchanged.

Which ranks call what: every rank calls ``_try_load`` for the same candidate. Every rank reads
and verifies the files *it* needs, then the ranks agree (one all-gather) before anything is
loaded: a problem on any rank skips the candidate on every rank (``_warn_fallback``: a
:class:`~.errors.ResumeFallbackWarning` said by rank 0, logged by the others), a part's refusal
raises on every rank. After the load a second all-gather tells every rank whether any failed,
so all raise or none. ``_restored`` (every rank) makes one broadcast (rank 0's history of the
run); the coordinator alone writes the history, reconciles the uploads and catches up on
retention.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from . import (
    dist,
    fit,
    history,
    inplace,
    layout,
    node_files,
    notices,
    restore_remote,
    rng,
    rollback_notice,
    state_marks,
    statetree,
    structure_decode,
)
from .candidates import Candidate
from .catalog import lineage_of
from .config import ResumeMode
from .errors import (
    AT_CALLER,
    CheckpointCorruptError,
    CheckpointMismatchError,
    ConfigError,
    ForeignCheckpointsWarning,
    ResumeFallbackWarning,
    warn_and_log,
)
from .filepart import PartReader
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .part_reads import part_info, read_part_files
from .retention import RetentionPolicy

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")

GONE = "deleted while being read"


class CandidateLoader:
    """Loading one candidate into the state, on every rank, and the loud fallback past one
    that cannot be (a base class of :class:`~.restoring.Restorer`, which sets these)."""

    _ck: Checkpointer
    _t0: float  # the restore being made: its start, tier, checkpoints skipped
    _tier: str
    _skipped: int
    _remote_copies: set[tuple[str, int] | None]  # keys with a remote candidate

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
            full = structure_decode.inline_per_rank(part.structure, part.per_rank)
            # (the values decoded here are the ones loaded, not decoded again)
            structure_decode.decode(full, part.tensors, memo=decoded)
            if ck.config.capture_rng and part.rng is not None:
                rng.check(part.rng, part.tensors)
            for pid, fp in fileparts.items():  # each part's files, verified before any load
                info = part_info(pid, manifest, ck.rank, ck.world_size, ck.config.read_only)
                if info.listed:  # none: a checkpoint without this part (check_fits says so)
                    readers[pid] = read_part_files(path, manifest, fp, info)
        except CheckpointMismatchError as e:  # a part refuses this checkpoint: no fallback
            refusal = str(e)
        except (CheckpointCorruptError, OSError) as e:  # (or another node's files: it says)
            problem = node_files.other_nodes_files(path, ck.rank) or str(e)
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
                lambda n: structure_decode.decode(n, part.tensors, memo=decoded),
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
        # (and the ranks gone's PerRank parts: any rank's part tells)
        held = sorted(part.per_rank) if part is not None else []
        gathered = dist.all_gather_json([failure, mine, held])
        errors = [e for e, *_ in gathered]
        if any(errors):
            if local_exc is not None:
                raise local_exc
            first = next(r for r, e in enumerate(errors) if e)
            raise CheckpointMismatchError(f"restore failed on rank {first}: {errors[first]}")
        for w in warns:
            warn_and_log(log, w, UserWarning, stacklevel=AT_CALLER)
        fewer = manifest.world_size > ck.world_size
        parts, notes = _stand_ins(state, {p for g in gathered for p in g[2]} if fewer else set())
        rngs = any(g[1] for g in gathered)
        gone, taken = state_marks.gone_state(ck.world_size, manifest.world_size, parts, rngs, notes)
        once += gone
        for said in taken if ck.is_coordinator else []:  # (nothing lost: no warning)
            log.info("%s", said)
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


def _recorded(manifest: Manifest) -> RetentionPolicy | None:
    """The retention policy a checkpoint recorded (None: none, or one this version rejects)."""
    try:
        return RetentionPolicy.from_json(manifest.retention) if manifest.retention else None
    except (ConfigError, TypeError):
        return None


def _stand_ins(state: Any, ids: set[str]) -> tuple[dict[str, str], dict[str, str]]:
    """For :func:`.state_marks.gone_state`: each of the checkpoint's ``PerRank`` part ids
    ``ids`` with what stands in here for the state of ranks this run has not; and the
    sentences of the parts that say it themselves (``stand_in_for_gone_ranks``)."""
    from .data import ResumableDataLoader  # (torch.utils.data: only where restored)

    live = statetree.per_rank_parts(state)
    out, notes = {}, {}
    for pid in ids:
        p = live.get(pid)
        leaves = [v for _, v in statetree.leaves(p.obj)] if p is not None else []
        own = getattr(p.obj, "stand_in_for_gone_ranks", None) if p is not None else None
        if callable(own):
            out[pid], notes[pid] = own()
        elif p is not None and p.new_ranks == "rank0":
            out[pid] = state_marks.RANK0
        elif leaves and all(isinstance(v, ResumableDataLoader) for v in leaves):
            out[pid] = state_marks.LOADER
        else:
            out[pid] = state_marks.DROPPED
    return out, notes
