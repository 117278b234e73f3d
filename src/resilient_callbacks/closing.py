"""Closing a Checkpointer: wait for its background saves (or abandon them after a timeout),
finish the uploads and the node-local work, then release everything it holds (the exit
hook that closes a Checkpointer the script forgot: :mod:`.exit_hook`).

Which ranks call what: every rank calls :func:`close` (through ``Checkpointer.close``) at the
same point. Every rank waits for its own background saves and raises a background failure;
rank 0 (the coordinator, the only one with a remote tier) waits for the uploads; in node-local
mode each node's leader finishes its node's uploads and reports; rank 0 releases the lock."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import exit_hook, notices, unanswered_exit
from .close_uploads import close_directory as close_directory  # (the DCP writer's)
from .close_uploads import not_uploaded_error
from .closing_steps import check_open as check_open
from .closing_steps import clean_exit as clean_exit
from .closing_steps import close_on_exit as close_on_exit
from .closing_steps import empty_trash, failing, say_after_commit, warn_unmonitored
from .closing_steps import release_unopened as release_unopened
from .nodelocal import NodeDirectory
from .preemption import exiting
from .upload_thread import EXIT_MARGIN_S, by_grace
from .upload_wait import finish_uploads

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")

PREEMPTED_SINKS_S = 5.0  # a preempted process's wait for its metrics sinks, grace period unknown
# torch's error in the training process when a DataLoader worker died of a signal
_WORKER_KILLED = re.compile(r"DataLoader worker \(pid.*\) is killed by signal")


@exiting.cleared_if_raised  # (a close that raises ends no exit with 75)
def close(ck: Checkpointer, timeout: float | None, outage_s: float) -> None:
    """Wait for background saves to commit, then release the directory (see
    ``Checkpointer.close``). ``outage_s``: without a timeout, how long uploads may keep
    failing before close gives up on them: what is left stays local and, unless the process
    is answering a preemption, :class:`UploadIncompleteError` names it once all is released
    (a job must not end as a success with its newest checkpoints on one machine's disk).
    Node-local mode: raised on rank 0 and on each node leader whose part did not upload; the
    other ranks return (:meth:`NodeDirectory.finish_nodes`). Called again after a Ctrl-C
    interrupted it (``ck._released`` False): before its release began, it closes as if
    called the first time; in its release, it finishes the release."""
    if ck._release_began:
        _release_left(ck)
        return
    not_uploaded: list[str] = []
    # gave up only for the outage: no timeout of the caller's, no preemption bounding it
    strict = timeout is None and not ck.preempted
    deadline: float | None = None
    persister = ck._saver.persister
    error: Exception | None = None  # close's own (a background save that failed)
    try:  # (from here on a Ctrl-C still releases everything: see _release)
        if timeout is None:
            timeout = _answered_elsewhere_s(ck)
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_left = ck.watcher.remaining_grace_s if ck.watcher is not None else None
        if persister is not None:
            pending = persister.pending
            if pending:
                log.info("waiting for %d checkpoint(s) still being written ...", pending)
            t_wait = time.perf_counter()
            finished = persister.wait_all(timeout, grace_left)
            ck.close_wait_seconds = time.perf_counter() - t_wait
            if pending and finished and ck.last_save is not None:
                # the end of training waits for the last checkpoint to be durable: say how long
                # (a failed one is raised below)
                log.info(
                    "close(): the last checkpoint (%s) became durable after a %.2f s wait",
                    ck.last_save.path,
                    ck.close_wait_seconds,
                )
            if not finished:
                persister.abandon()
                log.warning(
                    "close(): %d checkpoint(s) were still being written %s and were "
                    "abandoned; the newest committed checkpoint is %s",
                    persister.pending,
                    f"after {timeout} s"
                    if grace_left is None or grace_left() is None
                    else f"when the preemption's grace period, less {EXIT_MARGIN_S:g} s to "
                    "exit, was spent (before the scheduler's kill)",
                    _newest(ck),
                )
            else:
                persister.stop()
        if ck._dir.sync is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            watcher = ck.watcher  # a SIGTERM arriving now bounds the wait by its grace period
            not_uploaded = finish_uploads(
                ck._dir, left, outage_s, watcher.remaining_grace_s if watcher else lambda: None
            )
            strict = strict and (watcher is None or watcher.request is None)
        if isinstance(ck._dir, NodeDirectory):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            watcher = ck.watcher  # a SIGTERM arriving now bounds the waits by its grace period
            not_uploaded = ck._dir.finish_nodes(
                left, outage_s, watcher.remaining_grace_s if watcher else None
            )
            strict = strict and (watcher is None or watcher.request is None)
        say_after_commit(ck)  # (a background save's is known now: its persist ended)
        until = by_grace(deadline, grace_left)  # (a signal that arrived meanwhile too)
        empty_trash(ck, None if until is None else max(0.0, until - time.monotonic()))
        warn_unmonitored(ck)
        if persister is not None:
            ck.save_waits.log_summary()
            persister.raise_error()
    except Exception as e:
        error = e
        raise
    except BaseException as e:  # a Ctrl-C while close() waited: as a timeout that ran out
        _interrupted(ck, e)  # (the history's record: a failure, not a clean end)
        if persister is not None and persister.pending:
            persister.abandon()  # (the directory stays locked until the running save stopped)
            log.warning(
                "close() was interrupted (%s) while %d checkpoint(s) were still being written: "
                "abandoned, not committed; the newest committed checkpoint is %s",
                type(e).__name__,
                persister.pending,
                _newest(ck),
            )
        raise
    finally:
        # a close nested in this one (a user's signal handler's: the close lock is reentrant)
        # finished the whole close meanwhile: its release, and its choice to raise or not
        nested = ck._released
        if not nested:
            _release(ck, deadline, error)
    if not_uploaded and strict and not nested:
        raise not_uploaded_error(ck._dir, not_uploaded, outage_s)


def _worker_killed_hint(ck: Checkpointer) -> str:
    """What to do when training failed as a DataLoader worker died of the signal."""
    if not _WORKER_KILLED.search(ck.failed_detail):
        return ""
    return (
        ". A DataLoader worker died of the signal first: the signal reached the whole process "
        "group or job step (Slurm's --signal, kill -- -PGID), and workers started with "
        "multiprocessing_context 'spawn' or 'forkserver' are not spared until the emergency "
        "save as forked ones are. Start them with 'fork' (Linux's default), or signal the "
        "training process only"
    )


def _newest(ck: Checkpointer) -> str:
    """The newest checkpoint this process knows of, for a message: its last committed save,
    else the one it restored (a re-run of a finished job saves nothing)."""
    if ck.last_save is not None:
        return ck.last_save.path
    if ck.restored_from is not None:
        return f"{ck.restored_from} (restored at the start)"
    return f"none in {ck.dirpath} yet"


def _older_kept(ck: Checkpointer) -> str:
    """What is left of the checkpoints committed before a save that failed, for a message: the
    directory may have been removed since (the exit hook closes the Checkpointer last)."""
    if os.path.isdir(ck.dirpath):
        return f"older checkpoints in {ck.dirpath} are intact"
    remote = ck._dir.remote
    kept = f"; what was uploaded to {remote.url} is kept there" if remote is not None else ""
    return f"{ck.dirpath} no longer exists (removed meanwhile), nor its checkpoints{kept}"


def _answered_elsewhere_s(ck: Checkpointer) -> float | None:
    """The limit of a ``close()`` given none, while another Checkpointer of this process
    answered a preemption (saved, and the process is exiting: a model's and its EMA's, closed
    by a ``with`` block or at exit): what is left of the grace period less
    :data:`EXIT_MARGIN_S`, as that one's close had, not the waits of a normal end (a sink's
    10 s to 600 s) that held the exit past the scheduler's kill; None otherwise."""
    w = ck.watcher
    if w is None or not w.answered_elsewhere:
        return None
    left = w.remaining_grace_s()
    return None if left is None else max(0.0, left - EXIT_MARGIN_S)


