"""The Checkpointer: policy -> encode -> write -> commit -> retention, and restore.

Which ranks call what: every rank constructs a Checkpointer with the same arguments and calls
``restore``, ``step``, ``save`` and ``close`` at the same points (they run collectives when
``torch.distributed`` is initialized). Rank 0 is the coordinator: it holds the directory lock,
creates the staging directory, writes the replicated state, gathers every rank's file list,
writes the manifest, commits and applies retention. Every rank writes its own ``PerRank`` state
and RNG states.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import json
import logging
import math
import os
import statistics
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from . import catalog, dist, history, layout, rng, structure
from .adaptive import LossJumpTrigger
from .background import BackgroundPersister
from .catalog import Depth, Entry, Status
from .commit import (
    RenameCommit,
    fsync_dir,
    remove_checkpoint,
    sweep_staging,
    write_latest_pointer,
)
from .config import CheckpointerConfig, ResumeMode
from .decision import Decider
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ForeignCheckpointsWarning,
    NoValidCheckpointError,
    ResumeFallbackWarning,
    UnsupportedStateError,
)
from .lock import DirLock
from .manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest, versions
from .policy import Clock
from .preemption import MetadataPoller, PreemptionWatcher
from .retention import plan
from .snapshot import HostBuffers, Snapshot, optimizer_step_storages
from .tensorfile import DirectBuffer, write_json
from .waits import SaveWaits

if TYPE_CHECKING:
    from .remote import RemoteStore
    from .sync import RemoteSync, SyncStatus

log = logging.getLogger("resilient_callbacks")

# close() without a timeout waits for uploads while the store answers, and gives up after this
# many seconds of failing attempts (what is left stays local and is named).
CLOSE_OUTAGE_S = 300.0

GRACE_ENV = "RESILIENT_GRACE_PERIOD_S"  # default grace period (s) when grace_period is None
RESUMABLE_EXIT_CODE = 75  # EX_TEMPFAIL: "temporary failure, retry": checkpoint saved, restart me


@dataclass
class _Prepared:
    shared: structure.Encoded
    local: structure.Encoded
    rng_info: dict[str, Any] | None
    rng_tensors: dict[str, torch.Tensor]
    fingerprint: str
    snapshot: Snapshot | None


def _optimizers(state: Any) -> list[torch.optim.Optimizer]:
    out: list[torch.optim.Optimizer] = []

    def rec(obj: Any) -> None:
        if isinstance(obj, structure.PerRank):
            rec(obj.obj)
        elif isinstance(obj, torch.optim.Optimizer):
            out.append(obj)
        elif isinstance(obj, Mapping):
            for v in obj.values():
                rec(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                rec(v)

    rec(state)
    return out


class _Frozen:
    """A stateful object's state_dict taken at a step boundary, for save_on_exception."""

    def __init__(self, sd: Any) -> None:
        self._sd = sd

    def state_dict(self) -> Any:
        return self._sd

    def load_state_dict(self, sd: Any) -> None:  # pragma: no cover - never restored into
        raise TypeError("a frozen state cannot be loaded into")


