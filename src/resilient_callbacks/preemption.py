"""Preemption detection: notice that this process is about to be killed, and do nothing else.

Two sources feed one flag:

- :class:`PreemptionWatcher` installs signal handlers (SIGTERM, SIGUSR1, optionally SIGINT) that
  only *record* the request. Saving inside a signal handler interrupts arbitrary code, which may
  hold the locks a save needs, and hangs; so the handler does no I/O, takes no lock, logs nothing.
- :class:`MetadataPoller` polls a cloud metadata endpoint (AWS spot, GCP preemption, Azure
  scheduled events, or any URL) in a daemon thread and calls :meth:`PreemptionWatcher.trigger`
  when a notice appears.

The training loop checks :attr:`PreemptionWatcher.requested` at each step boundary, and there (in
the training thread, between two steps) takes the emergency checkpoint and stops::

    watcher = PreemptionWatcher()                      # main thread, on every rank
    with watcher, MetadataPoller(watcher, kind="aws"):
        for step in range(start, total):
            train_step()
            if watcher.requested:                      # a step boundary
                ckpt.save(step + 1, state)             # emergency save, in this thread
                raise SystemExit(143)                  # or let the framework stop

The defaults (signals, grace periods, cloud URLs) are the constants right below.
"""

from __future__ import annotations

import contextlib
import email.utils
import itertools
import json
import logging
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from http.client import HTTPException
from types import FrameType, MappingProxyType
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)


class MetadataKind(StrEnum):
    AWS = "aws"  # EC2 spot instance-action (IMDSv2 token, falling back to v1)
    GCP = "gcp"  # GCE instance/preempted (and optionally maintenance-event)
    AZURE = "azure"  # Azure scheduled events
    CUSTOM = "custom"  # any URL: HTTP 200 with a non-empty body is a notice


# ----------------------------------------------------------------------------- defaults

DEFAULT_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1")

#: Seconds between a request and the hard kill (SIGKILL / power-off), per request source.
DEFAULT_GRACE_S: Mapping[str, float] = MappingProxyType(
    {
        "SIGTERM": 30.0,  # Kubernetes terminationGracePeriodSeconds; also Slurm's KillWait
        "SIGUSR1": 120.0,  # Slurm `--signal=USR1@120`: set this to your @N
        "SIGINT": 30.0,  # Ctrl-C: nobody kills us, but don't keep a user waiting forever
        "metadata:aws": 120.0,  # EC2 spot interruption notice: two minutes
        "metadata:gcp": 30.0,  # GCE preemption / Spot VM: 30 s ACPI soft-off
        "metadata:azure": 30.0,  # Azure Spot Preempt: at least 30 s (NotBefore when given)
    }
)

DEFAULT_URLS: Mapping[MetadataKind, str] = MappingProxyType(
    {
        MetadataKind.AWS: "http://169.254.169.254/latest/meta-data/spot/instance-action",
        MetadataKind.GCP: "http://metadata.google.internal/computeMetadata/v1/instance/preempted",
        MetadataKind.AZURE: "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01",
    }
)
AWS_TOKEN_PATH = "/latest/api/token"  # IMDSv2: PUT on the same host as the instance-action URL
AWS_TOKEN_TTL_S = 21600
GCP_MAINTENANCE_NAME = "maintenance-event"  # read next to the preempted URL
AZURE_EVENT_TYPES = ("Preempt", "Terminate", "Reboot", "Redeploy", "Freeze")
DEFAULT_AZURE_EVENT_TYPES = ("Preempt", "Terminate")

_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}
_MAX_BODY = 64 * 1024


# ----------------------------------------------------------------------------- the request


@dataclass(frozen=True, kw_only=True)
class PreemptionRequest:
    """One request to stop: where it came from, when, and how long until the hard kill."""

    source: str  # "SIGTERM", "SIGUSR1", "SIGINT", "metadata:<kind>", "manual", ...
    wall_time: float  # time.time() when recorded
    monotonic: float  # time.monotonic() when recorded
    detail: str = ""
    grace_s: float | None = None  # seconds from `monotonic` to the hard kill; None: unknown
    signum: int | None = None  # the signal number, for a signal (exit code 128 + signum)

    def remaining_s(self, now: float | None = None) -> float | None:
        """Seconds left before the hard kill (>= 0), or None when the deadline is unknown."""
        if self.grace_s is None:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self.monotonic + self.grace_s - now)


# ----------------------------------------------------------------------------- the watcher