def _sinks_deadline(ck: Checkpointer, deadline: float | None) -> float | None:
    """Until when the metrics sinks may send their last values: what is left of close's
    timeout and of a pending preemption's grace period less :data:`EXIT_MARGIN_S` (also one
    no step() acted on); a preempted process whose grace period is unknown gives them
    :data:`PREEMPTED_SINKS_S` (its checkpoint and history are durable by then; a hanging sink
    must not hold its exit code past the scheduler's kill)."""
    w = ck.watcher
    deadline = by_grace(deadline, w.remaining_grace_s if w is not None else None)
    signalled = w is not None and (w.answered_elsewhere or w.request is not None)
    if deadline is None and (ck.preempted or signalled):
        return time.monotonic() + PREEMPTED_SINKS_S
    return deadline


def _release(
    ck: Checkpointer, deadline: float | None = None, raising: Exception | None = None
) -> None:
    """Stop every thread and hook the Checkpointer started, and release the lock (the metrics
    sinks may send until :func:`_sinks_deadline` of close's ``deadline``). ``raising``:
    what the close raises (a background save's failure): it ends the process, not the exit
    code of a signal no step() acted on (at the interpreter's exit, where nothing can raise
    it, it is logged and the code stays)."""
    ck._release_began = True
    try:
        _release_all(ck, _sinks_deadline(ck, deadline), raising)
    except BaseException as e:
        _interrupted(ck, e)
        raise
    finally:
        _release_left(ck)


