"""Signal handling: :class:`PreemptionWatcher` records SIGTERM/SIGUSR1/SIGINT as a request.

The handler only *records* the request: no I/O, no lock, no logging. Forked children get the
previous handlers back; a DataLoader worker among them survives the first signal while its
trainer lives and its loader runs (:mod:`.workers`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

from ..errors import ConfigError
from . import exiting, workers
from .request import DEFAULT_SIGNALS, PreemptionRequest, _check_seconds
from .watcher_config import WatcherConfig, _signal_name  # noqa: F401 (re-exported)
from .workers import SpareWorker

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

log = logging.getLogger(__name__)

_installed: weakref.WeakSet[PreemptionWatcher] = weakref.WeakSet()
_install_order = itertools.count()


_masks_before_fork: dict[int, Iterable[int]] = {}


def _block_before_fork() -> None:
    # Block our signals across fork(). A SIGTERM reaching the child before _restore_in_child
    # would be lost (Python clears pending signals at fork, and skips one whose handler is
    # SIG_DFL by the time it looks), and a DataLoader worker would outlive its trainer.
    pid = os.getpid()
    sigs = {s for w in list(_installed) if w._active and w._pid == pid for s in w._signums}
    if sigs:
        workers.prepare_fork()  # the mark a DataLoader worker reads at this process's exit
        _masks_before_fork[threading.get_ident()] = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)


def _unblock_after_fork() -> None:
    mask = _masks_before_fork.pop(threading.get_ident(), None)
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _restore_in_child() -> None:
    # A forked child must die on SIGTERM like before: give it back the handlers that were there
    # before ours, newest watcher first, then unblock (a SIGTERM that arrived meanwhile now
    # takes effect). The pid check in the handler covers children forked without running this
    # hook. Where that gives a signal its default action (death), a child that becomes a
    # DataLoader worker lets the first such signal pass while its trainer lives (workers.py),
    # and keeps the signals blocked until then: one arriving before the worker loop's set-up
    # would kill it.
    ours: set[int] = set()
    for w in sorted(_installed, key=lambda w: w._order, reverse=True):
        w._active = False
        for signum, prev in w._previous.items():
            ours.add(signum)
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signum, signal.SIG_DFL if prev is None else prev)
    # spared in a DataLoader worker: what would kill it, SIGTERM whatever it had (the worker's
    # set-up gives it a C handler that kills unless the parent sent it)
    deadly = {s for s in ours if s == signal.SIGTERM or signal.getsignal(s) == signal.SIG_DFL}
    mask = _masks_before_fork.pop(threading.get_ident(), None)
    _installed.clear()
    _masks_before_fork.clear()
    if deadly:
        spare = SpareWorker(os.getppid(), sorted(deadly))
        if spare.when_a_dataloader_worker(workers.forking_a_worker(), mask):
            return  # unblocked once spared
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


os.register_at_fork(
    before=_block_before_fork,
    after_in_parent=_unblock_after_fork,
    after_in_child=_restore_in_child,
)


class PreemptionWatcher:
    """Records preemption requests (signals, cloud notices, manual) in a flag; nothing more.

    Which process/thread calls what: the training process installs it from its *main thread*
    (Python only runs signal handlers there), on every rank, since a scheduler may signal any
    process. From another thread :meth:`install` warns and installs nothing (``trigger`` still
    works). The training loop reads :attr:`requested` at step boundaries; any thread may call
    :meth:`trigger` (the :class:`MetadataPoller` does). Processes forked from the installing one
    get the previous handlers back, so SIGTERM still kills them; a DataLoader worker survives
    the first one while its trainer lives (a signal to the whole process group must not stop
    the loader before the emergency save).

    The first request wins; later ones are counted (:attr:`count`) but do not replace it.
    """

    def __init__(
        self,
        *,
        signals: Iterable[str | int] = DEFAULT_SIGNALS,
        handle_sigint: bool = False,
        grace_period_s: float | Mapping[str, float] | None = None,
    ) -> None:
        self.config = WatcherConfig(
            signals=signals, handle_sigint=handle_sigint, grace_period_s=grace_period_s
        )
        names = [str(n) for n in self.config.signals]
        self._signums: dict[int, str] = {getattr(signal, n).value: n for n in names}
        self._grace = {n: self.config.grace_for(n) for n in names}
        # Appends and clears of a list are atomic (GIL, and Python runs signal handlers between
        # bytecodes), so the handler and trigger() record without any lock.
        self._events: list[PreemptionRequest] = []
        self._previous: dict[int, _Handler] = {}
        self._pid = -1
        self._active = False
        self._order = 0
        self._handler = self._on_signal  # one bound-method object, so `is` finds it later
        self._replaced: set[str] = set()  # signals whose handler another one replaced (warned)
        # the pending request was answered by another watcher's Checkpointer (saved, exiting)
        self.answered_elsewhere = False
        # ... and that one saved a checkpoint for it (False: it exits for it unsaved, a wait
        # of its restore on a stalled store ended by the request)
        self.saved_elsewhere = False

    # -------------------------------------------------------------- install / uninstall

    def install(self) -> bool:
        """Install the handlers; False (with a warning) when not called from the main thread."""
        if self._active and self._pid == os.getpid():
            return True
        if threading.current_thread() is not threading.main_thread():
            _say_once(
                "PreemptionWatcher.install() was called outside the main thread, where Python "
                "cannot install signal handlers: SIGTERM/SIGUSR1 will not be noticed (trigger() "
                "and MetadataPoller still work). Create the watcher in the main thread.",
                stacklevel=2,
            )
            return False
        exiting.clear()  # (a process that caught the SystemExit trains on)
        self._previous = {}
        self._pid = os.getpid()
        self._order = next(_install_order)
        self._active = True
        try:
            for signum in self._signums:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handler)
        except (OSError, ValueError) as e:
            self.uninstall()
            names = ", ".join(self._signums.values())
            raise ConfigError(f"cannot install signal handlers for {names}: {e}") from e
        _installed.add(self)
        return True

    def uninstall(self, *, quiet: bool = False) -> None:
        """Restore the previous handlers (idempotent). From another thread, or where a handler
        installed after ours is current, ours is left in place but forwards to the previous one
        (from another thread, with a warning unless ``quiet``)."""
        if not self._active:
            return
        self._active = False
        _installed.discard(self)
        if self._pid != os.getpid():
            return
        if threading.current_thread() is not threading.main_thread():
            if quiet:
                return
            _say_once(
                "PreemptionWatcher.uninstall() outside the main thread cannot restore the "
                "previous signal handlers; the watcher's handlers now forward to them instead.",
                stacklevel=2,
            )
            return
        for signum, prev in self._previous.items():
            if signal.getsignal(signum) is self._handler:
                prev = _unwrap(signum, prev)
                if exiting.keep(signum, self._handler, prev):
                    continue  # ours stays, inactive: it ends the process with the code
                signal.signal(signum, signal.SIG_DFL if prev is None else prev)

    def __enter__(self) -> PreemptionWatcher:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def handler_before(self, signum: int) -> _Handler:
        """The handler ``signum`` had before this watcher (and watchers uninstalled since)
        took it: what :meth:`uninstall` restores."""
        prev = _unwrap(signum, self._previous.get(signum))
        return signal.SIG_DFL if prev is None else prev

    @property
    def installed_signals(self) -> tuple[str, ...]:
        """Names of the signals this watcher handles now (empty when not installed)."""
        if not (self._active and self._pid == os.getpid()):
            return ()
        return tuple(self._signums.values())

    # -------------------------------------------------------------- recording

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes of whatever it was doing: no I/O, no
        # logging, no locks, no saving here -- the interrupted code may hold what those need.
        if not self._active or os.getpid() != self._pid:
            _previous_action(signum, frame, self._previous.get(signum))
            return
        name = self._signums[signum]
        self._events.append(
            PreemptionRequest(
                source=name,
                wall_time=time.time(),
                monotonic=time.monotonic(),
                detail=f"{name} received by pid {self._pid}",
                grace_s=self._grace[name],
                signum=signum,
            )
        )
        # another watcher installed before this one (a second Checkpointer in this process)
        # learns of the signal too; any other previous handler (the default: exit) does not
        prev = self._previous.get(signum)
        owner = getattr(prev, "__self__", None)
        if isinstance(owner, PreemptionWatcher) and owner._active and prev is owner._handler:
            owner._on_signal(signum, frame)

    def _reached(self, signum: int) -> bool:
        """Whether ``signum`` reaches this watcher: its handler is current, or that of a
        watcher installed later (a second Checkpointer), which passes the signal on."""
        h = signal.getsignal(signum)
        for _ in range(64):  # watchers chained, each to the one before it
            if h is self._handler or (isinstance(h, _Chained) and h.watcher is self):
                return True
            owner = getattr(h, "__self__", None)
            if not (isinstance(owner, PreemptionWatcher) and owner._active and h is owner._handler):
                return False
            h = owner._previous.get(signum)
        return False

    def trigger(
        self, source: str = "manual", detail: str = "", *, grace_s: float | None = None
    ) -> bool:
        """Record a request from code (any thread). ``grace_s``, when given (a cloud notice's own
        deadline), wins over the configured grace period. True when this call made the request,
        False when one was already pending (this one is only counted)."""
        if not isinstance(source, str) or not source:
            raise ConfigError(f"source={source!r}: must be a non-empty string, e.g. 'manual'")
        if grace_s is not None:
            grace_s = _check_seconds("grace_s", grace_s, allow_zero=True)
        req = PreemptionRequest(
            source=source,
            wall_time=time.time(),
            monotonic=time.monotonic(),
            detail=str(detail),
            grace_s=self.config.grace_for(source) if grace_s is None else grace_s,
        )
        self._events.append(req)
        return self.request is req

    def chained(self, handler: Callable[[int, FrameType | None], Any]) -> _Chained:
        """A signal handler that records the signal as this watcher's own handler does (the
        emergency save at the next step), then runs ``handler``: install it in place of ours
        (``signal.signal(signal.SIGTERM, checkpointer.watcher.chained(my_handler))``) to keep
        both. :meth:`poll` does not warn about it as a handler that replaced ours."""
        if not callable(handler):
            raise ConfigError(f"chained(handler): not callable: {handler!r}")
        return _Chained(self, handler)

    def clear(self) -> None:
        """Forget the pending request (and the count)."""
        self._events.clear()

    # -------------------------------------------------------------- reading

    @property
    def requested(self) -> bool:
        return bool(self._events)

    def poll(self, stacklevel: int = 2) -> bool:
        """:attr:`requested`, at a step boundary. The first time a handler installed after
        this watcher's is found in its place, a warning says that the signal is no longer
        noticed (once per signal): that handler replaced ours, silently turning the
        preemption handling off."""
        if self._active and self._pid == os.getpid():
            for signum, name in self._signums.items():
                if name in self._replaced or self._reached(signum):
                    continue
                self._replaced.add(name)
                _say_once(
                    f"the {name} handler was replaced after the checkpointer installed its "
                    f"own ({signal.getsignal(signum)!r}): {name} no longer triggers the "
                    "emergency save. Install your handler before creating the Checkpointer "
                    "(it runs again after close()), or install it as "
                    f"signal.signal(signal.{name}, checkpointer.watcher.chained(handler)) to "
                    "keep both.",
                    stacklevel=stacklevel + 1,
                )
        return bool(self._events)

    def exiting(self, code: int) -> None:
        """This process saved for the pending request and now closes and exits with ``code``.
        Until it is gone (teardown takes a second or more), a signal of this watcher's whose
        action would end the process (the default's, SIGINT's) ends it at once with ``code``,
        not by the signal: its checkpoint is committed, and the scheduler must see "restart
        me" (a second SIGTERM: torchrun passing on a signal sent to its process group, a rank
        signalled later than the others). A handler installed before the watcher runs then.
        See :mod:`.exiting`."""
        exiting.mark(code)

    def passing_on_ends_the_process(self, signum: int) -> bool:
        """Whether ``signum`` passed on after :meth:`uninstall` would end the process: this
        watcher's handler is the current one, and the one it replaced is the default action
        (or SIGINT's ``KeyboardInterrupt``), not a handler of the user's."""
        prev = _unwrap(signum, self._previous.get(signum))
        return signal.getsignal(signum) is self._handler and exiting.ends_the_process(prev)

    def answered(self, saved: bool = True) -> list[PreemptionWatcher]:
        """This watcher's Checkpointer answered the pending request and the process exits
        (``saved``: it saved a checkpoint for it; False: it exits without one, its restore's
        wait ended by the request): the other watchers holding a request have it answered too;
        returns those it marked."""
        others = [w for w in list(_installed) if w is not self and w._events]
        marked = [w for w in others if not w.answered_elsewhere]
        for w in marked:
            w.answered_elsewhere = True
            w.saved_elsewhere = saved
        return marked

    @property
    def request(self) -> PreemptionRequest | None:
        """The first pending request, or None."""
        try:
            return self._events[0]
        except IndexError:
            return None

    @property
    def count(self) -> int:
        """How many requests were recorded since the last :meth:`clear` (the first included)."""
        return len(self._events)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a request is pending or ``timeout`` seconds passed; returns
        :attr:`requested`. Polls (a signal handler must not set a threading.Event)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._events:
            left = math.inf if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.005, left))
        return True

    def remaining_grace_s(self) -> float | None:
        """Seconds left before the hard kill (>= 0): the soonest deadline of the pending
        requests (a later one may bring a sooner one: a node drain's SIGTERM after a spot
        notice); None when nothing is pending or no deadline is known."""
        req = self._soonest()
        return None if req is None else req.remaining_s()

    def _soonest(self) -> PreemptionRequest | None:
        timed = [r for r in list(self._events) if r.grace_s is not None]
        return min(timed, key=lambda r: r.monotonic + (r.grace_s or 0.0), default=None)

    def check_grace(self, estimated_save_s: float) -> str | None:
        """A warning message when a save estimated to take ``estimated_save_s`` would not finish
        within the remaining grace period; None when it fits or nothing is known."""
        est = _check_seconds("estimated_save_s", estimated_save_s, allow_zero=True)
        req = self._soonest()
        left = None if req is None else req.remaining_s()
        if req is None or left is None or est <= left:
            return None
        return (
            f"preemption ({req.source}) leaves {left:.1f} s before the process is killed, but a "
            f"save is estimated to take {est:.1f} s: the emergency checkpoint may not finish. "
            "Give the job more time (Kubernetes terminationGracePeriodSeconds, Slurm "
            "--signal=USR1@<seconds>), or save more often so less work is at risk."
        )


class _Chained:
    """:meth:`PreemptionWatcher.chained`'s handler."""

    def __init__(
        self, watcher: PreemptionWatcher, handler: Callable[[int, FrameType | None], Any]
    ) -> None:
        self.watcher = watcher
        self.handler = handler

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        w = self.watcher
        if w._active and w._pid == os.getpid() and signum in w._signums:
            w._on_signal(signum, frame)
        return self.handler(signum, frame)

    def __repr__(self) -> str:
        return f"<{self.handler!r}, chained to the checkpointer's handler>"


def _say_once(msg: str, stacklevel: int) -> None:
    """A ``RuntimeWarning`` about how the watcher was set up (the same code on every rank):
    said once, on rank 0, in a job of several ranks (:func:`..notices.say_once`); a plain
    warning where ``torch.distributed`` was never imported (the watcher needs no torch).
    ``stacklevel`` as ``warnings.warn``'s, called where this is called."""
    if "torch.distributed" not in sys.modules:
        warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)
        return
    from ..notices import say_once

    say_once(log, msg, RuntimeWarning, stacklevel=stacklevel + 1)


def _unwrap(signum: int, prev: _Handler) -> _Handler:
    """Skip handlers of watchers uninstalled out of order, so they are not restored."""
    while isinstance(getattr(prev, "__self__", None), PreemptionWatcher):
        w: PreemptionWatcher = prev.__self__  # type: ignore[union-attr]
        if w._active or prev is not w._handler:
            break
        prev = w._previous.get(signum)
    return prev


def _previous_action(signum: int, frame: FrameType | None, prev: _Handler) -> None:
    """What the process would have done without the watcher (used in forked children); in
    a process exiting after its emergency save (:meth:`PreemptionWatcher.exiting`), where that
    ends the process, it exits with the preemption's code while the exit is under way (not
    once its ``SystemExit`` was caught and the process went on: :func:`.exiting.under_way`)."""
    code = exiting.code()
    if code is not None and exiting.ends_the_process(prev):
        if exiting.under_way():
            os._exit(code)
        exiting.clear()  # the SystemExit was caught and the process went on: as without us
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)  # default action: for SIGTERM, die by the signal
        os.kill(os.getpid(), signum)
