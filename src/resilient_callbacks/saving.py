"""One save: prepare (encode, snapshot into reused host buffers) -> write each rank's part ->
gather -> manifest -> commit -> ``latest`` -> retention -> queue the upload.

Which ranks call what: every rank calls :meth:`Saver.save` at the same step (a Checkpointer's
``step``/``save``/``emergency_save``). The training thread only prepares: it encodes the state
and, for a background save, copies this rank's tensors into the host buffers (the coordinator
also copies the replicated ones). The rest runs in :func:`.persisting.persist`, in the
background thread for a background save: every rank writes its own part into the staging
directory and the :class:`~.session.CommitSession` gathers, commits on rank 0 and raises on
every rank if any failed. A background failure is raised on the next save or on close, never
lost; with several ranks, on every rank at the same save (:mod:`.held_failures`).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import dist, held_failures, rng, statetree, structure
from .background import BackgroundPersister
from .compression import Chooser
from .errors import AT_CALLER, CheckpointWriteError, ForeignCheckpointsWarning, warn_and_log
from .filepart import CapturedParts, PartBuffers
from .optim import hookable, untraced
from .part_blobs import PartBlobs
from .persisting import Prepared, persist
from .save_inputs import clean_metrics, warn_unsaved_params
from .snapshot import HostBuffers, Snapshot, optimizer_step_storages
from .tensorfile import DirectBuffer
from .unchanged import UnchangedTracker, begin_incremental
from .waits import SaveWaits

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")


def _peer_errors_as_write_errors(save: Callable[..., bool]) -> Callable[..., bool]:
    """A save stopped by a failed exchange between the ranks in the training thread (the
    background group's creation, the busy check) raises a CheckpointWriteError saying so."""

    @functools.wraps(save)
    def wrapper(self: Saver, step: int, *args: Any, **kwargs: Any) -> bool:
        with dist.peer_errors(f"the save of step {step}", CheckpointWriteError):
            return save(self, step, *args, **kwargs)

    return wrapper


class Saver:
    """The save pipeline of one Checkpointer and what it reuses between saves: the background
    writer, its process group, the host buffers and the O_DIRECT bounce buffer."""

    def __init__(self, ck: Checkpointer) -> None:
        self.ck = ck
        self.persister: BackgroundPersister | None = None
        # the gloo group of background saves' collectives, made at the first background save
        # (a Checkpointer that only restores -- an evaluation, an export -- makes none)
        self.group: Any = None
        self._group_made = False
        if ck.config.async_save:
            self.persister = BackgroundPersister(ck.config.max_in_flight)
        self.buffers = HostBuffers()
        self.part_buffers = PartBuffers(track=ck.config.incremental is True)
        self.allocated_ahead = False
        self.bounce: DirectBuffer | None = None  # O_DIRECT writes of background saves
        self.last_snapshots: list[Snapshot] = []  # overlapped copies the next step waits for
        # hooked optimizer -> its hook's handle (weakly: an id() alone named a new optimizer made
        # at a freed one's address as hooked)
        self._hooked: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._every_step: Any = None  # the global optimizer pre-step hook (overlapped saves)
        self.skipped_saves = 0
        self.committed_saves = 0
        # a save committed (not a final one): the next step() that saves nothing (training
        # went on) checks that the save after it fits; the save itself did not (it may be the
        # run's last, closed at once); a save before that step checks before it writes
        self.space_check_due = False
        self.metric_names: set[str] = set()  # reported (finite) with this run's saves
        self.save_waits = SaveWaits(speak=ck.is_coordinator)
        cfg = ck.config
        self.tracker = UnchangedTracker() if cfg.incremental is True else None
        self.part_blobs = PartBlobs(ck.dirpath) if cfg.incremental else None  # FileParts'
        self.codec = Chooser(
            cfg.compression, cfg.compression_level, cfg.compression_shuffle, self._upload_bps
        )
        self.checked_params = False  # the first save warns of stepped tensors it lacks
        self.blocking_seconds: deque[float] = deque(maxlen=100)
        self.save_seconds: deque[float] = deque(maxlen=9)
        self.persist_seconds: deque[float] = deque(maxlen=9)

    def forget_unchanged(self) -> None:
        """After a restore: no tensor is known unchanged since a save any more (incremental)."""
        if self.tracker is not None:
            self.tracker.forget()
        self.part_buffers.forget()

    # ------------------------------------------------------------------ training thread

    @_peer_errors_as_write_errors
    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        reason: str,
        why: str,
        rng_state: tuple[Any, dict[str, torch.Tensor]] | None = None,
        skippable: bool | None = None,
    ) -> bool:
        """Every rank. Returns False if ``step`` is the one saved (or restored) last, or if a
        periodic save is skipped because the previous one is still being written
        (``skippable``: by default, a periodic save; never an archive step or a loss jump).
        An emergency save flushes the background saves first and goes on even if one of them
        failed (that failure is logged: the state this save writes is newer); of a step whose
        background save is still being written, it returns (False) once that one committed,
        and saves the step itself if it failed."""
        ck = self.ck
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be an int >= 0, got {step!r}")
        if ck.last_saved_step == step and reason == "emergency":
            # that save may still be in the background: an emergency save returns once the
            # step is durable, or saves it itself when that save failed (then it is None)
            self.settle_background()
        if ck.last_saved_step == step:
            log.debug("step %d is already saved by this run; not saving it twice", step)
            if reason == "final":  # the remote tier takes it even if its upload was skipped
                # (every rank: a failure some ranks hold is raised on every rank, none going
                # on alone into what follows: an adapter's collectives, close's)
                self.wait_background_agreed(f"the final save of step {step}")
                held_failed = ck._dir.upload_held(step)  # (said; not raised: on this rank only)
                if held_failed is not None:
                    ck._recorder.after_commit(step, held_failed)
            return False
        background = self.persister is not None and reason != "emergency"
        waited = 0.0
        if self.persister is not None:
            # every rank reaches this point at the same step, so they skip together
            if (
                ck.config.if_busy == "skip"
                and (reason == "periodic" if skippable is None else skippable)
                and dist.any_true(self.persister.busy)
            ):
                self.skipped_saves += 1
                ck._trigger.mark(step)  # skipped: every_seconds and adaptive count from here
                ck._recorder.skipped()
                log.warning(
                    "skipped the save at step %d: the previous checkpoint is still being "
                    "written (if_busy='skip'); %d skipped so far",
                    step,
                    self.skipped_saves,
                )
                return False
            if not background:
                waited = self.settle_background()  # emergency: flush, then a synchronous save
            else:
                waited = self.persister.wait_for_slot()
                self.save_waits.observe(step, waited, ck._trigger.clock.elapsed())
                if not self._group_made:  # every rank, at the same save (see new_cpu_group)
                    made = time.perf_counter()
                    self.group, self._group_made = dist.new_cpu_group(), True
                    waited += time.perf_counter() - made  # the loop waited for it too
        self.space_check_due = False  # (this save checks the free space before it writes)
        # a failed earlier save surfaces here, never lost; with several ranks, on every rank at
        # once (held_failures.agree, below): raised here on the ranks that held it alone, the
        # others went on into this save's collectives and waited there
        agreed = background and ck.world_size > 1
        held = self.persister.take_error() if agreed and self.persister is not None else None
        if not agreed:
            self.raise_background_error()
        t0 = time.perf_counter()
        metrics_json = clean_metrics(metrics)
        self.metric_names.update(k for k, v in metrics_json.items() if v is not None)
        unrestored = ck._dir.run_id is None and ck.config.resume == "auto"  # no restore() ran
        ck._start_run(step, at=ck._recorder.created)  # no restore(): it started at construction
        foreign = ck.is_coordinator and not ck._dir.checked_foreign  # (said at the caller)
        if foreign and ck.world_size == 1:
            self._say_foreign(unrestored)  # (-W error: raised as it is)
        prepared: Prepared | None = None
        local_exc: BaseException | None = None
        try:
            if foreign and ck.world_size > 1:  # -W error: rank 0's failure, which every rank
                self._say_foreign(unrestored)  # learns in this save's exchange
            if held is None:
                prepared = self.prepare(state, copy=background, rng_state=rng_state)
        except Exception as e:  # reported to every rank (the exchange, or the persist step)
            local_exc = e
        if agreed:
            try:
                held_failures.agree(step, ck.rank, held, local_exc, ck.dirpath, self.group)
            except BaseException as e:  # every rank: this save is not made
                if prepared is not None and prepared.blobs is not None:
                    prepared.blobs.end()  # (unpin what it pinned)
                if held is None:
                    ck._recorder.save_failed(step, e)
                raise
        progress = ck._recorder.progress_extra()  # useful time at this step, for the manifest
        # what the training loop waited, in all (measured before the job can finish)
        blocking = time.perf_counter() - t0 + waited
        job = functools.partial(
            persist,
            self,
            step,
            prepared,
            local_exc,
            metrics_json,
            reason,
            why,
            t0,
            background,
            progress=progress,
            blocking=blocking,
        )
        if background:
            assert self.persister is not None
            if local_exc is not None:  # (one rank: several agreed above)
                ck._recorder.save_failed(step, local_exc)
                raise held_failures.own_prepare_error(local_exc, step, ck.rank, ck.dirpath)
            self.observe_save(blocking, reason)  # before the job writes the manifest (counted)
            self.persister.submit(job)
            ck.last_saved_step = step
            ck._trigger.mark(step)
            if reason == "final":  # no optimizer step follows to wait for an overlapped copy:
                self.wait_for_snapshot()  # the end of training may write weights in place
                blocking = time.perf_counter() - t0 + waited
            self.blocking_seconds.append(blocking)
            ck._recorder.save_blocked(blocking)
            log.debug("step %d: snapshot took %.3f s; persisting in the background", step, blocking)
            return True
        job()  # observes its own cost before it commits (persisting.persist), amended here
        ck._trigger.steps_origin = step
        blocking = time.perf_counter() - t0
        self.amend_last_save(blocking, reason)
        ck._recorder.save_blocked(blocking)
        return True

    def _upload_bps(self) -> float | None:
        sync = self.ck._dir.sync
        if sync is None:
            return None
        st = sync.status()
        return st.uploaded_bytes / st.upload_seconds if st.upload_seconds > 0 else None

    def _schedules(self, reason: str) -> bool:
        """Whether a save of ``reason`` is one the adaptive schedule plans, whose cost it
        measures: not an emergency save when saves are in the background (it alone is
        synchronous, its whole write blocking: not what the next interval will cost)."""
        return not (reason == "emergency" and self.persister is not None)

    def observe_save(self, blocking: float, reason: str) -> None:
        """A save blocked the loop ``blocking`` seconds: measured before its manifest is
        written (a background save at its submission, a synchronous one before its commit), so
        the schedule state the manifest carries counts this save (a run resumed from it does
        not warm up again)."""
        self.save_seconds.append(blocking)
        schedule = self.ck.schedule
        if schedule is not None and self._schedules(reason):
            persist = statistics.median(self.persist_seconds) if self.persist_seconds else None
            schedule.observe_save(blocking, persist)

    def amend_last_save(self, blocking: float, reason: str) -> None:
        """A synchronous save's whole cost, its commit included, once it has committed: it
        replaces the measurement taken before the commit (the one its manifest carries)."""
        if self.save_seconds:
            self.save_seconds[-1] = blocking
        if self.ck.schedule is not None and self._schedules(reason):
            self.ck.schedule.amend_last_cost(blocking)

    def _say_foreign(self, unrestored: bool) -> None:
        """Coordinator, at the first save: other runs' checkpoints in the directory."""
        for said in self.ck._dir.check_foreign(unrestored):
            warn_and_log(log, said, ForeignCheckpointsWarning, stacklevel=AT_CALLER)

    def wait_background(self) -> float:
        """Block until every background save has committed; raise if one failed."""
        if self.persister is None:
            return 0.0
        t0 = time.perf_counter()
        self.persister.wait_all()
        self.raise_background_error()
        return time.perf_counter() - t0

    def wait_background_agreed(self, what: str) -> None:
        """Every rank, at the start of ``what`` (a call every rank makes: ``restore()``, a
        final save of the step saved last):
        :meth:`wait_background`, a failure that some ranks hold raised on every rank
        (:func:`.held_failures.agree_before`), none going on alone into the call's collectives."""
        if self.persister is None or self.ck.world_size <= 1:
            self.wait_background()
            return
        self.persister.wait_all()
        held_failures.agree_before(what, self.persister.take_error(), self.ck.dirpath)

    def settle_background(self) -> float:
        """Block until every background save is done; a failure among them is logged, not
        raised (before an emergency save, which is of a newer state)."""
        if self.persister is None:
            return 0.0
        t0 = time.perf_counter()
        self.persister.wait_all()
        try:
            self.persister.raise_error()
        except Exception as e:
            log.error("an earlier background save failed (%s); the emergency save goes on", e)
        return time.perf_counter() - t0

    def raise_background_error(self) -> None:
        if self.persister is not None:
            self.persister.raise_error()

    def wait_for_snapshot(self) -> None:
        """Order what comes next after the last save's overlapped snapshot copies (the core's
        and the FileParts')."""
        snaps, self.last_snapshots = self.last_snapshots, []
        for snap in snaps:
            snap.wait_device()

    def prepare(
        self,
        state: Any,
        copy: bool,
        rng_state: tuple[Any, dict[str, torch.Tensor]] | None = None,
    ) -> Prepared:
        """Encode the state (training thread) and, for a background save, copy its tensors into
        the reused host buffers; only what this rank writes is copied."""
        ck = self.ck
        shared, local = structure.encode(state, split_per_rank=ck.world_size > 1)
        fingerprint = statetree.fingerprint(state)
        fileparts = statetree.fileparts(state)
        if not self.checked_params:
            self.checked_params = True
            if not fileparts:  # a part holds its own model (and says what it saves)
                warn_unsaved_params(state, [*shared.tensors.values(), *local.tensors.values()])
        overlapped = copy and ck.config.overlap_snapshot
        self.wait_for_snapshot()  # the last save's deferred copies, before the buffers are reused
        parts = self.part_buffers.capture(fileparts, overlap=overlapped) if fileparts else None
        if rng_state is not None:
            rng_info, rng_tensors = rng_state
        else:
            rng_info, rng_tensors = rng.capture() if ck.config.capture_rng else (None, {})
        blobs, watch = None, None
        if ck.config.incremental and ck.is_coordinator:
            blobs, watch = begin_incremental(ck._dir.blobs, self.tracker, shared.tensors, state)
        try:
            snap = None
            if overlapped:
                self._hook_optimizers(state, parts)
                if parts is not None:
                    self.last_snapshots += parts.snapshots
            if copy:
                tensors = self._tensors_to_copy(shared, local)
                for name in blobs.hints if blobs is not None else ():
                    tensors.pop(name, None)  # known unchanged and stored: not copied
                overlap = optimizer_step_storages(state) if overlapped else None
                self.buffers.keep_only(tensors)
                if self.bounce is None:  # with the host buffers: later saves allocate nothing
                    self.bounce = DirectBuffer()
                snap = Snapshot(tensors, self.buffers, overlap_storages=overlap)
                if overlapped:
                    self.last_snapshots.append(snap)
                copies = snap.copies
                shared = structure.Encoded(
                    shared.structure, {k: copies[k] for k in shared.tensors if k in copies}
                )
                local = structure.Encoded(
                    None, {k: copies[k] for k in local.tensors}, local.per_rank
                )
        except BaseException:
            if blobs is not None:
                blobs.end()  # this save will not commit: unpin what it pinned
            raise
        return Prepared(
            shared, local, rng_info, rng_tensors, fingerprint, snap, parts, blobs, watch
        )

    def _tensors_to_copy(
        self, shared: structure.Encoded, local: structure.Encoded
    ) -> dict[str, torch.Tensor]:
        """The tensors this rank writes: its own, and the shared ones on the coordinator."""
        tensors = dict(local.tensors)
        if self.ck._writes_shared:
            tensors.update(shared.tensors)
        return tensors

    def allocate_ahead(self, state: Any) -> None:
        """Once, at the first step that does not save: start allocating the host buffers of a
        background save in a helper thread, so the first save does not pay for them on the
        training thread (seconds for a few GB). Optimizer state exists by then (step() follows an
        optimizer step)."""
        self.allocated_ahead = True
        if self.persister is None:
            return
        try:
            with statetree.probing():  # (read, not saved: no hook meant for saves runs)
                shared, local = structure.encode(state, split_per_rank=self.ck.world_size > 1)
        except Exception as e:  # the save itself reports what is wrong with the state
            log.debug("not allocating host buffers ahead (but the FileParts'): %s", e)
        else:
            self.buffers.allocate_in_background(self._tensors_to_copy(shared, local))
        fileparts = statetree.fileparts(state)
        if fileparts:
            self.part_buffers.allocate_ahead(fileparts)

    def _hook_optimizers(self, state: Any, parts: CapturedParts | None) -> None:
        """Make each optimizer's step() wait for the overlapped snapshot copies: those in the
        state and those the FileParts name (:meth:`FilePart.stepped_by`)."""
        ref = weakref.ref(self)

        @untraced
        def pre_step(*_: Any) -> None:
            saver = ref()
            if saver is not None:
                saver.wait_for_snapshot()

        optimizers = statetree.optimizers(state) + (parts.optimizers() if parts else [])
        for opt in optimizers:
            target = hookable(opt)
            if target not in self._hooked:
                self._hooked[target] = target.register_step_pre_hook(pre_step)
        if self._every_step is None:
            # and every other torch optimizer's step: one made after the save, or one not in
            # the state, that steps the same parameters (a wait with nothing pending is free)
            self._every_step = register_optimizer_step_pre_hook(pre_step)

    def release(self) -> None:
        """close(): remove the optimizer hooks and destroy the background group, once the
        host buffers being allocated ahead are made (a daemon thread still inside torch when
        the interpreter exits may abort it)."""
        self.buffers.wait_allocated()
        self.part_buffers.wait_allocated()
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        if self._every_step is not None:
            self._every_step.remove()
            self._every_step = None
        self._release_group()

    def _release_group(self) -> None:
        """Destroy the gloo group made for background saves. Scripts that never call
        ``destroy_process_group()`` (a Trainer under torchrun) would otherwise abort at exit:
        gloo's threads are torn down while still joinable ("terminate called without an active
        exception")."""
        group, self.group = self.group, None
        if group is None or not dist.is_initialized():
            return
        if self.persister is not None and self.persister.pending:
            return  # a job abandoned by close(timeout) may still use it; leave it to exit
        try:
            dist.destroy_cpu_group(group)
        except Exception as e:  # best effort: the checkpoints are committed either way
            log.debug("could not destroy the background checkpoint group: %s", e)


def new_run_id() -> str:
    """Every rank: one run id, chosen by rank 0."""
    return str(dist.broadcast_json(choose_run_id() if dist.rank() == 0 else None))


def choose_run_id() -> str:
    """A new run's id (rank 0 chooses it: :func:`new_run_id` sends it to every rank)."""
    return uuid.uuid4().hex[:16]
