"""The Checkpointer: the facade that wires policy -> save -> commit -> retention, and restore.

Which ranks call what: every rank constructs a Checkpointer with the same arguments and calls
``restore``, ``step``, ``save``, ``emergency_save`` and ``close`` at the same points (they run
collectives when ``torch.distributed`` is initialized). Rank 0 is the coordinator: it holds the
directory lock, creates the staging directory, writes the replicated state, gathers every rank's
file list, writes the manifest, commits and applies retention. Every rank writes its own
``PerRank`` state and RNG states.

The parts, each in its own module: :mod:`.directory` (the directory as its one writer sees it),
:mod:`.saving` (one save; its background half in :mod:`.persisting`), :mod:`.session` (the
commit, usable without a Checkpointer), :mod:`.restoring` (candidates across tiers, loud
fallback), :mod:`.emergency` (preemption and exception saves), :mod:`.closing` (waiting for
saves and uploads, releasing) and :mod:`.checkpointer_queries` (the properties and queries
readers use, a base class). This class decides *when* to save (:meth:`step`) and holds them
together.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import closing, dist, exit_hook, remote_best, sinks, stall, topology
from .adapter import keywords_checked
from .checkpointer_queries import CheckpointerQueries
from .config import CheckpointerConfig
from .directory import Directory
from .directory_open import open_directory
from .emergency import Emergency
from .errors import AT_CALLER, warn_and_log
from .inplace import Advice
from .node_restore import NodeRestorer
from .persisting import SaveStats, check_next_save_fits
from .recorder import Recorder
from .restoring import Restorer, RestoreReport
from .save_inputs import check_metrics
from .saving import Saver, new_run_id
from .telemetry import Telemetry
from .trigger import Trigger
from .watcher_setup import GRACE_ENV, start_watcher, watching

__all__ = ["CLOSE_OUTAGE_S", "GRACE_ENV", "RESUMABLE_EXIT_CODE", "Checkpointer", "SaveStats"]

log = logging.getLogger("resilient_callbacks")

# seconds of failing uploads before close() gives up (UploadIncompleteError); of a stalled restore
CLOSE_OUTAGE_S = stall.CLOSE_OUTAGE_S  # (300 s)

RESUMABLE_EXIT_CODE = 75  # EX_TEMPFAIL: "temporary failure, retry": checkpoint saved, restart me


def _cwd() -> str:
    """The working directory (``""`` where it was deleted)."""
    try:
        return os.getcwd()
    except OSError:
        return ""


class Checkpointer(CheckpointerQueries):
    """Atomic, verified, pickle-free checkpoints of a training state, with retention and exact
    auto-resume. See the module docstring for which ranks call what.

    >>> ckpt = Checkpointer("ckpts/run1", every_n_steps=100, keep_last=3)   # doctest: +SKIP
    >>> start = ckpt.restore(state)                                         # doctest: +SKIP

    Options (validated by :class:`~.config.CheckpointerConfig`; docs/guide.md has the details):

    - ``every_n_steps``, ``every_seconds``: :meth:`step` saves at multiples of N steps / when
      that much wall time passed since the last save (all ranks agree on the step).
    - ``keep_last``, ``keep_best`` + ``monitor`` + ``mode``, ``keep_every_n_steps``: retention
      (the N newest, the K best by a metric, archive steps kept forever and always saved).
    - ``resume``: ``"auto"`` (newest valid, falling back loudly), ``"never"``, a step or a path.
    - ``capture_rng``: save and restore every RNG state.
    - ``async_save``, ``if_busy`` (``"wait"``/``"skip"``), ``overlap_snapshot``: write in
      the background, one save at a time (``max_in_flight`` must be 1); block only for the
      snapshot.
    - ``adaptive``, ``mtbf_hours``, ``max_overhead``, ``min_interval``, ``max_interval``: an
      interval that adapts to the measured save cost and failure rate (docs/policy.md).
    - ``loss_jump``, ``loss_key``: an extra save when the loss jumps.
    - ``preemption``, ``signals``, ``handle_sigint``, ``grace_period``, ``exit_on_preemption``,
      ``preemption_exit_code``, ``metadata_notices``: save and exit on a preemption notice.
    - ``save_on_exception``: save the last consistent step on an exception (:meth:`abort`).
    - ``remote``, ``remote_options``, ``remote_keep_last``, ``remote_keep_best``,
      ``remote_timeout``: upload to any fsspec URL in the background and resume from it.
    - ``remote_every_n_saves``: upload only every Nth checkpoint (local ones protect against
      process crashes, remote ones against losing a node).
    - ``shared_dirpath``, ``replicas``: several nodes without a shared filesystem
      (docs/multinode.md): detected at construction; ``replicas=1`` keeps each node's files on
      another node too.
    - ``telemetry``: where the checkpoint metrics go: ``"prometheus:9464"``,
      ``"textfile:PATH.prom"``, ``"pushgateway:URL"``, ``"mlflow"``, a callable, or a list of
      these (docs/monitoring.md). :meth:`metrics` reads them without any sink.
    - ``incremental`` (``True`` or ``"hash"``): a replicated tensor whose bytes an earlier
      committed checkpoint of the run stored already is not written again; ``"hash"`` hashes
      every tensor at every save, for frozen tensors written through ``.data`` or NumPy
      (docs/incremental.md).
    - ``compression`` (``"none"``, ``"zstd"``, ``"auto"``), ``compression_level``,
      ``compression_shuffle``: zstd-compress the tensor files (the ``zstd`` extra).
    - ``read_only``: restore only (an evaluation job, a read-only mount): no lock, nothing
      written; :meth:`restore` works, saving raises :class:`~.errors.ConfigError`.
    """

    @keywords_checked  # a misspelt option is an UnknownOptionError naming the closest one
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
        max_overhead: float | None = None,
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
        remote_every_n_saves: int | None = None,
        shared_dirpath: bool | None = None,
        replicas: int = 0,
        telemetry: Any = None,
        incremental: bool | str = False,
        compression: str = "none",
        compression_level: int = 1,
        compression_shuffle: bool = True,
        read_only: bool = False,
    ) -> None:
        options = {k: v for k, v in locals().items() if k != "self"}
        options["signals"] = (signals,) if isinstance(signals, (str, int)) else tuple(signals)
        options["remote_options"] = dict(remote_options) if remote_options is not None else None
        self.config = CheckpointerConfig(**options)
        self._close_lock = threading.RLock()  # (a second thread's close() waits for the first)
        #: dirpath as given, and the working directory a relative one was resolved against
        given = os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath
        self.dirpath_given: tuple[object, str] = (given, _cwd())
        # first: a signal while the rest opens the directory is noticed (watcher_setup.watching)
        self.watcher, self._poller = start_watcher(self.config)
        with watching(self.watcher, self._poller, self.config):
            try:
                self._open()
            except BaseException:  # (Ctrl-C included) nothing stays locked nor running
                closing.release_unopened(self)
                raise

    def _open(self) -> None:  # the rest of __init__, its watcher installed
        self._sink_specs = self.config.sinks()
        #: the kinds of sink ``telemetry`` names ("logger": the adapters log to the framework)
        self.telemetry_kinds = frozenset(s.kind for s in self._sink_specs)
        # telemetry="logger" goes through a framework's loggers: the callbacks set this; a
        # Checkpointer without one says so at its first save (once)
        self.logs_through_framework = False
        # an adapter that calls step() once per optimizer step of its framework (Lightning: when
        # global_step moved) sets this: none of its step() calls is inside an accumulation
        # window (windows.py), also not one after an update a GradScaler skipped for an inf
        self.steps_are_updates = False
        # what the restore's warnings advise, and where they point: an adapter whose framework
        # calls restore() (Transformers) sets its framework's words and directories
        self.restore_advice = Advice()
        # every rank, once a restore loaded the state, before the ranks compare outcomes: this
        # rank's own notices about what it loaded, said after they agree; under -W error every
        # rank stops with one (notices.first_raising). An adapter sets it (Transformers)
        self.load_notices: Callable[[], list[str]] = list
        self._logger_unchecked = "logger" in self.telemetry_kinds
        self.dirpath: str = self.config.dirpath
        self.retention = self.config.local_retention_policy()
        if not self.config.read_only:  # a reader writes nothing: alone, it reads as one
            dist.require_group(self.dirpath)
        dist.check_same_options(self.config.agreed())
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self.is_coordinator = self.rank == 0
        dist.warn_if_restarts_share_a_store()
        if said := remote_best.every_save_uploaded(self.config):  # (rank 0 warns, as above)
            warn_and_log(log, said, stacklevel=AT_CALLER, warn=self.is_coordinator)
        self.last_saved_step: int | None = None
        self.last_save: SaveStats | None = None
        self.restored_from: str | None = None
        self.last_restore: RestoreReport | None = None  # what restore() loaded, and skipped
        self.preempted = False
        self.close_wait_seconds = 0.0  # how long close() waited for pending saves
        self.failed_with: str | None = None  # abort(): the exception training failed with
        self.failed_detail = ""  # and its message (closing.failing)
        self._closed = False
        self._release_began = False  # close() reached its release (closing._release)
        self._released = False  # and finished it: nothing more for close() or __del__ to do
        self.schedule = self.config.adaptive_schedule()
        self._trigger = Trigger(self.config, self.schedule)  # when to save
        self.policy = self._trigger.policy
        # the sinks are built (their extras imported) first, started last
        sink_objects = sinks.build(
            [s for s in self._sink_specs if self.is_coordinator or s.options.get("per_rank")],
            sinks.CheckpointerContext(self),
        )
        # the parts (a read-only Checkpointer writes no probe: every rank reads dirpath)
        shared = True if self.config.read_only else self.config.shared_dirpath
        self.topology = topology.detect(self.dirpath, shared)
        self._writes_shared = self.topology.is_leader  # rank 0, or each node's first rank
        self._dir: Directory = open_directory(
            self.config, self.topology, self.retention, self.world_size
        )
        self._emergency = Emergency(self)
        self._restorer: Restorer = (
            NodeRestorer(self) if self.topology.node_local else Restorer(self)
        )
        self._saver = Saver(self)
        self.telemetry = Telemetry(sink_objects, rank=self.rank)
        self._recorder = Recorder(self, self.telemetry)
        self._at_exit = exit_hook.at_exit(self)  # unregistered by close()

    # the parts' state and the queries: checkpointer_queries.CheckpointerQueries

    def _check_logger_sink(self) -> None:  # once: telemetry="logger" with no framework warns
        if not self._logger_unchecked:
            return
        self._logger_unchecked = False
        if not self.logs_through_framework:
            sinks.warn_logger_without_framework()

    def _start_run(
        self, step: int, at: float | None = None, run_id: str | None = None, **fields: Any
    ) -> None:
        """Every rank: give this run an id (rank 0 chooses it and records the start, with
        ``fields``). ``at``: the wall time it started, when earlier than now. ``run_id``: the
        id rank 0 chose, already sent to every rank (else this broadcasts it)."""
        if self._dir.run_id is None:
            self._dir.run_id = run_id if run_id is not None else new_run_id()
            self._recorder.started(step, at)
            if self.is_coordinator:
                when: dict[str, Any] = {} if at is None else {"time": at}
                self._dir.record("start", step, **fields, **when)
                self._recorder.record_deferred()

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout: float | None = None) -> None:
        """Wait for background saves to commit, then release the directory. Raises the error of
        a background save that failed (after releasing). ``timeout``: seconds to wait for
        pending saves; what is still pending then is reported and abandoned: none of it is
        committed, and the directory stays locked until the save being written has stopped;
        the metrics sinks get what is left of it. A second call finishes one that a Ctrl-C
        interrupted; one from another thread during a close waits for it (``timeout``: at
        most that long, then returns, said in a warning). See :mod:`.closing`."""
        if not self._close_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            log.warning(  # (a preemption's exit within its grace period: not held past it)
                "close(): another thread's close() of %s is still under way after %g s; "
                "returning without waiting for it to end",
                self.dirpath,
                timeout,
            )
            return
        try:
            if self._closed and self._released:
                return
            self._closed = True
            with dist.peer_errors("close()"):
                closing.close(self, timeout, CLOSE_OUTAGE_S)
        finally:
            self._close_lock.release()

    def abort(self, exc: BaseException) -> None:
        """Training failed with ``exc``: with ``save_on_exception``, save the last step that
        :meth:`step` saw (if the state is still that step's, and with a single rank), then close.
        Does not raise ``exc``: the caller lets it propagate. Adapters call this from their
        exception hook; ``with Checkpointer(...)`` calls it on an exception."""
        if not self._closed and not isinstance(exc, SystemExit):
            closing.failing(self, exc)  # the history records a failure, not an end
        try:
            if not self._closed:
                self._emergency.save_on_exception(exc)
        finally:
            try:
                self.close()
            except Exception as e:  # exc propagates, unchanged: this failure is logged
                log.error("closing the Checkpointer after %s failed: %s", type(exc).__name__, e)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` (or :meth:`abort`) has run: nothing more is saved."""
        return self._closed

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and not closing.clean_exit(exc):  # (sys.exit(0): close() raises)
            self.abort(exc)
        else:
            self.close()
        # returning None: the exception propagates unchanged

    def flush(self) -> None:
        """Block until every background save has committed; raise if one failed."""
        self._wait_background()

    def __del__(self) -> None:  # (dropped unclosed: see exit_hook.dropped)
        exit_hook.dropped(self)

    def _check_open(self, writes: bool = False) -> None:
        closing.check_open(self, writes)

    def _wait_background(self) -> float:
        return self._saver.wait_background()

    def wait_for_snapshot(self) -> None:
        """Order what comes next after the last save's overlapped snapshot copy. With
        ``overlap_snapshot=True`` call it before anything changes parameters or optimizer state
        other than the optimizers in the saved state (their ``step()`` calls it automatically).
        CPU copies are waited for; on a GPU the current stream waits for the copy on the GPU, so
        kernels launched afterwards run after it while the CPU goes on."""
        self._saver.wait_for_snapshot()

    # ------------------------------------------------------------------ saving

    def step(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        final: bool = False,
    ) -> bool:
        """Call once per training step with the steps completed; saves when due. True if saved.

        ``final=True`` marks the run's last step: saved whatever the schedule (unless saved
        already) and always uploaded, so re-running a finished job trains nothing. Every rank
        passes the same ``final``.

        On a preemption request (SIGTERM, SIGUSR1, a cloud notice) it makes an emergency save
        of this step and, with ``exit_on_preemption`` (default), exits the process with
        ``preemption_exit_code`` (75); otherwise it returns and sets :attr:`preempted`.
        Inside an ``Accumulation``'s window it waits for the first call after the window."""
        self._check_open(writes=True)
        self._check_logger_sink()
        check_metrics(metrics)
        self._trigger.step_started(step)
        self._recorder.tick(step)
        window = (
            None
            if self.steps_are_updates
            else self._emergency.windows.inside(state, self.world_size)
        )
        try:
            try:  # (no context manager: this is every step's path)
                saved = self._step(step, state, metrics, final, window)
            except Exception as e:
                err = dist.peer_error(e, f"step({step})")
                if err is None:
                    raise
                raise err from e
            if not saved and not self._saver.allocated_ahead:
                self._saver.allocate_ahead(state)
            if not saved and self._saver.space_check_due:  # training goes on after a commit
                self._saver.space_check_due = False  # (a save clears it: it checks before writing)
                check_next_save_fits(self._saver)
            return saved
        finally:
            # (inside an accumulation window the point before it stays the consistent one;
            # in a loop with windows, a preemption held in one too long saves that point)
            em = self._emergency
            if window is None and not self._closed:
                if self.config.save_on_exception:
                    em.mark_consistent(step, state)
                elif em.windows.longest > 1 and self.watcher is not None:
                    em.mark_before_window(step, state)
            self._trigger.step_ended()

    def _step(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        final: bool,
        window: str | None = None,
    ) -> bool:
        # answered once: with exit_on_preemption=False the steps after it do not save again
        preempt = self.watcher is not None and self.watcher.poll(3) and not self.preempted
        em = self._emergency
        decision = self._trigger.decide(
            step, metrics, final, preempt, state, self.watcher, window, em.windows
        )
        if decision is None:
            return False
        kind, why = decision
        if kind == "preemption":
            return em.preemption(step, state, metrics)
        if kind == "preemption_before_window":  # a window that did not end: the step before it
            return em.preemption(step, state, metrics, before_window=why)
        if kind == "required":  # an archive step or a loss jump: never skipped when busy
            return self._saver.save(step, state, metrics, "periodic", why=why, skippable=False)
        return self._saver.save(step, state, metrics, kind, why=why)

    def emergency_save(
        self, step: int, state: Any, metrics: Mapping[str, Any] | None = None
    ) -> bool:
        """Flush background saves and save ``step`` synchronously (fastest complete path), for
        callers that detect a failure themselves. Every rank must call it. When it returns,
        ``step`` is durable: False when it was saved already (its background save, waited for,
        or the one restored)."""
        self._check_open(writes=True)
        saved = self._save_outside_step(step, state, metrics, "emergency", "emergency_save()")
        if saved:  # (the next step() checks the next save fits)
            self._saver.space_check_due = True
        return saved

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        final: bool = False,
    ) -> bool:
        """Save now (``final=True``: the run's last step, which the remote tier always takes).
        False (nothing written) if the last checkpoint committed or restored is of ``step``."""
        self._check_open(writes=True)
        self._check_logger_sink()
        reason, why = ("final", "final step") if final else ("forced", "save() called")
        return self._save_outside_step(step, state, metrics, reason, why)

    def _save_outside_step(
        self, step: int, state: Any, metrics: Mapping[str, Any] | None, reason: str, why: str
    ) -> bool:
        t0 = time.perf_counter()
        self._recorder.t.step = step  # (the step gauge and records of a loop that only saves)
        try:
            return self._saver.save(step, state, metrics, reason, why=why)
        finally:
            self._trigger.exclude(time.perf_counter() - t0)  # not training compute

    # ------------------------------------------------------------------ restoring

    def restore(self, state: Any) -> int:
        """Load the checkpoint chosen by ``resume`` into ``state`` in place; return its step,
        or 0 when there is nothing to resume from. Every rank calls it."""
        self._check_open()
        with dist.peer_errors("restore()"):  # an earlier save's failure: raised on every rank
            self._saver.wait_background_agreed("restore()")
        with dist.peer_errors("restore()"), self._emergency.exit_if_preempted():
            return self._restorer.restore(state)

    def continued_from(self, step: int, source: str, *, same_run: bool = False) -> None:
        """Every rank, instead of :meth:`restore`: this run goes on from step ``step`` of a
        checkpoint this Checkpointer did not load (``source``: e.g. the framework's own
        checkpoint, passed explicitly). Records the run's start at ``step``, from ``source``
        (``same_run``: as the run of dirpath's newest checkpoint, which goes on). Warns (on
        rank 0; the others log it at INFO, and raise it too where the warning filters make it
        an error) when dirpath holds a newer checkpoint, trained again."""
        self._check_open(writes=True)
        with dist.peer_errors("continued_from()"):
            self._restorer.continued_from(step, source, same_run)