def _signal_name(s: Any) -> str:
    if isinstance(s, signal.Signals) or (isinstance(s, int) and not isinstance(s, bool)):
        try:
            return signal.Signals(s).name
        except ValueError:
            raise ConfigError(f"signals: {s!r} is not a signal number on this platform") from None
    if isinstance(s, str):
        name = s.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if isinstance(getattr(signal, name, None), signal.Signals):
            return name
    raise ConfigError(
        f"signals: {s!r} is not a signal; use names like 'SIGTERM' or 'USR1', or signal numbers"
    )


def _check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name}={value!r}: must be a finite number of seconds {bound}")
    return float(value)


def _valid_source_key(key: str) -> bool:
    if key == "manual":
        return True
    if key.startswith("metadata:"):
        return key[len("metadata:") :] in set(MetadataKind)
    return key.startswith("SIG") and isinstance(getattr(signal, key, None), signal.Signals)


@dataclass(frozen=True, kw_only=True)
class WatcherConfig:
    """Options of a :class:`PreemptionWatcher`; ``signals`` is normalised to names."""

    signals: tuple[str, ...] | Iterable[str | int] = DEFAULT_SIGNALS
    handle_sigint: bool = False
    grace_period_s: float | Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.signals, (str, int)) or not isinstance(self.signals, Iterable):
            raise ConfigError(
                f"signals={self.signals!r}: must be a list of signals, e.g. ['SIGTERM', 'SIGUSR1']"
            )
        if not isinstance(self.handle_sigint, bool):
            raise ConfigError(f"handle_sigint={self.handle_sigint!r}: must be True or False")
        names = [_signal_name(s) for s in self.signals]
        if self.handle_sigint:
            names.append("SIGINT")
        for n in names:
            if n in _UNCATCHABLE:
                raise ConfigError(f"signals: {n} cannot be caught by any process; remove it")
        object.__setattr__(self, "signals", tuple(dict.fromkeys(names)))
        g = self.grace_period_s
        if isinstance(g, Mapping):
            for key, value in g.items():
                if not isinstance(key, str) or not _valid_source_key(key):
                    raise ConfigError(
                        f"grace_period_s: unknown source {key!r}; keys are signal names "
                        "('SIGTERM', 'SIGUSR1', ...), 'metadata:aws', 'metadata:gcp', "
                        "'metadata:azure', 'metadata:custom' or 'manual'"
                    )
                _check_seconds(f"grace_period_s[{key!r}]", value)
            object.__setattr__(self, "grace_period_s", MappingProxyType(dict(g)))
        elif g is not None:
            _check_seconds("grace_period_s", g)

    def grace_for(self, source: str) -> float | None:
        """The grace period of a request from ``source``: configured, else the default."""
        g = self.grace_period_s
        if isinstance(g, Mapping):
            if source in g:
                return float(g[source])
        elif g is not None:
            return float(g)
        return DEFAULT_GRACE_S.get(source)


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

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
        _masks_before_fork[threading.get_ident()] = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)


def _unblock_after_fork() -> None:
    mask = _masks_before_fork.pop(threading.get_ident(), None)
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _restore_in_child() -> None:
    # A forked child (a DataLoader worker) must die on SIGTERM like before: give it back the
    # handlers that were there before ours, newest watcher first, then unblock (a SIGTERM that
    # arrived meanwhile now takes effect). The pid check in the handler covers children forked
    # without running this hook.
    for w in sorted(_installed, key=lambda w: w._order, reverse=True):
        w._active = False
        for signum, prev in w._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signum, signal.SIG_DFL if prev is None else prev)
    _installed.clear()
    _unblock_after_fork()
    _masks_before_fork.clear()


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
    (DataLoader workers) get the previous handlers back, so SIGTERM still kills them.

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

    # -------------------------------------------------------------- install / uninstall

    def install(self) -> bool:
        """Install the handlers; False (with a warning) when not called from the main thread."""
        if self._active and self._pid == os.getpid():
            return True
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "PreemptionWatcher.install() was called outside the main thread, where Python "
                "cannot install signal handlers: SIGTERM/SIGUSR1 will not be noticed (trigger() "
                "and MetadataPoller still work). Create the watcher in the main thread.",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
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

    def uninstall(self) -> None:
        """Restore the previous handlers (idempotent). From another thread, or where a handler
        installed after ours is current, ours is left in place but forwards to the previous one."""
        if not self._active:
            return
        self._active = False
        _installed.discard(self)
        if self._pid != os.getpid():
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "PreemptionWatcher.uninstall() outside the main thread cannot restore the "
                "previous signal handlers; the watcher's handlers now forward to them instead.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        for signum, prev in self._previous.items():
            if signal.getsignal(signum) is self._handler:
                prev = _unwrap(signum, prev)
                signal.signal(signum, signal.SIG_DFL if prev is None else prev)

    def __enter__(self) -> PreemptionWatcher:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

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

    def clear(self) -> None:
        """Forget the pending request (and the count)."""
        self._events.clear()

    # -------------------------------------------------------------- reading

    @property
    def requested(self) -> bool:
        return bool(self._events)

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
        """Seconds left before the hard kill for the pending request (>= 0); None when nothing
        is pending or its deadline is unknown."""
        req = self.request
        return None if req is None else req.remaining_s()

    def check_grace(self, estimated_save_s: float) -> str | None:
        """A warning message when a save estimated to take ``estimated_save_s`` would not finish
        within the remaining grace period; None when it fits or nothing is known."""
        est = _check_seconds("estimated_save_s", estimated_save_s, allow_zero=True)
        req = self.request
        left = None if req is None else req.remaining_s()
        if req is None or left is None or est <= left:
            return None
        return (
            f"preemption ({req.source}) leaves {left:.1f} s before the process is killed, but a "
            f"save is estimated to take {est:.1f} s: the emergency checkpoint may not finish. "
            "Give the job more time (Kubernetes terminationGracePeriodSeconds, Slurm "
            "--signal=USR1@<seconds>), or save more often so less work is at risk."
        )


