"""The background half of one save: write this rank's part into the staging directory, commit it
through a :class:`~.session.CommitSession` (a :class:`~.node_session.NodeLocalSession` in
node-local mode), then record what was committed.

Which ranks call what: every rank runs :func:`persist` for every save, at the same step: in the
:class:`~.saving.Saver`'s background thread for a background save (collectives on the
checkpoint's own gloo group), on the training thread for a synchronous one. Every rank writes
its own part (the coordinator, or each node's leader, also the replicated ``shared.*`` files)
and its FileParts' files; the session gathers every rank's report, commits on rank 0 and raises
:class:`~.errors.CheckpointWriteError` on every rank if any failed. A rank whose prepare step
failed takes part all the same in a synchronous save (``local_exc``), so every rank learns of
it and nothing is committed (a background save's ranks learn it before: :mod:`.held_failures`).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import dist, layout, space, structure, structure_layout
from .blobs import BlobSession
from .errors import CheckpointError, CheckpointWriteError, UnsupportedStateError
from .filepart import CapturedParts
from .node_session import NodeLocalSession
from .nodelocal import NodeDirectory
from .part_blobs import PartBlobSession
from .session import CommitSession, Committed
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .saving import Saver

log = logging.getLogger("resilient_callbacks")


@dataclass
class SaveStats:
    step: int
    path: str
    bytes: int
    seconds: float
    reason: str
    written: int = -1  # bytes this save wrote (shared blobs it reused not counted); -1: unknown


@dataclass
class Prepared:
    """What the training thread prepared for one save (:meth:`~.saving.Saver.prepare`)."""

    shared: structure.Encoded
    local: structure.Encoded
    rng_info: dict[str, Any] | None
    rng_tensors: dict[str, torch.Tensor]
    fingerprint: str
    snapshot: Snapshot | None
    parts: CapturedParts | None = None
    blobs: BlobSession | None = None  # incremental=True, coordinator
    watch: dict[str, Any] | None = None  # frozen tensors to remember once committed
    part_blobs: PartBlobSession | None = None  # incremental=True with FileParts, every rank


def manifest_extra(
    prepared: Prepared | None, schedule: Any, progress: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The manifest's ``extra``: the adaptive schedule's state, what the FileParts described,
    the run's useful training time up to this step (``progress``, see :mod:`.recorder`)."""
    extra: dict[str, Any] = {}
    if progress:
        extra["progress"] = progress
    if schedule is not None:
        extra["schedule"] = schedule.state_dict()
    if prepared is not None and prepared.parts is not None:
        extra.update(prepared.parts.manifest_extra())
    return extra


def persist(
    saver: Saver,
    step: int,
    prepared: Prepared | None,
    local_exc: BaseException | None,
    metrics: dict[str, float | None],
    reason: str,
    why: str,
    t0: float,
    background: bool,
    progress: dict[str, Any] | None = None,
    blocking: float | None = None,
) -> None:
    """Every rank: write this rank's files, then commit through a CommitSession. Runs in the
    background thread for background saves (collectives on the checkpoint's own group). A
    failure to write is reported through the commit, never raised alone."""
    ck = saver.ck
    session = _session(saver, step, background, metrics)
    done: Committed | None = None
    try:
        staging_dir = session.begin()
        written = 0
        if local_exc is None and staging_dir is not None:
            assert prepared is not None
            try:
                written = _write(saver, session, staging_dir, prepared, background)
            except Exception as e:  # reported to every rank by the commit; nothing is committed
                local_exc = e
        if not background:
            saver.observe_save(time.perf_counter() - t0, reason)
        if local_exc is None and background and saver.persister and saver.persister.abandoned:
            local_exc = CheckpointWriteError(f"step {step}: abandoned by close(timeout)")
        if prepared is not None:
            session.layout = structure_layout.layout_hash(prepared.shared.structure)
        try:
            done = session.commit(
                local_exc,
                metrics=metrics,
                reason=reason,
                fingerprint=prepared.fingerprint if prepared else "",
                extra=manifest_extra(prepared, ck.schedule, progress),
            )
        except CheckpointWriteError as e:
            ck._recorder.save_failed(step, e)
            if background:
                ck.last_saved_step = None
                if ck.is_coordinator:  # said now: the loop hears of it at its next save only
                    log.error("background save of step %d failed: %s", step, e)
            if isinstance(local_exc, UnsupportedStateError) and not background:
                raise local_exc from None
            raise
        _record(
            saver, step, prepared, done, reason, why, t0, background, written, progress, blocking
        )
        # committed; then the work after the commit failed (said where it ran): not raised,
        # counted and kept (after_commit_work.py); None clears the last one
        ck._recorder.after_commit(step, session.after_error)
    except CheckpointError:
        raise
    except BaseException as e:
        _abandon(session)  # Ctrl-C, SystemExit, or a collective that failed: no commit will come
        if not isinstance(e, Exception) or done is not None:
            raise
        err = _stopped(e, step, ck.rank, ck.world_size, isinstance(session, NodeLocalSession))
        ck._recorder.save_failed(step, err)
        if background:
            ck.last_saved_step = None
            log.error("background save of step %d failed: %s", step, err)
        raise err from e
    finally:
        if prepared is not None and prepared.blobs is not None:
            prepared.blobs.end()  # committed (the manifest names them) or failed: unpin