def _interrupted(ck: Checkpointer, e: BaseException) -> None:
    """A Ctrl-C (any ``BaseException`` but the exit) interrupted close(): the history records a
    failure with its name, as for one during training: not a clean ``end`` (an abandoned save,
    uploads not waited for), nor no record at all (a life the report took for killed)."""
    if not isinstance(e, (Exception, SystemExit)) and not ck.failed_with:
        failing(ck, e)


def _release_left(ck: Checkpointer) -> None:
    """What a release interrupted part-way (a Ctrl-C in it, an error) left: the threads and
    hooks stopped and the lock released, unless an abandoned save still being written releases
    it once it stopped. A Ctrl-C there left the directory locked by a Checkpointer already
    closed, which no close() releases (a notebook's next writer: "this process already has a
    writer open"). The history gets its record if the release did not reach it, and the
    metrics sinks stop. After a whole release every step finds nothing left to do."""
    persister = ck._saver.persister
    steps: list[Callable[[], object]] = [ck._recorder.record_end]
    steps += [functools.partial(ck.telemetry.close, timeout=0.0)]
    steps += [ck._dir.trash.stop, ck._emergency.release]
    if ck._at_exit is not None:
        steps.append(functools.partial(atexit.unregister, ck._at_exit))
    if ck._dir.sync is not None:
        steps.append(ck._dir.sync.stop)
    if ck._poller is not None:
        steps.append(ck._poller.stop)
    if ck.watcher is not None:
        steps.append(ck.watcher.uninstall)
    if persister is not None:  # (after the jobs queued: an abandoned save, its lock's release)
        steps.append(functools.partial(persister.stop, join_s=0.0))
    if isinstance(ck._dir, NodeDirectory):
        steps.append(ck._dir.release)
    elif not (persister is not None and persister.abandoned and persister.pending):
        steps.append(ck._dir.lock.release)
    for step in steps:
        try:
            step()
        except Exception as e:  # (the error that ended the release is the one raised)
            log.debug("closing %s: %s", ck.dirpath, e)
    ck._released = True