def _unwrap(signum: int, prev: _Handler) -> _Handler:
    """Skip handlers of watchers uninstalled out of order, so they are not restored."""
    while isinstance(getattr(prev, "__self__", None), PreemptionWatcher):
        w: PreemptionWatcher = prev.__self__  # type: ignore[union-attr]
        if w._active or prev is not w._handler:
            break
        prev = w._previous.get(signum)
    return prev


def _previous_action(signum: int, frame: FrameType | None, prev: _Handler) -> None:
    """What the process would have done without the watcher (used in forked children)."""
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)  # default action: for SIGTERM, die by the signal
        os.kill(os.getpid(), signum)


# ----------------------------------------------------------------------------- the poller


class _PollError(Exception):
    """The endpoint could not be read (refused, timeout, unexpected status, bad body)."""


@dataclass(frozen=True)
class _Notice:
    detail: str
    grace_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class PollerConfig:
    """Options of a :class:`MetadataPoller`. ``url`` defaults to the kind's cloud endpoint."""

    kind: MetadataKind | str
    url: str | None = None
    interval_s: float = 5.0
    timeout_s: float = 1.0
    warn_after_failures: int = 3
    aws_imdsv2: bool = True
    gcp_maintenance: bool = False
    azure_event_types: tuple[str, ...] | Iterable[str] = DEFAULT_AZURE_EVENT_TYPES
    azure_vm_name: str | None = None  # only events whose Resources name this VM count

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", MetadataKind(self.kind))
        except ValueError:
            kinds = ", ".join(repr(k.value) for k in MetadataKind)
            raise ConfigError(f"kind={self.kind!r}: must be one of {kinds}") from None
        url = self.url if self.url is not None else DEFAULT_URLS.get(MetadataKind(self.kind))
        if url is None:
            raise ConfigError("kind='custom' needs url=... (the endpoint to poll)")
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ConfigError(f"url={url!r}: must be an http:// or https:// URL")
        object.__setattr__(self, "url", url)
        _check_seconds("interval_s", self.interval_s)
        _check_seconds("timeout_s", self.timeout_s)
        n = self.warn_after_failures
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"warn_after_failures={n!r}: must be an int >= 1")
        for name in ("aws_imdsv2", "gcp_maintenance"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be True or False")
        types = self.azure_event_types
        if isinstance(types, str) or not isinstance(types, Iterable):
            raise ConfigError(f"azure_event_types={types!r}: must be a list, e.g. ['Preempt']")
        types = tuple(types)
        bad = [t for t in types if t not in AZURE_EVENT_TYPES]
        if bad or not types:
            raise ConfigError(
                f"azure_event_types={list(types)!r}: must be a non-empty list of "
                f"{', '.join(AZURE_EVENT_TYPES)}"
            )
        object.__setattr__(self, "azure_event_types", types)
        if self.azure_vm_name is not None and not (
            isinstance(self.azure_vm_name, str) and self.azure_vm_name
        ):
            raise ConfigError(f"azure_vm_name={self.azure_vm_name!r}: must be a VM name or None")


def _seconds_until(when: datetime) -> float:
    return max(0.0, when.timestamp() - time.time())


class MetadataPoller:
    """Polls one metadata endpoint from a daemon thread; on a notice, ``watcher.trigger()``.

    Which process/thread calls what: the training process calls :meth:`start` and :meth:`stop`,
    or uses it as a context manager; a notice concerns one VM, so one poller per node is enough
    when the flag is combined across ranks, and one per rank is harmless. Its
    thread only reads the endpoint and calls :meth:`PreemptionWatcher.trigger`, which never
    blocks the training thread. An unreachable endpoint is not a notice: it is logged at debug,
    polling goes on, and one warning is logged after ``warn_after_failures`` failures in a row.
    A notice triggers once; it triggers again only if it changes, or disappears and comes back.
    """

    def __init__(
        self,
        watcher: PreemptionWatcher,
        *,
        kind: MetadataKind | str,
        url: str | None = None,
        interval_s: float = 5.0,
        timeout_s: float = 1.0,
        warn_after_failures: int = 3,
        aws_imdsv2: bool = True,
        gcp_maintenance: bool = False,
        azure_event_types: Iterable[str] = DEFAULT_AZURE_EVENT_TYPES,
        azure_vm_name: str | None = None,
    ) -> None:
        if not isinstance(watcher, PreemptionWatcher):
            raise ConfigError(f"watcher={watcher!r}: must be a PreemptionWatcher")
        self.config = PollerConfig(
            kind=kind,
            url=url,
            interval_s=interval_s,
            timeout_s=timeout_s,
            warn_after_failures=warn_after_failures,
            aws_imdsv2=aws_imdsv2,
            gcp_maintenance=gcp_maintenance,
            azure_event_types=azure_event_types,
            azure_vm_name=azure_vm_name,
        )
        self.watcher = watcher
        self.kind = MetadataKind(self.config.kind)
        self.source = f"metadata:{self.kind.value}"
        self._azure_types = tuple(self.config.azure_event_types)
        self.url: str = self.config.url  # type: ignore[assignment]
        self.polls = 0  # completed polls, failed or not
        self.consecutive_failures = 0
        # Metadata endpoints are link-local: never send them through an http_proxy.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_notice: str | None = None
        self._aws_token: str | None = None
        self._aws_token_expiry = 0.0

    # -------------------------------------------------------------- lifecycle

    def start(self) -> MetadataPoller:
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"resilient-callbacks-{self.source}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and join the thread (waits at most for one in-flight request)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2 * self.config.timeout_s + 1.0)

    def __enter__(self) -> MetadataPoller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        stop = self._stop
        while not stop.is_set():
            self.poll_once()
            stop.wait(self.config.interval_s)

    # -------------------------------------------------------------- one poll

    def poll_once(self) -> bool:
        """Read the endpoint once; True when it shows a notice. Never raises."""
        try:
            notice = self._check()
        except Exception as e:  # _PollError, or a bug: either way the thread must live on
            self.polls += 1
            self.consecutive_failures += 1
            log.debug("%s: cannot read %s: %s", self.source, self.url, e, exc_info=True)
            if self.consecutive_failures == self.config.warn_after_failures:
                log.warning(
                    "cannot read the %s preemption notice endpoint %s (%d failures in a row; "
                    "last: %s). Polling continues; notices are missed while this lasts. Check "
                    "that this machine runs on that cloud, or pass the right url=.",
                    self.kind.value,
                    self.url,
                    self.consecutive_failures,
                    e,
                )
            return False
        self.polls += 1
        if self.consecutive_failures >= self.config.warn_after_failures:
            log.info("%s: %s is reachable again", self.source, self.url)
        self.consecutive_failures = 0
        if notice is None:
            self._last_notice = None
            return False
        if notice.detail != self._last_notice:
            self._last_notice = notice.detail
            log.warning("preemption notice from %s: %s", self.source, notice.detail)
            self.watcher.trigger(self.source, notice.detail, grace_s=notice.grace_s)
        return True

    def _get(self, url: str, headers: Mapping[str, str], method: str = "GET") -> tuple[int, bytes]:
        req = urllib.request.Request(url, headers=dict(headers), method=method)
        try:
            with self._opener.open(req, timeout=self.config.timeout_s) as resp:
                return int(resp.status), resp.read(_MAX_BODY)
        except urllib.error.HTTPError as e:
            with contextlib.closing(e):
                return int(e.code), b""
        except (OSError, HTTPException) as e:  # refused, reset, timeout (URLError is an OSError)
            raise _PollError(f"{method} {url}: {getattr(e, 'reason', None) or e}") from e

    def _check(self) -> _Notice | None:
        return {
            MetadataKind.AWS: self._check_aws,
            MetadataKind.GCP: self._check_gcp,
            MetadataKind.AZURE: self._check_azure,
            MetadataKind.CUSTOM: self._check_custom,
        }[self.kind]()

    def _token(self) -> str | None:
        """An IMDSv2 session token, or None to fall back to IMDSv1 for this poll."""
        if self._aws_token is not None and time.monotonic() < self._aws_token_expiry:
            return self._aws_token
        self._aws_token = None
        url = urllib.parse.urljoin(self.url, AWS_TOKEN_PATH)
        hdr = {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
        try:
            status, body = self._get(url, hdr, method="PUT")
        except _PollError as e:
            log.debug("%s: no IMDSv2 token (%s); trying IMDSv1", self.source, e)
            return None
        token = body.decode("ascii", "replace").strip()
        if status != 200 or not token:
            log.debug("%s: no IMDSv2 token (HTTP %d); trying IMDSv1", self.source, status)
            return None
        self._aws_token = token
        self._aws_token_expiry = time.monotonic() + AWS_TOKEN_TTL_S - 60
        return token

    def _check_aws(self) -> _Notice | None:
        token = self._token() if self.config.aws_imdsv2 else None
        status, body = self._get(self.url, {"X-aws-ec2-metadata-token": token} if token else {})
        if status == 404:
            return None  # no interruption scheduled
        if status == 401:
            self._aws_token = None  # expired or rejected: get a new one next poll
            raise _PollError(f"GET {self.url}: HTTP 401 (IMDSv2 token missing or rejected)")
        if status != 200:
            raise _PollError(f"GET {self.url}: HTTP {status}")
        try:
            doc = json.loads(body)
            action, when = str(doc["action"]), str(doc.get("time", ""))
        except (ValueError, TypeError, KeyError) as e:
            raise _PollError(
                f"GET {self.url}: not an instance-action document: {body[:200]!r}"
            ) from e
        try:
            grace: float | None = _seconds_until(datetime.fromisoformat(when))
        except ValueError:
            grace = None
        return _Notice(f"action={action} time={when}", grace)

    def _check_gcp(self) -> _Notice | None:
        hdr = {"Metadata-Flavor": "Google"}
        status, body = self._get(self.url, hdr)
        if status != 200:
            raise _PollError(f"GET {self.url}: HTTP {status}")
        if body.strip().upper() == b"TRUE":
            return _Notice("preempted=TRUE")
        if self.config.gcp_maintenance:
            url = urllib.parse.urljoin(self.url, GCP_MAINTENANCE_NAME)
            status, body = self._get(url, hdr)
            if status != 200:
                raise _PollError(f"GET {url}: HTTP {status}")
            event = body.decode("utf-8", "replace").strip()
            if event and event.upper() != "NONE":
                return _Notice(f"maintenance-event={event}")
        return None

    def _check_azure(self) -> _Notice | None:
        status, body = self._get(self.url, {"Metadata": "true"})
        if status != 200:
            raise _PollError(f"GET {self.url}: HTTP {status}")
        try:
            events = json.loads(body).get("Events") or []
            if not isinstance(events, list):
                raise TypeError("Events is not a list")
        except (ValueError, TypeError, AttributeError) as e:
            raise _PollError(f"GET {self.url}: not a scheduled-events document: {e}") from e
        found: list[_Notice] = []
        for ev in events:
            if not isinstance(ev, dict) or ev.get("EventType") not in self._azure_types:
                continue
            vm = self.config.azure_vm_name
            if vm is not None and vm not in (ev.get("Resources") or []):
                continue  # an event for another VM of the same scale set / availability set
            not_before = str(ev.get("NotBefore") or "")
            try:
                grace: float | None = _seconds_until(email.utils.parsedate_to_datetime(not_before))
            except (TypeError, ValueError):
                grace = None
            found.append(
                _Notice(
                    f"{ev.get('EventType')} {ev.get('EventStatus', '')} NotBefore={not_before} "
                    f"EventId={ev.get('EventId', '')}",
                    grace,
                )
            )
        if not found:
            return None
        return min(found, key=lambda n: math.inf if n.grace_s is None else n.grace_s)

    def _check_custom(self) -> _Notice | None:
        status, body = self._get(self.url, {})
        if status in (204, 404):
            return None
        if status != 200:
            raise _PollError(f"GET {self.url}: HTTP {status}")
        text = body.decode("utf-8", "replace").strip()
        return _Notice(text[:500]) if text else None


__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_SIGNALS",
    "DEFAULT_URLS",
    "MetadataKind",
    "MetadataPoller",
    "PollerConfig",
    "PreemptionRequest",
    "PreemptionWatcher",
    "WatcherConfig",
]
