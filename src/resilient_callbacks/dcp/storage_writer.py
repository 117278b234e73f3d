"""``ResilientStorageWriter``: a drop-in ``StorageWriter`` for ``dcp.save`` / ``dcp.async_save``
that commits through the core: staging directory, every rank's files hashed as written, the
manifest last, rename, ``latest``, retention, upload to a remote tier -- and no pickle.

Which ranks call what (DCP's own sequence, see ``torch.distributed.checkpoint.StorageWriter``):

- every rank: ``set_up_storage_writer``, ``prepare_local_plan``, ``write_data``;
- the coordinator (rank 0 of DCP's group) only: ``prepare_global_plan`` -- opens the directory
  the first time (lock, sweep of leftovers, remote tier), creates the staging directory and puts
  its path into every rank's plan -- and ``finish`` -- writes ``dcp_metadata.json``, then the
  manifest last, renames, points ``latest``, applies retention and queues the upload.

This writer runs no collective of its own: DCP gathers the plans and the write results (with
its own *pickled* object collectives: that is DCP's code path, not this library's; the
``Checkpointer`` + :class:`~.sharded.Sharded` path uses the core's JSON collectives instead).

Files of a checkpoint: ``dcp/rank_NNNNN.safetensors`` (each rank's tensor chunks),
``dcp/rank_NNNNN.json`` (each rank's non-tensor items, as JSON), ``dcp_metadata.json`` and
``manifest.json``. A process killed between ``write_data`` and ``finish`` leaves only a hidden
``.staging-*`` directory: no reader counts it, and the next writer to open the directory sweeps
it.

With ``dcp.async_save`` this writer is also the stager: the state is copied into host buffers
that are reused from one save to the next (no new allocation per save). An ``async_save`` made
before the previous one has written stages into a set of buffers of its own
(:mod:`.staging_pool`); saves in flight together get distinct steps and commit numbers, and
commit one at a time. With ``async_staging=True``
the copy itself runs in the background (a helper thread; on a GPU, a side stream) and
``dcp.async_save`` returns an ``AsyncSaveResponse``: wait for ``staging_completion`` before
anything changes the state.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import uuid
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import checkpointer, closing, dist
from ..config import CheckpointerConfig, local_dirpath
from ..directory import Directory
from ..errors import CheckpointWriteError, ConfigError, UnsupportedStateError
from ..filewrite import write_json
from ..lock import release_dropped
from ..manifest import FileEntry
from ..preemption import PreemptionWatcher
from ..reader import by_commit, committed
from ..session import CommitSession, RankReport
from ..snapshot import Snapshot
from . import lineage, shards
from .chunks import held
from .metadata_json import METADATA_NAME, to_json
from .rank_files import collect_items, write_rank_files
from .staging_pool import BufferPool, Lease

log = logging.getLogger("resilient_callbacks")

_DCP_ASYNC_THREAD = "AsyncCheckpointExecutor"  # the name of dcp.async_save's save threads
_PLAN_CACHING = (
    "a save planner with plan caching (DefaultSavePlanner(enable_plan_caching=True)) is not "
    "supported by ResilientStorageWriter: from its second save on, DCP hands each rank the "
    "plan of the save that filled the cache, with that save's staging directory in it, and "
    "the ranks would write where no commit reads. Pass a planner without enable_plan_caching "
    "(DefaultSavePlanner(), dcp.save's default)"
)


class ResilientStorageWriter(StorageWriter):
    """Write ``dcp.save``/``dcp.async_save`` checkpoints into ``dirpath`` as committed,
    verified, pickle-free checkpoints (``step_NNNNNNNNN`` directories).

    ``step``: the step of the next save only (set ``writer.step = n`` before each save, or pass
    ``checkpoint_id=n`` to ``dcp.save``/``dcp.async_save``: with async saves in flight together,
    only the latter is each save's own); when ``None``, one after the step the run reached
    (:mod:`.lineage`: after a resume from an older step, the one loaded). ``keep_last``,
    ``keep_every_n_steps``, ``remote``, ``remote_options``, ``remote_keep_last``: as for
    :class:`~resilient_callbacks.Checkpointer`. ``run_id``: the run the checkpoints belong to (retention counts only its own run's); default: the run of the
    newest checkpoint in ``dirpath``, or a new one. ``async_staging``: with ``dcp.async_save``,
    copy the state into the host buffers in the background too; ``async_save`` then returns an
    ``AsyncSaveResponse`` whose ``staging_completion`` you wait for before anything changes the
    saved state (the next optimizer step; a training-mode forward that updates BatchNorm
    statistics), as with DCP's own ``StagingOptions(use_async_staging=True)``. ``watcher``:
    the ``PreemptionWatcher`` your loop reads (or a Checkpointer's ``watcher``): a request
    pending on it, or on any watcher installed in this process, bounds :meth:`close`'s wait
    for uploads by its grace period. Every rank constructs it with the same arguments. Call
    :meth:`close` (or use ``with``) at the end: it waits for uploads and releases the lock.
    ``no_dist=True``: this process saves alone on purpose, as ``dcp.save(..., no_dist=True)`` on
    one rank of a job (rank 0 saving a consolidated state dict), into a ``dirpath`` of its own.
    DCP does not tell the writer; without it a process launched as one of several ranks
    (``WORLD_SIZE`` > 1) with no process group is refused, as a forgotten ``init_process_group``.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        step: int | None = None,
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        remote: str | None = None,
        remote_options: dict[str, Any] | None = None,
        remote_keep_last: int | str | None = None,
        run_id: str | None = None,
        async_staging: bool = False,
        watcher: PreemptionWatcher | None = None,
        no_dist: bool = False,
    ) -> None:
        super().__init__()
        self.no_dist = bool(no_dist)  # (DCP does not pass it on: see the docstring)
        self.watcher = watcher  # (any installed in this process counts too: pending.py)
        self.config = CheckpointerConfig(
            dirpath=local_dirpath(dirpath),  # (a URL is refused: abspath made it ./s3:/...)
            keep_last=keep_last,
            keep_every_n_steps=keep_every_n_steps,
            remote=remote,
            remote_options=remote_options,
            remote_keep_last=remote_keep_last,
        )
        self.dirpath = self.config.dirpath
        self.step = step
        self.run_id = run_id
        self.rank = 0
        self.is_coordinator = True
        self.last_committed: str | None = None
        # the work after that commit (retention, upload queue) failed: what was said (not raised)
        self.after_commit_error: str | None = None
        self._dir: Directory | None = None
        self._based: object = None  # the load its saves descend from (lineage.rebase)
        # the saves begun and not finished: staging path -> (session, the thread saving it)
        self._sessions: dict[str, tuple[CommitSession, threading.Thread]] = {}
        self._pool = BufferPool()
        self._saving: threading.Thread | None = None  # the thread of the newest save begun
        # dcp.async_save's threads -> their save's number in call order (stage()), and the count
        self._tickets: WeakKeyDictionary[threading.Thread, int] = WeakKeyDictionary()
        self._staged = 0
        self._lock = threading.RLock()
        self._async = bool(async_staging)
        self._steps: dict[threading.Thread, int] = {}  # checkpoint_id of the save per thread
        self._step_from_id = False  # self.step came from a checkpoint_id, not the attribute

    # ------------------------------------------------------------------ DCP's sequence

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """``checkpoint_id`` (from ``dcp.save(..., checkpoint_id=...)``): the step to save, or
        the writer's own ``dirpath`` (the save is then numbered as without one)."""
        step = lineage.step_of_id(checkpoint_id, self.dirpath)
        if step is None:
            return
        me = threading.current_thread()
        if me.name.startswith(_DCP_ASYNC_THREAD):
            # dcp.async_save's background save calls reset() again with its own checkpoint_id:
            # kept per thread, so saves in flight together do not take each other's steps
            with self._lock:
                self._steps[me] = step
        else:
            self.step, self._step_from_id = step, True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen automatically: pass storage_writer=ResilientStorageWriter(...)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise UnsupportedStateError(
                "dcp.save(..., use_collectives=False) (each rank commits its own metadata) is "
                "not supported by ResilientStorageWriter: its checkpoint is committed once, by "
                "the coordinator, after every rank wrote its files. Save with collectives, or "
                "with no_dist=True from a single process"
            )
        self._require_group()
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", dist.rank()))
        if not is_coordinator and self._dir is None:
            release_dropped(self.dirpath)  # this rank may have coordinated a failed save
        self._after_previous_save()

    def _require_group(self) -> None:
        """Every rank, at each save, before anything is written: refuse a process launched as
        one of several ranks (``WORLD_SIZE`` > 1) that has no process group. DCP then saves
        it as a single process, and every rank committed its own checkpoint into ``dirpath``
        as if alone, in silence (each one's saves replacing the others' by retention), as
        :func:`.dist.require_group` refuses for a ``Checkpointer`` (not with ``no_dist``)."""
        launched = dist.launched_world_size()
        if launched <= 1 or self.no_dist or dist.is_initialized():
            return
        raise ConfigError(
            f"ResilientStorageWriter({self.dirpath!r}): dcp.save was called in a process "
            f"launched as rank {os.environ.get('RANK', '?')} of WORLD_SIZE={launched} that has "
            "no process group, so DCP saves this process's state alone (\"assuming the intent "
            'is to save in a single process") and every rank would commit a checkpoint of its '
            "own into the same directory, as if it were the only one. Nothing was written. "
            "Call torch.distributed.init_process_group(...) on every rank before the first "
            "save. If these processes are independent runs, set WORLD_SIZE=1 in their "
            "environment and give each writer its own dirpath. If this process saves alone on "
            "purpose (dcp.save(..., no_dist=True)): ResilientStorageWriter(..., no_dist=True)."
        )

    def _after_previous_save(self) -> None:
        """Every rank, before this save's first collective: wait for this writer's previous
        ``async_save`` to end (DCP runs each in a thread of its own). Two saves running their
        collectives on one group at once hang every rank (plain DCP does the same)."""
        me = threading.current_thread()
        with self._lock:
            ticket = self._tickets.get(me)
            if ticket is None and self._staged and me.name.startswith(_DCP_ASYNC_THREAD):
                ticket = self._tickets[me] = self._staged  # the newest staged (see stage())
            # an async save after those called before it, whichever thread the OS ran first
            # (run order numbered them: the newest step could hold an older state)
            before: list[threading.Thread | None]
            before = [t for t, k in self._tickets.items() if ticket is None or k < ticket]
            before += [self._saving] if ticket is None else []
            self._saving = me
        for t in before:  # (a sync save's thread lives on: only dcp.async_save's end with it)
            if t is not None and t is not me and t.name.startswith(_DCP_ASYNC_THREAD):
                t.join()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: open the directory (first time), number the save, make its staging."""
        with self._lock:
            return self._global_plan(plans)

    def _global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not all(p.usable for p in plans):  # a planner that caches by other means
            raise UnsupportedStateError(_PLAN_CACHING)
        if self._dir is None:
            d = Directory(self.dirpath, self.config.local_retention_policy(), len(plans))
            d.open_here(self.config, f"ResilientStorageReader({self.dirpath!r})")
            if self.run_id is None:  # carry on the run of the newest checkpoint, if any
                newest = by_commit(committed(self.dirpath))
                manifest = newest[0].manifest if newest else None
                self.run_id = manifest.run_id if manifest is not None else uuid.uuid4().hex[:16]
            d.run_id = self.run_id
            self._dir = d
        d = self._dir
        self._abort_abandoned()
        in_flight = [s for s, _ in self._sessions.values()]
        step = self._steps.pop(threading.current_thread(), None)
        if step is None:
            step, self.step, self._step_from_id = self.step, None, False  # this save's only
        if step is None:  # after the step this lineage reached, committed or in flight
            step = lineage.next_step(self.dirpath, [s.step for s in in_flight])
        assert self.run_id is not None
        self._based = lineage.rebase(d.tip, self.dirpath, self._based)  # the save's parent
        session = CommitSession(
            self.dirpath,
            step,
            run_id=self.run_id,
            strategy=d.commit,
            seq=max([d.seq] + [s.seq or 0 for s in in_flight]) + 1,
            after_commit=d.after_commit,  # applies d.retention; the session records both
            retention=d.retention,
            remote_retention=self.config.remote_retention_if_any(),
            tip=d.tip,
            said=d.said,  # (this writer's: its own first failure is said)
        )
        staging = session.begin_here()
        self._sessions[staging] = (session, threading.current_thread())
        return [
            dataclasses.replace(p, storage_data={"staging": staging, "rank": i})
            for i, p in enumerate(plans)
        ]

    def _abort_abandoned(self) -> None:
        """Remove the staging directories of saves that will never finish: begun by a thread
        that has ended (DCP's background save thread, after a failure) or by this one (a
        ``dcp.save`` of this thread failed after its plan)."""
        me = threading.current_thread()
        for staging, (session, thread) in list(self._sessions.items()):
            if thread is me or not thread.is_alive():
                del self._sessions[staging]
                session.strategy.abort(staging)
        for thread in [t for t in self._steps if not t.is_alive()]:
            del self._steps[thread]  # the checkpoint_id of a save that failed before its plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: write this rank's tensors (one safetensors file) and objects (one JSON
        file) into the staging directory through the core's hashing writers."""
        results = self._write(plan, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        if getattr(planner, "_enable_plan_caching", False):
            raise UnsupportedStateError(_PLAN_CACHING)
        where = plan.storage_data
        staging, rank = where["staging"], int(where["rank"])
        tensors: dict[str, torch.Tensor] = {}
        objects: dict[str, Any] = {}
        results: list[WriteResult] = []
        storages: set[int] = set()  # what was read: staged host buffers end their lease
        try:
            collect_items(plan, planner, tensors, objects, results, storages)
            files = write_rank_files(staging, rank, tensors, objects)
        finally:
            self._pool.written(storages)
        if results:  # this rank's files reach finish() with its first result
            first = results[0]
            data = {**first.storage_data, "files": [dataclasses.asdict(f) for f in files]}
            results[0] = dataclasses.replace(first, storage_data=data)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: ``dcp_metadata.json``, manifest last, rename, retention, upload queue."""
        with self._lock:  # saves in flight together commit one at a time
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        me = threading.current_thread()
        mine = [k for k, (_, thread) in self._sessions.items() if thread is me]
        if not mine:
            raise CheckpointWriteError("finish() without prepare_global_plan() in this thread")
        session, _ = self._sessions.pop(mine[-1])
        assert session.staging is not None
        storage: dict[MetadataIndex, dict[str, Any]] = {}
        reports: list[RankReport] = []
        for rank, rank_results in enumerate(results):
            report = RankReport(rank)
            for r in rank_results:
                where = dict(r.storage_data)
                report.files += [FileEntry(**f) for f in where.pop("files", [])]
                storage[r.index] = where
            reports.append(report)
        try:
            d = write_json(os.path.join(session.staging, METADATA_NAME), to_json(metadata, storage))
        except Exception as e:
            session.strategy.abort(session.staging)
            raise CheckpointWriteError(f"could not write {METADATA_NAME}: {e}") from e
        reports[0].files.append(FileEntry(METADATA_NAME, d.size, d.xxh3_64, 0, "structure"))
        committed = session.commit_here(reports, reason="dcp")
        self.last_committed, self.after_commit_error = committed.path, session.after_error
        log.info("committed %s", committed.path)

    # ------------------------------------------------------------------ async_save staging

    _synchronize_after_execute = False  # DCP's AsyncStager protocol

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    @shards.quiet
    def stage(
        self, state_dict: dict[str, Any]
    ) -> dict[str, Any] | concurrent.futures.Future[dict[str, Any]]:
        """``dcp.async_save``: copy the state into this writer's reused host buffers (another
        set while an earlier save has not written from them: :mod:`.staging_pool`). With
        ``async_staging=True`` the copy runs in the background and this returns a future (DCP
        then returns an ``AsyncSaveResponse``: wait for its ``staging_completion`` before the
        state changes, e.g. before the next optimizer step)."""
        if self._step_from_id:  # the background save's own reset() brings its checkpoint_id
            self.step, self._step_from_id = None, False
        with self._lock:  # the thread of the save before this one is running by now
            for t in threading.enumerate():
                if t.name.startswith(_DCP_ASYNC_THREAD) and t not in self._tickets:
                    self._tickets[t] = self._staged
            self._staged += 1
        lease = self._pool.lease()
        try:
            return self._stage(state_dict, lease)
        except BaseException:
            self._pool.release(lease)
            raise

    def _stage(
        self, state_dict: dict[str, Any], lease: Lease
    ) -> dict[str, Any] | concurrent.futures.Future[dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {}

        def collect(obj: Any, path: str) -> None:
            if shards.is_sharded(obj):
                tensors[path] = shards.local(obj).detach()
            elif isinstance(obj, torch.Tensor):
                tensors[path] = obj.detach()
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    collect(v, f"{path}/{k}")
            elif isinstance(obj, (list, tuple)):
                for i, v in enumerate(obj):
                    collect(v, f"{path}/{i}")

        def rebuild(obj: Any, path: str, copies: dict[str, torch.Tensor]) -> Any:
            if shards.is_sharded(obj):
                return shards.rebuild(obj, lease.alias(copies[path]))
            if isinstance(obj, torch.Tensor):
                return lease.alias(copies[path])
            if isinstance(obj, dict):
                return {k: rebuild(v, f"{path}/{k}", copies) for k, v in obj.items()}
            if isinstance(obj, list):
                return [rebuild(v, f"{path}/{i}", copies) for i, v in enumerate(obj)]
            if isinstance(obj, tuple):
                return tuple(rebuild(v, f"{path}/{i}", copies) for i, v in enumerate(obj))
            return held(obj)

        collect(state_dict, "")
        every = {t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()}
        snap = Snapshot(tensors, lease.buffers, overlap_storages=every if self._async else None)
        staged = rebuild(state_dict, "", snap.copies)
        if not self._async:
            snap.wait_host()  # GPU copies are in host memory before write_data reads them
            lease.staged()
            return staged
        done: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

        def complete() -> None:
            try:
                snap.wait_host()
            except BaseException as e:
                self._pool.release(lease)  # nothing will be written from it
                done.set_exception(e)
            else:
                lease.staged()
                done.set_result(staged)

        threading.Thread(target=complete, name="rc-dcp-staging", daemon=True).start()
        return done

    def synchronize_staging(self) -> None:
        return None

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for this writer's ``dcp.async_save`` calls still in flight to commit, remove the
        staging directory of a save that failed before ``finish`` (rank 0), wait for pending
        uploads (as ``Checkpointer.close``: given up after a 5-minute outage, then raises
        :class:`UploadIncompleteError`; in a preemption, at its grace period less 5 s, only
        warning) and retention's deletions; release the directory lock."""
        self._wait_for_async_saves()
        with self._lock:
            sessions, self._sessions = self._sessions, {}
        me = threading.current_thread()
        live = [s for s, thread in sessions.values() if thread.is_alive() and thread is not me]
        if live:
            log.warning(
                "ResilientStorageWriter.close(): %d save(s) still in flight (steps %s) will not "
                "be committed: wait for dcp.async_save's future before close()",
                len(live),
                [s.step for s in live],
            )
        for staging, (session, _) in sessions.items():
            session.strategy.abort(staging)
        d, self._dir = self._dir, None
        if d is not None:  # (uploads given up after CLOSE_OUTAGE_S of an outage: it hung)
            closing.close_directory(d, checkpointer.CLOSE_OUTAGE_S, self.watcher)

    def _wait_for_async_saves(self) -> None:
        """Wait for this writer's ``dcp.async_save`` calls to end. Each one's thread waits for the
        one before it, so waiting for the newest begun waits for all; one whose thread has not
        begun yet holds staged buffers, and the threads of ``dcp.async_save`` then alive are
        waited for as well. (Aborting them instead lost saves, and one still queued reopened the
        directory after ``close()``, committed, and kept its lock.)"""
        me = threading.current_thread()
        told = False
        while True:
            with self._lock:
                newest = self._saving
            threads = [newest] if newest is not None else []
            if self._pool.in_flight:  # staged, not written: its thread may not have begun
                threads += [t for t in threading.enumerate() if t is not newest]
            threads = [
                t
                for t in threads
                if t is not me and t.name.startswith(_DCP_ASYNC_THREAD) and t.is_alive()
            ]
            if not threads:
                return
            if not told:
                told = True
                log.info("ResilientStorageWriter.close(): waiting for dcp.async_save(s) in flight")
            for t in threads:
                t.join()

    def __reduce__(self) -> Any:
        # dcp.async_save(async_checkpointer_type=PROCESS) sends the writer to another process
        raise TypeError(
            "ResilientStorageWriter cannot be sent to another process: it holds the directory's "
            "lock, its host buffers and its upload thread. Use dcp.async_save with the default "
            "AsyncCheckpointerType.THREAD (the writing runs in the background either way)."
        )

    def __enter__(self) -> ResilientStorageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        closing.close_on_exit(self.close, exc[1])