def _release_all(ck: Checkpointer, sinks_deadline: float | None, raising: Exception | None) -> None:
    if ck._at_exit is not None:
        atexit.unregister(ck._at_exit)
    ck._recorder.closed(sinks_deadline)
    if ck._dir.sync is not None:
        ck._dir.sync.stop()
    if isinstance(ck._dir, NodeDirectory):
        ck._dir.release()
    ck._saver.release()
    ck._dir.trash.stop()
    ck._emergency.release()
    if ck._poller is not None:
        ck._poller.stop()
    exit_code = None
    if ck.watcher is not None:
        unanswered = ck.watcher.request if not ck.preempted else None
        users = unanswered_exit.users_exit()
        exit_code = unanswered_exit.exit_code_for(ck, unanswered, users)
        # close() raises: the error ends the process (said below), not 75 nor the signal
        raised = bool(
            raising is not None
            and not exit_hook.at_exit_closing
            and unanswered is not None
            and unanswered.signum is not None
            and (exit_code is not None or ck.watcher.passing_on_ends_the_process(unanswered.signum))
        )
        if raised:
            exit_code = None
        elif exit_code is not None and raising is not None:  # at exit: os._exit below
            log.error("closing %s at exit failed: %s", ck.dirpath, raising)
        if exit_code is not None:
            ck.watcher.exiting(exit_code)  # (before uninstall: a second signal keeps the code)
        ck.watcher.uninstall()
        if (
            unanswered is not None
            and ck.watcher.answered_elsewhere
            and not ck.watcher.saved_elsewhere
        ):
            # another Checkpointer's restore: the request ended its wait on a stalled store, and
            # the process exits with the preemption code before anything was saved
            log.warning(
                "preemption (%s): another Checkpointer of this process is exiting for it before "
                "anything was saved (the request ended its restore's wait on a stalled store); "
                "%s was not saved at this preemption either: the next run resumes from its "
                "newest checkpoint",
                unanswered.source,
                ck.dirpath,
            )
        elif unanswered is not None and ck.watcher.answered_elsewhere:
            # another Checkpointer of this process answered it: its emergency save, and the
            # process exiting with the preemption code. This one was not stepped again.
            log.warning(
                "preemption (%s): another Checkpointer of this process saved and is exiting; "
                "%s was not saved at this preemption (its newest checkpoint stays). Checkpoint "
                "one loop's state with one Checkpointer, or give the others "
                "exit_on_preemption=False: each then saves at its next step()",
                unanswered.source,
                ck.dirpath,
            )
        elif unanswered is not None and ck._emergency.failed is not None:
            # acted on: its emergency save failed, and that error reached the loop
            step, error = ck._emergency.failed
            log.error(
                "%s: the emergency save of step %d failed (%s); %s",
                unanswered.source,
                step,
                error,
                _older_kept(ck),
            )
        elif unanswered is not None and unanswered.signum is not None and ck.failed_with:
            # training is failing with an exception: it propagates and ends the process (its
            # traceback printed); the signal passed on now would kill the process first,
            # silently, with the exception never shown
            log.warning(
                notices.on_this_rank(  # (the signal this rank got: said by this rank)
                    "%s arrived while training failed with %s (no emergency save for it; the "
                    "newest checkpoint is %s); the exception ends the process%s"
                ),
                unanswered.source,
                ck.failed_with,
                _newest(ck),
                _worker_killed_hint(ck),
            )
        elif raised and unanswered is not None:
            # close() raises (a background save failed): the error ends the process, its
            # traceback shown; 75, or the signal passed on to the default action, hid it
            log.warning(
                notices.on_this_rank(  # (the signal this rank got: said by this rank)
                    "%s arrived after the last step() that could act on it (no emergency save for "
                    "it; the newest checkpoint is %s); close() raises %s, which ends the process"
                ),
                unanswered.source,
                _newest(ck),
                type(raising).__name__,
            )
        elif unanswered is not None and unanswered.signum is not None and users is not None:
            # the program is ending by a sys.exit of its own with a failure code (the close at
            # a with block's end, in a finally): that code is the program's answer, not 75
            log.warning(
                notices.on_this_rank(  # (the signal this rank got: said by this rank)
                    "%s arrived after the last step() that could act on it (no emergency save for "
                    "it; the newest checkpoint is %s); the program's own sys.exit(%r) ends the process"
                ),
                unanswered.source,
                _newest(ck),
                users.code,
            )
        elif unanswered is not None and unanswered.signum is not None:
            # it came after the last step() that could act on it (steps act at decision
            # points, agreed between ranks up to ~1 s apart): the handler it would have
            # reached without us gets it now, rather than no one; where that is the default
            # action (death by the signal, which a scheduler takes for a crash), the process
            # exits with the preemption code instead, what was committed kept
            log.warning(
                notices.on_this_rank(  # (the signal this rank got: said by this rank)
                    "%s arrived %.1f s ago, after the last step() that could act on it (no "
                    "emergency save for it; the newest checkpoint is %s); %s"
                ),
                unanswered.source,
                max(0.0, time.monotonic() - unanswered.monotonic),
                _newest(ck),
                "passing it on to the handler before ours"
                if exit_code is None
                else f"exiting with code {exit_code} so the scheduler restarts the job, which "
                "resumes from the newest checkpoint",
            )
            if exit_code is None:
                signal.raise_signal(unanswered.signum)
    persister = ck._saver.persister
    if persister is not None and persister.abandoned and persister.pending:
        # the abandoned save still running commits nothing; the directory stays locked until
        # it has stopped, so no new writer sweeps its staging directory under it
        persister.submit(ck._dir.lock.release, always=True)
    else:
        ck._dir.lock.release()
    if exit_code is not None:
        if exit_hook.at_exit_closing:  # (a SystemExit raised in an atexit hook is ignored)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)
        exiting.exit_with(exit_code)
