"""DataLoader workers forked from a training process whose watchers handle a signal: they
survive the first such signal while their trainer lives and its loader runs.

Slurm signals every process of a job step (``--signal``, the time limit) and ``kill --
-PGID`` every process of a group: DataLoader workers included. A worker that died of it made
the trainer's loader raise ("DataLoader worker ... killed by signal", from torch's SIGCHLD
handler, at any point of the step), so the emergency save never ran. Spared, the worker serves
batches until the trainer has saved.

A worker exits (status 0, as torch's handler does at its parent's SIGTERM) when:

- its loader is shutting down (its ``done_event`` is set): the loader's own ``terminate()`` of
  a worker that did not stop in time, or any signal after the loader let its workers go;
- its trainer is exiting: ``multiprocessing`` terminates the daemonic children it still has
  at interpreter exit (a loader with ``persistent_workers=True`` that was never shut down),
  then joins them. Spared, such a worker kept the trainer from exiting at all. The trainer
  says so through a byte of memory it shares with the processes it forks (its exit mark, set
  by a ``multiprocessing`` finalizer that runs before those terminations; each forking
  process has its own).

It dies of the signal, as without the watcher, when it is the second one, or when its trainer
(the parent) is gone.

The sparing handler is a Python one: it runs when the worker's main thread next runs Python
code. A worker blocked in one long C call (a native decoder, a C-level wait) acts on a signal
when that call returns, where torch's C handler acted at once.

A signal reaching a worker between its fork and that set-up would kill it (the fork gives it
the default action back): a child forked to be a DataLoader worker keeps the watchers' signals
blocked (as they are across the fork) until it is spared, and handles one that came meanwhile
then.

Thread contract: :func:`forking_a_worker` and :meth:`SpareWorker.when_a_dataloader_worker` run
in the forked child's only thread (the at-fork hook); the handler runs in the worker's main
thread.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing.util
import os
import signal
import sys
from collections.abc import Iterable
from types import FrameType
from typing import Any

log = logging.getLogger("resilient_callbacks")

# This process's exit mark: one byte, set when it stops its children at exit, in memory shared
# (MAP_SHARED, anonymous) with the processes it forks; made at its first fork with a watcher
# (a forked trainer gets its own: multiprocessing clears a child's finalizers)
_mark: mmap.mmap | None = None
_owner = -1


def prepare_fork() -> None:
    """The forking process, before a fork while its watchers handle signals: make its exit
    mark, and the ``multiprocessing`` finalizer that sets it (run at exit before
    ``multiprocessing`` terminates and joins the daemonic children)."""
    global _mark, _owner
    if _owner != os.getpid():
        _mark, _owner = mmap.mmap(-1, 1), os.getpid()
        multiprocessing.util.Finalize(None, _stopping_children, exitpriority=100)


def _stopping_children() -> None:
    if _mark is not None and _owner == os.getpid():  # (never a child's inherited finalizer)
        _mark[0] = 1


def forking_a_worker() -> bool:
    """In a forked child's at-fork hook: whether the fork started a DataLoader worker (the
    frame that forked, ``multiprocessing``'s ``Popen._launch``, holds the process whose target
    is torch's worker loop)."""
    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return False
        target = getattr(frame.f_locals.get("process_obj"), "_target", None)
        if target is not None:
            return (
                getattr(target, "__module__", None) == "torch.utils.data._utils.worker"
                and getattr(target, "__name__", None) == "_worker_loop"
            )
    return False


class SpareWorker:
    """The handler of a DataLoader worker for ``signums`` (see the module's docstring)."""

    def __init__(self, parent: int, signums: list[int]) -> None:
        self.parent = parent
        self.signums = signums
        self.spared = False
        self.done_event: Any = None  # the worker loop's: set when its loader shuts down
        self.mark = _mark if _owner == parent else None  # the parent's exit mark

    def when_a_dataloader_worker(self, is_one: bool, mask: Iterable[int] | None) -> bool:
        """In this child only (the parent's module is not touched): if it becomes a DataLoader
        worker, take the signals right after the worker's own set-up, which gives SIGTERM a C
        handler that dies unless the parent sent it (the worker loop looks the set-up function
        up on the module when it starts, with its ``done_event`` among its arguments).

        ``is_one``: this child was forked to be a DataLoader worker (:func:`forking_a_worker`);
        its signals, blocked across the fork, stay blocked until then, and the signal mask
        ``mask`` is set after (True returned: the caller leaves the mask as it is). Otherwise
        the caller sets it at once (False)."""
        handling = sys.modules.get("torch.utils.data._utils.signal_handling")
        if handling is None:  # no torch DataLoader in this process
            return False
        setup = getattr(handling, "_set_worker_signal_handlers", None)
        if setup is None:
            log.warning(
                "this torch has no torch.utils.data._utils.signal_handling."
                "_set_worker_signal_handlers: DataLoader workers die of a signal sent to the "
                "whole process group, as without resilient_callbacks"
            )
            return False
        unblock = mask if is_one else None

        def setup_then_spare(*args: Any, **kwargs: Any) -> Any:
            try:
                out = setup(*args, **kwargs)
                with contextlib.suppress(ValueError):  # called from elsewhere than the loop
                    self.done_event = sys._getframe(1).f_locals.get("done_event")
                if self.done_event is None:
                    log.debug(
                        "no done_event in the DataLoader worker loop: a stopping loader's "
                        "terminate() is spared once like a group signal"
                    )
                for signum in self.signums:
                    with contextlib.suppress(ValueError, OSError, TypeError):
                        signal.signal(signum, self)
            finally:
                if unblock is not None:  # a signal that came meanwhile is handled now
                    signal.pthread_sigmask(signal.SIG_SETMASK, unblock)
            return out

        handling._set_worker_signal_handlers = setup_then_spare  # type: ignore[attr-defined]
        return unblock is not None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if (self.mark is not None and self.mark[0]) or self._loader_stopping():
            # its trainer stops it (torch's handler did the same for its parent's SIGTERM: a
            # worker killed by a signal would make the trainer's SIGCHLD handler raise)
            os._exit(0)
        if not self.spared and os.getppid() == self.parent:
            self.spared = True
            return
        signal.signal(signum, signal.SIG_DFL)  # the default action: die by the signal
        os.kill(os.getpid(), signum)

    def _loader_stopping(self) -> bool:
        """Whether the worker's loader has set its ``done_event``, read without waiting (the
        handler may have interrupted the worker loop inside the event's own lock)."""
        event = self.done_event
        if event is None:
            return False
        flag = getattr(event, "_flag", None)  # multiprocessing's Event: a semaphore, 1 when set
        if flag is None or not hasattr(flag, "acquire"):
            return bool(event.is_set())
        if flag.acquire(False):
            flag.release()
            return True
        return False