def _freeze(state: Any) -> Any:
    """The state as of now: modules and optimizers by reference (only an optimizer step changes
    them, which is watched), other objects' state_dicts and tensors copied, containers rebuilt."""
    if isinstance(state, structure.PerRank):
        return structure.PerRank(_freeze(state.obj))
    if isinstance(state, (torch.nn.Module, torch.optim.Optimizer)):
        return state
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if structure.is_stateful(state):
        return _Frozen(copy.deepcopy(state.state_dict()))
    if isinstance(state, Mapping):
        return {k: _freeze(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_freeze(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_freeze(v) for v in state)
    return copy.deepcopy(state)


def _prepare_error(exc: BaseException, step: int, rank: int, dirpath: str) -> BaseException:
    if isinstance(exc, UnsupportedStateError):
        return exc
    err = CheckpointWriteError(
        f"checkpoint for step {step} was not committed; failed on rank(s) {rank}: rank {rank}: "
        f"{type(exc).__name__}: {exc}. Nothing was committed and older checkpoints in {dirpath} "
        "are intact.",
        (rank,),
    )
    err.__cause__ = exc
    return err


def _flush_at_exit(ref: weakref.ReferenceType[Checkpointer]) -> None:
    ck = ref()
    if ck is not None and not ck._closed:
        try:
            ck.close()
        except Exception as e:  # at exit there is no caller left to raise to: say it loudly
            log.error("a checkpoint being written at exit failed: %s", e)


@dataclass
class SaveStats:
    step: int
    path: str
    bytes: int
    seconds: float
    reason: str


class Checkpointer:
    """Atomic, verified, pickle-free checkpoints of a training state, with retention and exact
    auto-resume. See the module docstring for which ranks call what.

    >>> ckpt = Checkpointer("ckpts/run1", every_n_steps=100, keep_last=3)   # doctest: +SKIP
    >>> start = ckpt.restore(state)                                         # doctest: +SKIP
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        every_n_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = None,
        keep_best: int = 0,
        monitor: str | None = None,
        mode: str = "min",
        keep_every_n_steps: int | None = None,
        resume: str | int | os.PathLike[str] = "auto",
        capture_rng: bool = True,
        async_save: bool = True,
        max_in_flight: int = 1,
        if_busy: str = "wait",
        overlap_snapshot: bool = False,
        adaptive: bool = False,
        mtbf_hours: float | None = None,
        max_overhead: float | None = 0.01,
        min_interval: float | None = None,
        max_interval: float | None = None,
        loss_jump: float | None = None,
        loss_key: str = "loss",
        preemption: bool = True,
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
        handle_sigint: bool = False,
        grace_period: float | None = None,
        exit_on_preemption: bool = True,
        preemption_exit_code: int = RESUMABLE_EXIT_CODE,
        metadata_notices: str | Mapping[str, Any] | None = None,
        save_on_exception: bool = False,
        remote: str | os.PathLike[str] | None = None,
        remote_options: Mapping[str, Any] | None = None,
        remote_keep_last: int | str | None = None,
        remote_keep_best: int | None = None,
        remote_timeout: float = 30.0,
    ) -> None:
        self.config = CheckpointerConfig(
            dirpath=dirpath,  # type: ignore[arg-type]
            every_n_steps=every_n_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            keep_best=keep_best,
            monitor=monitor,
            mode=mode,
            keep_every_n_steps=keep_every_n_steps,
            resume=resume,
            capture_rng=capture_rng,
            async_save=async_save,
            max_in_flight=max_in_flight,
            if_busy=if_busy,
            overlap_snapshot=overlap_snapshot,
            adaptive=adaptive,
            mtbf_hours=mtbf_hours,
            max_overhead=max_overhead,
            min_interval=min_interval,
            max_interval=max_interval,
            loss_jump=loss_jump,
            loss_key=loss_key,
            preemption=preemption,
            signals=tuple(signals),
            handle_sigint=handle_sigint,
            grace_period=grace_period,
            exit_on_preemption=exit_on_preemption,
            preemption_exit_code=preemption_exit_code,
            metadata_notices=metadata_notices,
            save_on_exception=save_on_exception,
            remote=remote,  # type: ignore[arg-type]
            remote_options=dict(remote_options) if remote_options is not None else None,
            remote_keep_last=remote_keep_last,
            remote_keep_best=remote_keep_best,
            remote_timeout=remote_timeout,
        )
        self.dirpath: str = self.config.dirpath
        self.policy = self.config.save_policy()
        self.retention = self.config.local_retention_policy()
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self.is_coordinator = self.rank == 0
        self.run_id: str | None = None
        self.last_saved_step: int | None = None
        self.last_save: SaveStats | None = None
        self.restored_from: str | None = None
        self._lock = DirLock(self.dirpath)
        self._commit = RenameCommit(self.dirpath)
        self._clock = Clock()
        self._seq = 0
        self._closed = False
        self._warned_no_trigger = False
        self._reported_foreign = False
        self._checked_foreign = False
        self.skipped_saves = 0
        self.save_waits = SaveWaits(speak=self.is_coordinator)
        self.committed_saves = 0
        self.blocking_seconds: deque[float] = deque(maxlen=100)
        self._buffers = HostBuffers()
        self._allocated_ahead = False
        self.close_wait_seconds = 0.0  # how long close() waited for pending saves
        self._bounce: DirectBuffer | None = None  # O_DIRECT writes of background saves
        self._last_snapshot: Snapshot | None = None
        self._hooked: dict[int, Any] = {}
        self._persister: BackgroundPersister | None = None
        self._group: Any = None
        self.preempted = False
        self._consistent_point: Any = None
        self._step_watch: dict[int, Any] = {}
        self._decider = Decider()
        self._pending_jump = False
        self._last_step_end: float | None = None
        self._step_seconds: deque[float] = deque(maxlen=50)
        self._save_seconds: deque[float] = deque(maxlen=9)
        self._persist_seconds: deque[float] = deque(maxlen=9)
        self._steps_origin = 0  # step of the last save or restore: adaptive counts from there
        self.schedule = self.config.adaptive_schedule()
        self._loss_trigger = (
            LossJumpTrigger(threshold=self.config.loss_jump) if self.config.loss_jump else None
        )
        self.watcher: PreemptionWatcher | None = None
        self._poller: MetadataPoller | None = None
        self.remote: RemoteStore | None = None
        self._sync: RemoteSync | None = None
        self._retention_lock = threading.Lock()
        self._open()
        if self.config.preemption:
            grace = self.config.grace_period
            if grace is None and os.environ.get(GRACE_ENV):
                # set by the job recipes from the scheduler's grace period
                try:
                    grace = float(os.environ[GRACE_ENV])
                except ValueError:
                    log.warning(
                        "ignoring %s=%r: not a number of seconds", GRACE_ENV, os.environ[GRACE_ENV]
                    )
            self.watcher = PreemptionWatcher(
                signals=self.config.signals,
                handle_sigint=self.config.handle_sigint,
                grace_period_s=grace,
            )
            self.watcher.install()
            if self.config.metadata_notices is not None:
                opts = self.config.metadata_notices
                opts = {"kind": opts} if isinstance(opts, str) else dict(opts)
                self._poller = MetadataPoller(self.watcher, **opts).start()
        if self.config.async_save:
            self._group = dist.new_cpu_group()
            self._persister = BackgroundPersister(self.config.max_in_flight)
            ref = weakref.ref(self)
            atexit.register(_flush_at_exit, ref)

    # ------------------------------------------------------------------ lifecycle

    def _open(self) -> None:
        error = None
        if self.is_coordinator:
            try:
                os.makedirs(self.dirpath, exist_ok=True)
                self._lock.acquire()
                swept = sweep_staging(self.dirpath)
                if swept:
                    log.warning(
                        "removed %d leftover(s) of interrupted saves or deletions: %s",
                        len(swept),
                        ", ".join(swept),
                    )
                self._seq = catalog.next_seq(self.dirpath) - 1
                if self.config.remote is not None:
                    self._open_remote()
            except CheckpointError as e:
                error = {"type": type(e).__name__, "msg": str(e)}
                self._pending_error: BaseException = e
            except OSError as e:
                error = {
                    "type": "OSError",
                    "msg": (
                        f"cannot use {self.dirpath} as a checkpoint directory: {e.strerror or e}. "
                        "Check that the path is right and writable by this user."
                    ),
                }
                self._pending_error = CheckpointWriteError(error["msg"])
                self._pending_error.__cause__ = e
        error = dist.broadcast_json(error)
        if error is not None:
            if self.is_coordinator:
                if self._sync is not None:
                    self._sync.stop()
                self._lock.release()
                raise self._pending_error
            if error["type"] == "OSError":
                raise CheckpointWriteError(
                    f"rank 0 could not open the checkpoint directory: {error['msg']}"
                )
            raise _error_type(error["type"])(f"on rank 0: {error['msg']}")

    def _open_remote(self) -> None:
        """Coordinator: connect to the remote tier and prove it usable (a clear error now, not
        after hours of training), then start the uploader."""
        from .remote import RemoteStore
        from .sync import RemoteSync

        assert self.config.remote is not None
        self.remote = RemoteStore(self.config.remote, self.config.remote_options)
        self.remote.preflight(timeout=self.config.remote_timeout)
        self._sync = RemoteSync(
            self.remote,
            self.dirpath,
            self.config.remote_retention_policy(),
            after_upload=self._retention_after_upload,
        )
        self._sync.refresh()

    def _retention_after_upload(self) -> None:
        if self.run_id is not None:
            self._apply_retention(protect=None)

    def close(self, timeout: float | None = None) -> None:
        """Wait for background saves to commit, then release the directory. Raises the error of
        a background save that failed (after releasing). ``timeout``: seconds to wait for
        pending saves; what is still pending then is reported and abandoned (never committed
        half-way: a save commits atomically or not at all)."""
        if self._closed:
            return
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self._persister is not None:
                pending = self._persister.pending
                if pending:
                    log.info("waiting for %d checkpoint(s) still being written ...", pending)
                t_wait = time.perf_counter()
                finished = self._persister.wait_all(timeout)
                self.close_wait_seconds = time.perf_counter() - t_wait
                if pending and finished:
                    # the end of training waits for the last checkpoint to be durable: say how long
                    log.info(
                        "close(): the last checkpoint (%s) became durable after a %.2f s wait",
                        self.last_save.path if self.last_save else None,
                        self.close_wait_seconds,
                    )
                if not finished:
                    log.warning(
                        "close(): %d checkpoint(s) were still being written after %s s and were "
                        "abandoned; the newest committed checkpoint is %s",
                        self._persister.pending,
                        timeout,
                        self.last_save.path if self.last_save else None,
                    )
                else:
                    self._persister.stop()
            if self._sync is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._finish_uploads(left)
            if self._persister is not None:
                self.save_waits.log_summary()
                self._persister.raise_error()
        finally:
            if self._sync is not None:
                self._sync.stop()
            self._release_group()
            for handle in [*self._hooked.values(), *self._step_watch.values()]:
                handle.remove()
            self._hooked.clear()
            self._step_watch.clear()
            self._consistent_point = None
            if self._poller is not None:
                self._poller.stop()
            if self.watcher is not None:
                self.watcher.uninstall()
            self._lock.release()

    @property
    def waits_for_previous(self) -> int:
        """How many background saves of this rank waited for the previous one to be written."""
        return self.save_waits.waits

    def _release_group(self) -> None:
        """Destroy the gloo group made for background saves. Scripts that never call
        ``destroy_process_group()`` (a Trainer under torchrun) would otherwise abort at exit:
        gloo's threads are torn down while still joinable ("terminate called without an active
        exception")."""
        group, self._group = self._group, None
        if group is None or not dist.is_initialized():
            return
        if self._persister is not None and self._persister.pending:
            return  # a job abandoned by close(timeout) may still use it; leave it to exit
        try:
            torch.distributed.destroy_process_group(group)
        except Exception as e:  # best effort: the checkpoints are committed either way
            log.debug("could not destroy the background checkpoint group: %s", e)

    def _finish_uploads(self, timeout: float | None) -> None:
        """close(): wait for the uploads (a progress bar on a terminal), then say what, if
        anything, is still only local."""
        assert self._sync is not None and self.remote is not None
        status = self._sync.status()
        if status.pending:
            log.warning(
                "waiting for %d checkpoint(s) to upload to %s: %s%s",
                len(status.pending),
                self.remote.url,
                ", ".join(status.pending),
                "" if timeout is None else f" (at most {timeout:.0f} s)",
            )
            self._sync.show_progress = True
        if self._wait_uploads(timeout):
            if status.pending:
                log.warning("all checkpoints are uploaded to %s", self.remote.url)
            return
        status = self._sync.status()
        log.warning(
            "close(): %d checkpoint(s) are still only local in %s, not in %s: %s (last error: "
            "%s). They are kept locally; the next run with the same dirpath and remote uploads "
            "them, or run `resilient-ckpt push %s %s`.",
            len(status.pending),
            self.dirpath,
            self.remote.url,
            ", ".join(status.pending),
            status.last_error or "none, still uploading",
            self.dirpath,
            self.remote.url,
        )

    def _wait_uploads(self, timeout: float | None) -> bool:
        """Wait for the upload queue to drain: up to ``timeout``, and without a timeout for
        as long as the store answers; after CLOSE_OUTAGE_S of failing attempts, give up (a
        job must not hang at exit through a long outage; what is left stays local)."""
        assert self._sync is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        outage_since: float | None = None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return self._sync.wait(0)
            if self._sync.wait(1.0 if left is None else min(left, 1.0)):
                return True
            if self._sync.status().failures:
                outage_since = outage_since or time.monotonic()
                if timeout is None and time.monotonic() - outage_since > CLOSE_OUTAGE_S:
                    return False
            else:
                outage_since = None

    def remote_status(self) -> SyncStatus | None:
        """The upload backlog and counters (coordinator; None without ``remote`` or on other
        ranks)."""
        return self._sync.status() if self._sync is not None else None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc is not None and not self._closed:
                self._save_on_exception(exc)
        finally:
            self.close()
        # returning None: the exception propagates unchanged

    def _save_on_exception(self, exc: BaseException) -> None:
        point = self._consistent_point
        if not self.config.save_on_exception or point is None:
            return
        if isinstance(exc, (CheckpointError, SystemExit)):
            return  # our own failure, or a deliberate exit (preemption already saved)
        if self.world_size > 1:
            log.warning(
                "save_on_exception: not saving after %s with several ranks (the other ranks "
                "cannot join the save); the newest checkpoint is the last periodic one",
                type(exc).__name__,
            )
            return
        step, frozen, rng_state, stepped = point
        if stepped[0]:
            log.warning(
                "save_on_exception: %s came after an optimizer step that step() never saw; the "
                "state matches no step, so nothing is saved",
                type(exc).__name__,
            )
            return
        log.warning(
            "%s during training: saving the state of step %d (unchanged since) before it "
            "propagates",
            type(exc).__name__,
            step,
        )
        try:
            self._wait_background()
            self._save(
                step,
                frozen,
                None,
                "emergency",
                why=f"exception {type(exc).__name__}",
                rng_state=rng_state,
            )
        except Exception as e:
            log.error("save_on_exception: the emergency save failed: %s", e)

    def _mark_consistent(self, step: int, state: Any) -> None:
        """Remember what step ``step``'s state is, cheaply: modules and optimizers by reference
        (an optimizer-step hook notices if they change), everything else copied."""
        stepped = [False]
        self._watch_optimizers(state, stepped)
        rng_state = rng.capture() if self.config.capture_rng else (None, {})
        self._consistent_point = (step, _freeze(state), rng_state, stepped)

    def flush(self) -> None:
        """Block until every background save has committed; raise if one failed."""
        self._wait_background()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one to save again")

    # ------------------------------------------------------------------ saving

    def step(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        final: bool = False,
    ) -> bool:
        """Call once per training step with the number of completed steps; saves when the
        policy says so. Returns True if it saved.

        ``final=True`` marks the last step of the run: it is saved whatever the schedule (unless
        that step is already saved), so re-running a finished job restores the end and trains
        nothing. Every rank passes the same ``final``.

        On a preemption request (SIGTERM, SIGUSR1, a cloud notice) it makes an emergency save
        of this step and, with ``exit_on_preemption`` (default), exits the process with
        ``preemption_exit_code`` (75); otherwise it returns and sets :attr:`preempted`."""
        self._check_open()
        now = time.perf_counter()
        if self._last_step_end is not None:
            compute = now - self._last_step_end  # time outside step(): the training step
            self._step_seconds.append(compute)
            if self.schedule is not None:
                self.schedule.observe_step(compute)
        try:
            saved = self._step(step, state, metrics, final)
            if not saved and not self._allocated_ahead:
                self._allocate_ahead(state)
            return saved
        finally:
            if self.config.save_on_exception and not self._closed:
                self._mark_consistent(step, state)
            self._last_step_end = time.perf_counter()

    def _step(self, step: int, state: Any, metrics: Mapping[str, Any] | None, final: bool) -> bool:
        reason = self.policy.due_by_step(step)
        preempt = self.watcher is not None and self.watcher.requested
        time_due = bool(
            self.policy.every_seconds and self._clock.elapsed() >= self.policy.every_seconds
        )
        loss = metrics.get(self.config.loss_key) if metrics else None
        if (
            self._loss_trigger is not None
            and loss is not None
            and self._loss_trigger.observe(float(loss))
        ):
            self._pending_jump = True
        proposal = self.schedule.interval_steps() if self.schedule is not None else 0
        step_time = (
            statistics.median(self._step_seconds)
            if self.world_size > 1 and self._step_seconds
            else None
        )
        # Conditions that differ between ranks are agreed on at decision steps (one small
        # all_reduce); between them nothing is exchanged and those conditions wait.
        decided = self._decider.decide(
            step, [int(preempt), int(time_due), int(self._pending_jump), proposal], step_time
        )
        if decided is None:
            preempt = time_due = jump = False
        else:
            preempt, time_due, jump = bool(decided[0]), bool(decided[1]), bool(decided[2])
            self._pending_jump = False
            if self.schedule is not None and self.world_size > 1:
                self.schedule.adopt(decided[3])
        if preempt:
            return self._emergency(step, state, metrics)
        if reason is None and time_due:
            reason = f"every_seconds={self.policy.every_seconds:g}"
        if reason is None and jump:
            reason = f"loss jump ({self._loss_trigger.last_reason if self._loss_trigger else ''})"
        if (
            reason is None
            and self.schedule is not None
            and (decided is not None or self.world_size == 1)
            and self.schedule.should_save(step - self._steps_origin)
        ):
            reason = f"adaptive: {self.schedule.describe()}"
        if final:
            # never skipped for a busy disk (if_busy applies to periodic saves only)
            return self._save(step, state, metrics, "final", why=reason or "final step")
        if reason is None:
            if (
                not self.policy.has_trigger
                and self.schedule is None
                and not self._warned_no_trigger
            ):
                self._warned_no_trigger = True
                log.warning(
                    "Checkpointer.step() called but no trigger is configured "
                    "(every_n_steps / every_seconds / adaptive); only save() will write checkpoints"
                )
            return False
        return self._save(step, state, metrics, "periodic", why=reason)

    def _emergency(self, step: int, state: Any, metrics: Mapping[str, Any] | None) -> bool:
        """Preemption: flush background saves, save this step synchronously, then stop."""
        req = self.watcher.request if self.watcher is not None else None
        source = req.source if req is not None else "request"
        if self.watcher is not None:
            estimate = max(self._save_seconds, default=0.0)
            warning = self.watcher.check_grace(estimate) if estimate else None
            if warning:
                log.warning(warning)
        log.warning("preemption (%s): saving step %d before stopping", source, step)
        self._wait_background()
        saved = self._save(step, state, metrics, "emergency", why=f"preemption ({source})")
        self.preempted = True
        if self.config.exit_on_preemption:
            log.warning(
                "checkpoint of step %d committed; exiting with code %d so the scheduler "
                "restarts the job, which resumes from it",
                step,
                self.config.preemption_exit_code,
            )
            left = self.watcher.remaining_grace_s() if self.watcher is not None else None
            # uploads may use what is left of the grace period, keeping a margin to exit
            self.close(timeout=None if left is None else max(0.0, left - 5.0))
            raise SystemExit(self.config.preemption_exit_code)
        return saved

    def emergency_save(
        self, step: int, state: Any, metrics: Mapping[str, Any] | None = None
    ) -> bool:
        """Flush background saves and save ``step`` synchronously (fastest complete path), for
        callers that detect a failure themselves. Every rank must call it."""
        self._check_open()
        self._wait_background()
        return self._save(step, state, metrics, "emergency", why="emergency_save()")

    def save(self, step: int, state: Any, metrics: Mapping[str, Any] | None = None) -> bool:
        """Save now. Returns False (and writes nothing) if the last checkpoint this Checkpointer
        committed or restored is of this same ``step`` (the same state, saved twice)."""
        self._check_open()
        return self._save(step, state, metrics, "forced", why="save() called")

    def _save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        reason: str,
        why: str,
        rng_state: tuple[Any, dict[str, torch.Tensor]] | None = None,
    ) -> bool:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be an int >= 0, got {step!r}")
        if self.last_saved_step == step:
            log.debug("step %d is already saved by this run; not saving it twice", step)
            return False
        background = self._persister is not None and reason != "emergency"
        waited = 0.0
        if self._persister is not None:
            # every rank reaches this point at the same step, so they skip together
            if (
                self.config.if_busy == "skip"
                and reason == "periodic"
                and dist.any_true(self._persister.busy)
            ):
                self.skipped_saves += 1
                log.warning(
                    "skipped the save at step %d: the previous checkpoint is still being "
                    "written (if_busy='skip'); %d skipped so far",
                    step,
                    self.skipped_saves,
                )
                return False
            if not background:
                waited = self._wait_background()  # emergency: flush, then a synchronous save
            else:
                waited = self._persister.wait_for_slot()
                self.save_waits.observe(step, waited, self._clock.elapsed())
        self._raise_background_error()  # a failed earlier save surfaces here, never lost
        t0 = time.perf_counter()
        clean_metrics = _clean_metrics(metrics)
        if self.run_id is None:
            self.run_id = dist.broadcast_json(
                uuid.uuid4().hex[:16] if self.is_coordinator else None
            )
            if self.is_coordinator:
                self._record("start", step)

        if self.is_coordinator and not self._checked_foreign:
            self._checked_foreign = (
                True  # in the training thread, so the warning reaches the caller
            )
            self._report_foreign(catalog.scan(self.dirpath, Depth.NONE))
        prepared: _Prepared | None = None
        local_exc: BaseException | None = None
        try:
            prepared = self._prepare(state, copy=background, rng_state=rng_state)
        except Exception as e:  # reported to every rank by the persist step
            local_exc = e
        job = functools.partial(
            self._persist, step, prepared, local_exc, clean_metrics, reason, why, t0, background
        )
        if background:
            assert self._persister is not None
            if local_exc is not None:
                # This rank failed before anything was written: it raises now; the other ranks
                # learn it from the persist step's gather (and raise on their next save/close).
                if self.world_size > 1:
                    self._persister.submit(functools.partial(job, quiet=True))
                raise _prepare_error(local_exc, step, self.rank, self.dirpath)
            self._persister.submit(job)
            self.last_saved_step = step
            self._steps_origin = step
            self._clock.reset()
            blocking = time.perf_counter() - t0 + waited  # what the training loop waited, in all
            self.blocking_seconds.append(blocking)
            self._observe_save(blocking)
            log.debug("step %d: snapshot took %.3f s; persisting in the background", step, blocking)
            return True
        job()
        self._steps_origin = step
        self._observe_save(time.perf_counter() - t0)
        return True

    def _observe_save(self, blocking: float) -> None:
        self._save_seconds.append(blocking)
        if self.schedule is not None:
            persist = statistics.median(self._persist_seconds) if self._persist_seconds else None
            self.schedule.observe_save(blocking, persist)

    def _record(self, event: str, step: int) -> None:
        """Append to the directory's run history (coordinator only)."""
        try:
            history.append(self.dirpath, event, step, self.run_id, self.world_size)
        except OSError as e:
            log.warning("could not record the %s in %s: %s", event, self.dirpath, e)

    def _wait_background(self) -> float:
        if self._persister is None:
            return 0.0
        t0 = time.perf_counter()
        self._persister.wait_all()
        self._raise_background_error()
        return time.perf_counter() - t0

    def _raise_background_error(self) -> None:
        if self._persister is not None:
            self._persister.raise_error()

    def wait_for_snapshot(self) -> None:
        """Order what comes next after the last save's overlapped snapshot copy. With
        ``overlap_snapshot=True`` call it before anything changes parameters or optimizer state
        other than the optimizers in the saved state (their ``step()`` calls it automatically).
        CPU copies are waited for; on a GPU the current stream waits for the copy on the GPU, so
        kernels launched afterwards run after it while the CPU goes on."""
        snap = self._last_snapshot
        if snap is not None:
            snap.wait_device()
            self._last_snapshot = None

    def _prepare(
        self,
        state: Any,
        copy: bool,
        rng_state: tuple[Any, dict[str, torch.Tensor]] | None = None,
    ) -> _Prepared:
        """Encode the state (training thread) and, for a background save, copy its tensors into
        the reused host buffers; only what this rank writes is copied."""
        shared, local = structure.encode(state, split_per_rank=self.world_size > 1)
        fingerprint = _fingerprint(state)
        if rng_state is not None:
            rng_info, rng_tensors = rng_state
        else:
            rng_info, rng_tensors = rng.capture() if self.config.capture_rng else (None, {})
        snap = None
        if copy:
            self.wait_for_snapshot()
            tensors = self._tensors_to_copy(shared, local)
            overlap = None
            if self.config.overlap_snapshot:
                overlap = optimizer_step_storages(state)
                self._hook_optimizers(state)
            self._buffers.keep_only(tensors)
            if self._bounce is None:  # with the host buffers: later saves allocate nothing
                self._bounce = DirectBuffer()
            snap = Snapshot(tensors, self._buffers, overlap_storages=overlap)
            self._last_snapshot = snap if self.config.overlap_snapshot else None
            copies = snap.copies
            shared = structure.Encoded(
                shared.structure, {k: copies[k] for k in shared.tensors if k in copies}
            )
            local = structure.Encoded(None, {k: copies[k] for k in local.tensors}, local.per_rank)
        return _Prepared(shared, local, rng_info, rng_tensors, fingerprint, snap)

    def _tensors_to_copy(
        self, shared: structure.Encoded, local: structure.Encoded
    ) -> dict[str, torch.Tensor]:
        """The tensors this rank writes: its own, and the shared ones on the coordinator."""
        tensors = dict(local.tensors)
        if self.is_coordinator:
            tensors.update(shared.tensors)
        return tensors

    def _allocate_ahead(self, state: Any) -> None:
        """Once, at the first step that does not save: start allocating the host buffers of a
        background save in a helper thread, so the first save does not pay for them on the
        training thread (seconds for a few GB). Optimizer state exists by then (step() follows an
        optimizer step)."""
        self._allocated_ahead = True
        if self._persister is None:
            return
        try:
            shared, local = structure.encode(state, split_per_rank=self.world_size > 1)
        except Exception as e:  # the save itself reports what is wrong with the state
            log.debug("not allocating host buffers ahead: %s", e)
            return
        self._buffers.allocate_in_background(self._tensors_to_copy(shared, local))

    def _watch_optimizers(self, state: Any, stepped: list[bool]) -> None:
        """Flag ``stepped[0]`` when any optimizer in the state steps (save_on_exception)."""
        for opt in _optimizers(state):
            old = self._step_watch.pop(id(opt), None)
            if old is not None:
                old.remove()

            def post_step(*_: Any, _flag: list[bool] = stepped) -> None:
                _flag[0] = True

            self._step_watch[id(opt)] = opt.register_step_post_hook(post_step)

    def _hook_optimizers(self, state: Any) -> None:
        """Make each optimizer's step() wait for the overlapped snapshot copy."""
        ref = weakref.ref(self)

        def pre_step(*_: Any) -> None:
            ck = ref()
            if ck is not None:
                ck.wait_for_snapshot()

        for opt in _optimizers(state):
            if id(opt) not in self._hooked:
                self._hooked[id(opt)] = opt.register_step_pre_hook(pre_step)

    def _persist(
        self,
        step: int,
        prepared: _Prepared | None,
        local_exc: BaseException | None,
        clean_metrics: dict[str, float | None],
        reason: str,
        why: str,
        t0: float,
        background: bool,
        quiet: bool = False,
    ) -> None:
        """Write this rank's files, gather, commit (coordinator), retention. Runs in the
        background thread for background saves (collectives on the checkpoint's own group)."""
        group = self._group if background else None
        staging, error = None, None
        if self.is_coordinator:
            try:
                staging = self._commit.begin(step)
            except OSError as e:
                error = f"cannot create a staging directory in {self.dirpath}: {e}"
        msg = dist.broadcast_json({"staging": staging, "error": error}, group=group)
        staging_dir: str | None = msg["staging"]

        files: list[dict[str, Any]] = []
        if local_exc is None and staging_dir is not None:
            assert prepared is not None
            try:
                if prepared.snapshot is not None:
                    prepared.snapshot.wait_host()
                entries = layout.write_part(
                    staging_dir,
                    self.rank,
                    prepared.shared if self.is_coordinator else None,
                    prepared.local,
                    prepared.rng_info,
                    prepared.rng_tensors,
                    direct=background,  # no page-cache copy competing with training
                    bounce=self._bounce if background else None,
                )
                files = [e.__dict__ for e in entries]
            except Exception as e:  # reported to every rank below; nothing is committed
                local_exc = e
        report = {
            "rank": self.rank,
            "files": files,
            "error": None if local_exc is None else f"{type(local_exc).__name__}: {local_exc}",
        }
        reports = dist.all_gather_json(report, group=group)
        failed = [r for r in reports if r["error"]]

        outcome: dict[str, Any] = {"ok": False, "path": None, "error": msg["error"]}
        if self.is_coordinator and staging_dir is not None:
            if failed:
                self._commit.abort(staging_dir)
            else:
                try:
                    outcome = {
                        "ok": True,
                        "path": self._commit_manifest(
                            staging_dir, step, reports, clean_metrics, reason, prepared
                        ),
                        "error": None,
                    }
                except Exception as e:
                    self._commit.abort(staging_dir)
                    local_exc = local_exc or e
                    outcome = {"ok": False, "path": None, "error": f"{type(e).__name__}: {e}"}
        outcome = dist.broadcast_json(outcome, group=group)

        if not outcome["ok"]:
            if quiet:
                return  # this rank already raised its own error in the training thread
            if background:
                self.last_saved_step = None
            if failed:
                ranks = tuple(r["rank"] for r in failed)
                detail = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
            else:
                ranks, detail = (0,), f"rank 0 (commit): {outcome['error']}"
            if isinstance(local_exc, UnsupportedStateError) and not background:
                raise local_exc
            msg_text = (
                f"checkpoint for step {step} was not committed; failed on rank(s) "
                f"{', '.join(map(str, ranks))}: {detail}. Nothing was committed and older "
                f"checkpoints in {self.dirpath} are intact."
            )
            err = CheckpointWriteError(msg_text, ranks)
            if isinstance(local_exc, OSError) and local_exc.errno:
                err.errno = local_exc.errno
            raise err from local_exc

        if not background:
            self.last_saved_step = step
            self._clock.reset()
        elapsed = time.perf_counter() - t0
        if background:
            self._persist_seconds.append(elapsed)
        size = sum(f["size"] for r in reports for f in r["files"])
        self.last_save = SaveStats(step, outcome["path"], size, elapsed, reason)
        self.committed_saves += 1
        log.info(
            "saved step %d (%s, %.1f MB, %.3f s%s) -> %s",
            step,
            why,
            size / 1e6,
            elapsed,
            ", in the background" if background else "",
            outcome["path"],
        )
        if self.is_coordinator:
            name = os.path.basename(outcome["path"])
            if self._sync is not None:
                self._sync.enqueue(name)
            self._apply_retention(protect=name)

    def _commit_manifest(
        self,
        staging_dir: str,
        step: int,
        reports: list[dict[str, Any]],
        clean_metrics: dict[str, float | None],
        reason: str,
        prepared: _Prepared | None,
    ) -> str:
        seq = self._seq + 1
        assert self.run_id is not None
        manifest = Manifest(
            step=step,
            run_id=self.run_id,
            seq=seq,
            world_size=self.world_size,
            files=[FileEntry(**f) for r in reports for f in r["files"]],
            metrics=clean_metrics,
            reason=reason,
            fingerprint=prepared.fingerprint if prepared else "",
            retention=self.retention.to_json(),
            versions=versions(),
            extra={"schedule": self.schedule.state_dict()} if self.schedule is not None else {},
        )
        missing = [
            f.path for f in manifest.files if not os.path.exists(os.path.join(staging_dir, f.path))
        ]
        if missing:
            raise CheckpointWriteError(
                f"files written by other ranks are not visible to rank 0: {missing}. "
                "With several ranks, dirpath must be on a filesystem all ranks share."
            )
        write_json(os.path.join(staging_dir, MANIFEST_NAME), manifest.to_json())
        final = self._commit.commit(staging_dir, step)
        self._seq = seq
        try:
            write_latest_pointer(self.dirpath, os.path.basename(final))
        except OSError as e:
            log.warning("could not update the advisory 'latest' pointer: %s", e)
        return final

    # ------------------------------------------------------------------ retention

    def _apply_retention(self, protect: str | None) -> None:
        """Coordinator: apply the local retention policy. With a remote tier, a checkpoint
        whose remote copy is not committed yet is never deleted (it is the only copy)."""
        with self._retention_lock:  # the persist and the upload threads both call this
            entries = catalog.scan(self.dirpath, Depth.SIZE)
            cands = catalog.retention_candidates(entries)
            protected = [protect] if protect else []
            if self._sync is not None:
                protected += self._sync.pending()
            p = plan(cands, self.retention, self.run_id, protected=protected)
            for name in p.delete:
                path = os.path.join(self.dirpath, name)
                try:
                    remove_checkpoint(path)
                    log.info("retention: deleted %s", name)
                except OSError as e:
                    log.warning("retention: could not delete %s: %s", path, e)

    def _report_foreign(self, entries: list[Entry]) -> None:
        if self._reported_foreign or self.run_id is None:
            return
        foreign = [
            e for e in entries if e.manifest is not None and e.manifest.run_id != self.run_id
        ]
        if not foreign:
            return
        self._reported_foreign = True
        runs = sorted({e.manifest.run_id for e in foreign if e.manifest})
        steps = [e.manifest.step for e in foreign if e.manifest]
        msg = (
            f"{self.dirpath} holds {len(foreign)} checkpoint(s) of {len(runs)} other run(s) "
            f"({', '.join(runs)}; steps {min(steps)}..{max(steps)}). Retention does not count "
            "or delete them; use a separate dirpath per run, or remove them with "
            "`resilient-ckpt gc`."
        )
        warnings.warn(msg, ForeignCheckpointsWarning, stacklevel=4)
        log.warning(msg)

    # ------------------------------------------------------------------ restoring

    def restore(self, state: Any) -> int:
        """Load the checkpoint chosen by ``resume`` into ``state`` in place; return its step,
        or 0 when there is nothing to resume from. Every rank calls it."""
        self._check_open()
        self._wait_background()
        cands: list[dict[str, Any]] = []
        error = None
        if self.is_coordinator:
            try:
                cands = self._candidates()
            except Exception as e:  # reported to every rank, so none is left waiting
                error = {"type": type(e).__name__, "msg": str(e)}
                self._pending_error = e
        msg = dist.broadcast_json({"cands": cands, "error": error})
        if msg["error"] is not None:
            if self.is_coordinator:
                raise self._pending_error
            raise _error_type(msg["error"]["type"])(msg["error"]["msg"])
        cands = msg["cands"]
        explicit = self.config.resume not in (ResumeMode.AUTO, ResumeMode.NEVER)
        if not cands:
            self._clock.reset()
            if self.run_id is None:
                self.run_id = dist.broadcast_json(
                    uuid.uuid4().hex[:16] if self.is_coordinator else None
                )
                if self.is_coordinator:
                    self._record("start", 0)
            return 0
        skipped: list[str] = []
        for c in cands:
            if c.get("remote") and not c["problem"]:
                c = self._fetch_remote(c)
            if c["problem"]:
                skipped.append(f"{c['path']}: {c['problem']}")
                if explicit:
                    raise CheckpointCorruptError(f"cannot resume from {c['path']}: {c['problem']}")
                self._warn_fallback(c, c["problem"])
                continue
            step = self._try_load(c, state, explicit, skipped)
            if step is not None:
                return step
        raise NoValidCheckpointError(
            f"{self.dirpath} holds {len(cands)} checkpoint(s) but none can be restored:\n  - "
            + "\n  - ".join(skipped)
            + "\nRefusing to start from scratch silently. Repair or remove the bad checkpoints "
            "(`resilient-ckpt verify`/`gc --remove-corrupt`), pass resume=<path or step> of a "
            "good one, or resume='never' to start fresh."
        )

    def _warn_fallback(self, c: dict[str, Any], problem: str) -> None:
        msg = (
            f"skipping checkpoint {c['path']} (step {c['step']}): {problem}; "
            "falling back to an older checkpoint"
        )
        if self.is_coordinator:
            warnings.warn(msg, ResumeFallbackWarning, stacklevel=3)
        log.warning(msg)

    def _try_load(
        self, c: dict[str, Any], state: Any, explicit: bool, skipped: list[str]
    ) -> int | None:
        path = c["path"]
        part, problem = None, None
        try:
            manifest = read_manifest(path)
            part = layout.read_part(path, manifest, self.rank)
        except (CheckpointCorruptError, OSError) as e:
            problem = str(e)
        except (
            Exception
        ) as e:  # malformed content: as corrupt, and every rank must reach the gather
            problem = f"unreadable checkpoint ({type(e).__name__}: {e})"
        problems = dist.all_gather_json(problem)
        bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
        if bad:
            why = "; ".join(bad)
            skipped.append(f"{path}: {why}")
            if explicit:
                raise CheckpointCorruptError(f"cannot resume from {path}: {why}")
            self._warn_fallback(c, why)
            return None
        assert part is not None
        local_exc: BaseException | None = None
        warns: list[str] = []
        try:
            full = structure.inline_per_rank(part.structure, part.per_rank)
            meta = {
                k: (str(t.dtype).removeprefix("torch."), list(t.shape))
                for k, t in part.tensors.items()
            }
            structure.check_fits(state, full, meta)
            # The loaded tensors are private allocations: objects may keep them (optimizers do).
            structure.apply(state, full, lambda n: structure.decode(n, part.tensors))
            if self.config.capture_rng:
                if part.rng is not None:
                    warns = rng.restore(part.rng, part.tensors)
                elif self.rank < manifest.world_size:
                    warns = [
                        "the checkpoint was saved without RNG states (capture_rng=False); "
                        "random streams are not restored"
                    ]
                else:
                    warns = [
                        f"rank {self.rank} has no RNG state in this checkpoint (written by "
                        f"{manifest.world_size} rank(s)); its random streams start fresh"
                    ]
        except Exception as e:
            local_exc = e
        errors = dist.all_gather_json(
            None if local_exc is None else f"{type(local_exc).__name__}: {local_exc}"
        )
        if any(errors):
            if local_exc is not None:
                raise local_exc
            first = next(r for r, e in enumerate(errors) if e)
            raise CheckpointMismatchError(f"restore failed on rank {first}: {errors[first]}")
        for w in warns:
            warnings.warn(w, stacklevel=3)
        inside = os.path.dirname(os.path.abspath(path)) == self.dirpath
        self.run_id = manifest.run_id if inside else None
        self.last_saved_step = manifest.step if inside else None
        self.restored_from = path
        self._clock.reset()
        self._steps_origin = manifest.step
        if self.schedule is not None:
            saved_schedule = manifest.extra.get("schedule")
            if inside and isinstance(saved_schedule, dict):
                try:
                    self.schedule.load_state_dict(saved_schedule)
                except Exception as e:  # measurements only: start measuring afresh
                    log.warning("could not restore the adaptive schedule's measurements: %s", e)
        if self.is_coordinator and inside:
            self._record("restart", manifest.step)  # a resume means the run stopped early
            self._checked_foreign = True
            self._report_foreign(catalog.scan(self.dirpath, Depth.NONE))
        if self.schedule is not None:
            events = history.read(self.dirpath) if self.is_coordinator else []
            start, restarts = history.failures(events, self.run_id)
            start, restarts = dist.broadcast_json([start, restarts])
            if start is not None:
                self.schedule.set_restart_history(restarts, start)
        if self.is_coordinator and inside and self._sync is not None:
            self._reconcile_uploads()
        if self.is_coordinator and inside and self.config.resume == ResumeMode.AUTO:
            # Catch up on a retention pass a crash interrupted (killed between commit and
            # deletion), so repeated crashes cannot pile up checkpoints beyond the limits.
            self._apply_retention(protect=os.path.basename(path))
        log.info("restored step %d from %s", manifest.step, path)
        return manifest.step

    def _candidates(self) -> list[dict[str, Any]]:
        """Coordinator: the checkpoints to try, best first, each with a size-level problem."""
        r = self.config.resume
        if r == ResumeMode.NEVER:
            return []
        if isinstance(r, str) and r != ResumeMode.AUTO:
            path = os.path.abspath(os.path.expanduser(r))
            if not os.path.exists(path):
                raise CheckpointNotFoundError(f"resume={r!r}: no such checkpoint directory")
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
            return [{"path": path, "step": m.step, "problem": problem}]
        found = catalog.committed(catalog.scan(self.dirpath, Depth.SIZE))
        # Checkpoints whose manifest cannot be read have no commit number: they may be the
        # newest, so they are tried (and reported as skipped) first, never silently ignored.
        cands = [
            {"path": e.path, "step": e.step, "problem": e.problem}
            for e in found
            if e.manifest is None
        ]
        cands += self._merge_tiers([e for e in found if e.manifest is not None])
        if isinstance(r, int):
            chosen = [c for c in cands if c["step"] == r]
            if not chosen:
                have = sorted({c["step"] for c in cands if c["step"] is not None})
                where = self.dirpath + (f" or {self.remote.url}" if self.remote else "")
                raise CheckpointNotFoundError(
                    f"resume={r}: no checkpoint of step {r} in {where} "
                    f"(steps present: {have or 'none'})"
                )
            # the newest checkpoint of that step, and its other copy if it has one
            key = chosen[0].get("key")
            cands = [c for c in chosen if key is not None and c.get("key") == key] or chosen[:1]
        return cands

    def _merge_tiers(self, local: list[Entry]) -> list[dict[str, Any]]:
        """Committed checkpoints of both tiers, newest first; where one exists in both, the
        local copy comes first and the remote copy right after it (used if the local one
        turns out damaged)."""
        by_key: dict[tuple[str, int], dict[str, Any]] = {}
        for e in local:
            assert e.manifest is not None
            key = (e.manifest.run_id, e.manifest.seq)
            by_key[key] = {"local": e, "step": e.manifest.step, "seq": e.manifest.seq}
        if self._sync is not None and self.remote is not None:
            try:
                remote_entries = self._sync.refresh()
            except Exception as e:
                log.warning(
                    "could not list the remote checkpoints in %s (%s: %s); resuming from the "
                    "local ones only",
                    self.remote.url,
                    type(e).__name__,
                    e,
                )
                remote_entries = []
            for re_ in remote_entries:
                if re_.manifest is None:
                    continue
                key = (re_.manifest.run_id, re_.manifest.seq)
                item = by_key.setdefault(key, {"step": re_.manifest.step, "seq": re_.manifest.seq})
                item["remote"] = re_
                # new saves must number after everything either tier holds
                self._seq = max(self._seq, re_.manifest.seq)
        out: list[dict[str, Any]] = []
        for key, item in sorted(by_key.items(), key=lambda kv: (kv[1]["seq"], kv[1]["step"])):
            pair: list[dict[str, Any]] = []
            if "local" in item:
                le = item["local"]
                pair.append({"path": le.path, "step": le.step, "problem": le.problem, "key": key})
            if "remote" in item:
                re_ = item["remote"]
                pair.append(
                    {
                        "path": None,
                        "step": item["step"],
                        "problem": re_.problem,
                        "key": key,
                        "remote": re_.name,
                    }
                )
            out[:0] = pair  # newest first
        return out

    def _fetch_remote(self, c: dict[str, Any]) -> dict[str, Any]:
        """Every rank: the coordinator downloads and verifies a remote checkpoint into
        dirpath; all ranks get its local path, or the problem."""
        result: dict[str, Any] = {"path": None, "problem": None}
        if self.is_coordinator:
            assert self._sync is not None and self.remote is not None
            url = f"{self.remote.url}/{c['remote']}"
            try:
                # the entry listed by _merge_tiers moments ago (its manifest is read already)
                entry = next((e for e in self._sync.entries() if e.name == c["remote"]), None)
                if entry is None or entry.manifest is None:
                    raise CheckpointNotFoundError(f"{url} is gone")
                log.warning("restoring from the remote copy %s", url)
                staging, name = self.remote.download(entry, self.dirpath)
                result["path"] = self._install(staging, name, entry.manifest)
            except Exception as e:
                result["problem"] = f"remote copy {url}: {type(e).__name__}: {e}"
        msg = dist.broadcast_json(result)
        return {**c, "path": msg["path"] or c.get("remote"), "problem": msg["problem"]}

    def _install(self, staging: str, name: str, manifest: Manifest) -> str:
        """Move a downloaded checkpoint into dirpath under its own name, replacing a damaged
        local copy of the same checkpoint; another checkpoint of that name is never touched."""
        final = os.path.join(self.dirpath, name)
        if os.path.lexists(final):
            try:
                m = read_manifest(final)
                same = (m.run_id, m.seq) == (manifest.run_id, manifest.seq)
            except Exception:
                same = True  # unreadable manifest: a damaged copy
            if not same:
                return self._commit.commit(staging, manifest.step)
            remove_checkpoint(final)
        os.rename(staging, final)
        fsync_dir(self.dirpath)
        return final

    def _reconcile_uploads(self) -> None:
        """Coordinator, after a restore: queue this run's local checkpoints whose upload a
        crash interrupted, if the remote retention policy would keep them."""
        assert self._sync is not None
        remote_entries = self._sync.entries()  # listed by this restore's _merge_tiers
        local = [
            e
            for e in catalog.committed(catalog.scan(self.dirpath, Depth.SIZE))
            if e.manifest is not None
            and e.status is Status.VALID
            and e.manifest.run_id == self.run_id
            and not self._sync.is_uploaded(e.manifest)
        ]
        if not local:
            return
        from .remote import retention_candidates

        cands = catalog.retention_candidates(local) + retention_candidates(
            remote_entries, prefix="\0remote/"
        )
        keep = plan(cands, self._sync.policy, self.run_id).keep
        missing = [e.name for e in local if e.name in keep]
        if missing:
            log.warning(
                "%d checkpoint(s) of this run were not uploaded to %s before the last run "
                "stopped; uploading them now: %s",
                len(missing),
                self.config.remote,
                ", ".join(missing),
            )
        for name in missing:
            self._sync.enqueue(name)

    # ------------------------------------------------------------------ queries

    def checkpoints(self) -> list[Entry]:
        """Committed checkpoints in dirpath, oldest first (sizes checked, not checksums)."""
        return catalog.committed(catalog.scan(self.dirpath, Depth.SIZE))

    @property
    def latest_path(self) -> str | None:
        valid = [e for e in self.checkpoints() if e.status is Status.VALID]
        return valid[-1].path if valid else None


def _clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor):
            v = v.detach().float().item()
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r}={v!r} is not a number") from None
        out[str(k)] = f if math.isfinite(f) else None
    return out


def _fingerprint(state: Any) -> str:
    """Hash of the names, shapes and dtypes of every module's tensors: identifies the model."""
    specs: list[Any] = []

    def rec(obj: Any, path: str) -> None:
        if isinstance(obj, structure.PerRank):
            rec(obj.obj, path)
        elif isinstance(obj, torch.nn.Module):
            for k, v in obj.state_dict().items():
                if isinstance(v, torch.Tensor):
                    specs.append([f"{path}.{k}", list(v.shape), str(v.dtype)])
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                rec(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                rec(v, f"{path}.{i}")

    rec(state, "")
    return xxhash.xxh3_64_hexdigest(json.dumps(specs).encode()) if specs else ""


def _error_type(name: str) -> type[CheckpointError]:
    from . import errors

    t = getattr(errors, name, CheckpointError)
    return t if isinstance(t, type) and issubclass(t, CheckpointError) else CheckpointError