def _stopped(
    e: Exception, step: int, rank: int, world_size: int, node_local: bool = False
) -> CheckpointWriteError:
    """The error of a save stopped by ``e`` outside the commit's own reporting. A collective
    that failed on several ranks (most often another rank died: gloo's "Connection closed by
    peer") is told as :func:`.dist.failed_exchange` tells it; anything else as it is."""
    peers = world_size > 1 and dist.from_collective(e)
    why = dist.failed_exchange(e) if peers else f"{type(e).__name__}: {e}"
    # node-local: a node may have committed its part before the failure; the coordinator never
    # recorded the checkpoint as committed on every node, so the next restore removes the parts
    left = (
        " (a node's part committed before the failure is removed by the next restore)"
        if node_local
        else ""
    )
    return CheckpointWriteError(
        f"the save of step {step} stopped on rank {rank}"
        f"{' (the rank reporting it)' if peers else ''}: {why}. Its uncommitted files are "
        f"removed{left}; the checkpoints committed before it are intact"
    )


def _abandon(session: CommitSession | NodeLocalSession) -> None:
    """Remove the staging directory of a save interrupted in this process (the next open of the
    directory would sweep it; a notebook that catches the ``KeyboardInterrupt`` and goes on may
    not open it again). Its creator removes it: rank 0, or in node-local mode each rank its
    node's, where removing a name already gone does nothing. After the commit's rename the
    staging path no longer exists."""
    if session.staging is not None and (
        isinstance(session, NodeLocalSession) or session.is_coordinator
    ):
        shutil.rmtree(session.staging, ignore_errors=True)


def _session(
    saver: Saver, step: int, background: bool, metrics: dict[str, float | None]
) -> CommitSession | NodeLocalSession:
    """The commit of this save: a CommitSession, or in node-local mode a NodeLocalSession
    (given this rank's ``metrics``: rank 0's are recorded on every node)."""
    ck, d = saver.ck, saver.ck._dir
    assert d.run_id is not None
    group = saver.group if background else None
    if isinstance(d, NodeDirectory):  # several nodes, each with its own disk
        return NodeLocalSession(d, step, run_id=d.run_id, group=group, metrics=metrics)
    return CommitSession(
        ck.dirpath,
        step,
        run_id=d.run_id,
        group=group,
        strategy=d.commit,
        seq=d.seq + 1,
        retention=ck.retention,
        remote_retention=ck.config.remote_retention_if_any(),
        sync=d.sync,  # (for the message of a full disk: after_commit queues the uploads)
        after_commit=d.after_commit,
        tip=d.tip,
        blobs=d.blobs,  # (rank 0's: pins what the ranks staged while the commit moves it)
        said=d.said,  # (this Checkpointer's: its own first failure is said)
    )


def _write(
    saver: Saver,
    session: CommitSession | NodeLocalSession,
    staging_dir: str,
    prepared: Prepared,
    background: bool,
) -> int:
    """Write this rank's part and its FileParts' files into ``staging_dir`` and add them to
    ``session``; return the bytes written (shared blobs reused not counted)."""
    ck = saver.ck
    if prepared.snapshot is not None:
        prepared.snapshot.wait_host()
    if ck.is_coordinator:  # .lock deleted while the run is live: another writer may have opened
        ck._dir.lock.verify()
    _make_room(saver, staging_dir, session.step)
    compress = None
    if saver.codec.enabled and saver.codec.compress_now(prepared.shared.tensors):
        compress = (saver.codec.level, saver.codec.with_shuffle)
    bounce = saver.bounce if background else None
    if prepared.blobs is not None:
        prepared.blobs.compress = compress
        prepared.blobs.direct = background
        prepared.blobs.bounce = bounce
    w0 = time.perf_counter()
    files = layout.write_part(
        staging_dir,
        ck.rank,
        prepared.shared if ck._writes_shared else None,
        prepared.local,
        prepared.rng_info,
        prepared.rng_tensors,
        direct=background,  # no page-cache copy competing with training
        bounce=bounce,
        blobs=prepared.blobs,
        compress=compress,
    )
    written = sum(f.size for f in files if f.kind != "blob")
    if prepared.blobs is not None:
        written += prepared.blobs.written
    if compress is None:
        saver.codec.observe_raw_write(written, time.perf_counter() - w0)
    session.add(files)
    if prepared.parts is not None:  # the FileParts' own files, under parts/<id>/
        prepared.parts.wait_host()
        if saver.part_blobs is not None:
            prepared.part_blobs = saver.part_blobs.session(
                staging_dir,
                ck.rank,
                compress=compress,
                direct=background,
                bounce=bounce,
                hints=prepared.parts.hints,
            )
        part_files = prepared.parts.write(
            staging_dir, ck.rank, direct=background, bounce=bounce, blobs=prepared.part_blobs
        )
        session.add(part_files)
        written += sum(f.size for f in part_files if f.kind != "blob")
        if prepared.part_blobs is not None:
            written += prepared.part_blobs.written
    return written


def _make_room(saver: Saver, staging_dir: str, step: int) -> None:
    """Coordinator: when retention's deletions are still running (:mod:`.trash`) and the disk
    has less free space than the last checkpoint took, wait for them before writing. Saves in
    quick succession on a disk sized for ``keep_last + 1`` checkpoints failed with ENOSPC while
    the space they needed was still being freed. Then warn if the space is still not there
    (:func:`.space.before_write`; before a process's first save, the checkpoint it restored
    from says what a save takes)."""
    ck = saver.ck
    trash = ck._dir.trash
    preflight = _preflight(saver)
    if ck.last_save is not None:
        need = ck.last_save.bytes
    elif ck.restored_from is not None and preflight:  # a restarted process's first
        need = space.checkpoint_size(ck.restored_from) or 0
    else:
        return
    free = space.free_bytes(staging_dir) if trash.pending or preflight else None
    if free is not None and free < need and trash.pending:
        t0 = time.perf_counter()
        trash.wait(600.0)
        log.info(
            "waited %.1f s for retention to delete older checkpoints before writing (%.0f MB "
            "were free, the last checkpoint took %.0f MB)",
            time.perf_counter() - t0,
            free / 1e6,
            need / 1e6,
        )
        free = space.free_bytes(staging_dir)
    if free is not None and free < need and preflight:
        space.before_write(ck.dirpath, step, free, need)


def check_next_save_fits(saver: Saver) -> None:
    """Coordinator, at the first ``step()`` after a commit that saves nothing (training goes
    on): warn, once retention's deletions are done, when the disk has no room for another
    checkpoint of the last one's size (not once ``close()`` began)."""
    ck, last = saver.ck, saver.ck.last_save
    if _preflight(saver) and last is not None:
        space.after_commit(ck.dirpath, last.step, last.bytes, ck._dir.trash, lambda: ck._closed)


def _preflight(saver: Saver) -> bool:
    """Whether this rank checks the free space before and after a save: the coordinator of a
    shared directory, when the last checkpoint's size says what the next one needs (not with
    ``incremental``, whose saves write only what changed)."""
    ck = saver.ck
    return (
        ck.is_coordinator and not isinstance(ck._dir, NodeDirectory) and not ck.config.incremental
    )


def _record(
    saver: Saver,
    step: int,
    prepared: Prepared | None,
    done: Committed,
    reason: str,
    why: str,
    t0: float,
    background: bool,
    written: int,
    progress: dict[str, Any] | None,
    blocking: float | None,
) -> None:
    """Every rank, once ``done`` is committed: the Checkpointer's and the recorder's account of
    the save, the unchanged-tensor tracker, the log line."""
    ck = saver.ck
    if not background:
        ck.last_saved_step = step
        ck._trigger.clock.reset()
    if saver.tracker is not None and prepared is not None and prepared.watch is not None:
        assert prepared.blobs is not None
        saver.tracker.record(prepared.watch, prepared.blobs.keys)
    if saver.part_blobs is not None and prepared is not None and prepared.part_blobs is not None:
        saver.part_blobs.committed(prepared.part_blobs, _committed_manifest(done.path))
        if prepared.parts is not None:
            saver.part_buffers.committed(prepared.parts, prepared.part_blobs.keys)
    elapsed = time.perf_counter() - t0
    if background:
        saver.persist_seconds.append(elapsed)
        if ck.schedule is not None:  # the persist floor, before the next save carries it in
            ck.schedule.observe_persist(elapsed)
    ck.last_save = SaveStats(step, done.path, done.bytes, elapsed, reason, written)
    # the next save will not fit: said a save interval ahead, by the next step() (training
    # goes on; the next save() warns before it writes), never here: the trash thread's check
    # ran before a close() that followed directly. Not after a final or emergency save (an
    # emergency_save() sets it itself), nor one committed once close() began.
    saver.space_check_due = reason not in ("final", "emergency")
    saver.committed_saves += 1
    ck._recorder.committed(
        step,
        done.path,
        done.bytes,
        elapsed,
        elapsed if not background or blocking is None else blocking,
        reason,
        (progress or {}).get("useful_s", 0.0),
    )
    log.info(
        "saved step %d (%s, %.1f MB, %.3f s%s) -> %s",
        step,
        why,
        done.bytes / 1e6,
        elapsed,
        ", in the background" if background else "",
        done.path,
    )


def _committed_manifest(path: str) -> Any:
    """The manifest just committed at ``path`` (its blob entries are the ones stored), or
    None where it cannot be read (then the save's own entries are trusted)."""
    from .manifest import read_manifest

    try:
        return read_manifest(path)
    except Exception:  # (deleted by retention meanwhile, a node-local directory)
        return None
