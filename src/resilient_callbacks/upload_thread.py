"""What the remote tier's upload threads share (:class:`~.sync.RemoteSync`,
:class:`~.remote_commit.NodeUploader`, :class:`~.remote_commit.RemoteCommitter`): one daemon
thread working under one condition variable, stopped by :meth:`UploadThread.stop`, and the
retry delay after a failed attempt, exponential backoff with jitter (:func:`backoff_s`).

The jitter draws from its own generator: an upload thread must never draw from the global one,
which the training loop uses (and the checkpoint restores). Which ranks call what: the rank that
owns the thread (the coordinator, or a node's leader); nothing here is collective.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

from .errors import RemoteDeleteRefusedError, RemoteUnavailableError
from .progress import Progress
from .redact import url_text

_JITTER = random.Random()
RETENTION_WARN_EVERY_S = 3600.0
EXIT_MARGIN_S = 5.0  # of a grace period, left to exit after the uploads (interpreter teardown)
# store key -> the upload threads of this process started for it, still running or not yet
# started (_after_previous)
_last_on: dict[str, list[weakref.ref[UploadThread]]] = {}
_last_lock = threading.Lock()
# the previous writer's threads the next writer gave up waiting for (_wait_previous): each
# begins no commit, retention delete or blob collection again (:func:`not_superseded`)
_superseded: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_numbers = itertools.count(1)  # the upload threads of this process, told apart in their names
HANDOVER_OUTAGE_S = 300.0  # how long no byte of the previous writer's attempt may move (as
# close()'s outage limit, stall.CLOSE_OUTAGE_S) before the next writer gives up waiting for it
HANDOVER_LOOK_S = 1.0  # how often the next writer looks at it and at stop() (tests lower it)
STOP_JOIN_S = 1.0  # how long stop() waits for the attempt under way, by default (tests lower it)


def not_superseded(url: str, thread: threading.Thread | None = None) -> None:
    """Before a commit point, a retention's delete, a blob collection or each file an upload
    puts (:mod:`.remote_put`) of an upload thread: raise where the next writer of its store gave
    up waiting for this thread (:meth:`UploadThread._wait_previous`), which then owns the
    store. ``thread``: the upload thread, where this runs in another (fsspec's event loop)."""
    if (thread or threading.current_thread()) in _superseded:
        raise RemoteUnavailableError(
            f"remote {url_text(url)}: this upload thread's attempt hung past the outage limit "
            "after its close() gave up on it, and the next writer of this store took it over: "
            "it commits and deletes nothing more. Nothing to do: that writer uploads the "
            "checkpoints still only local"
        )


def _of(thread: UploadThread) -> str:
    """``"<dirpath>; "``: which Checkpointer an upload thread is of, for a warning about it;
    empty where it was not said."""
    return f"{thread.writer}; " if thread.writer else ""


def _is_local(url: str) -> bool:
    """Whether ``url`` is a local store, where :meth:`UploadThread._wait_previous` does not
    give up on a copy that moves no byte: hung in the file system (a hung mount), it goes on
    writing the file it is in once that returns, into the folder this writer copies into (its
    copies count their bytes as they go, :mod:`.remote_put`: a long copy is not taken for a
    hung one; until then fsspec's local copy counted none until each file ended)."""
    return "://" not in url or url.split("://", 1)[0].lower() in ("file", "local")


def backoff_s(failures: int, base_s: float, max_s: float = math.inf, jitter: bool = True) -> float:
    """Seconds to wait after the ``failures``-th consecutive failure (1, 2, ...): ``base_s``
    doubling with each failure, at most ``max_s``; with ``jitter``, a random 50 to 100 % of
    that, so that writers that failed together do not retry together."""
    delay = min(max_s, base_s * 2 ** (failures - 1))
    return delay * _JITTER.uniform(0.5, 1.0) if jitter else delay


def retention_failed(thread: UploadThread, url: str, e: Exception) -> None:
    """Log that the remote retention on ``url`` failed (retried after the next upload): a
    warning the first time, then at most hourly, info between (a store that denies deletes
    fails it after every upload)."""
    now = time.monotonic()
    last = thread._retention_warned
    warn = last is None or now - last >= RETENTION_WARN_EVERY_S
    if warn:
        thread._retention_warned = now
    logging.getLogger("resilient_callbacks").log(
        logging.WARNING if warn else logging.INFO,
        "remote retention on %s failed (retried after the next upload; said again at most "
        "hourly): %s: %s",
        url,
        type(e).__name__,
        url_text(str(e)),
    )


REFUSED_RETRY_S = 600.0  # a checkpoint the store refused to delete: tried again after this,
REFUSED_RETRY_MAX_S = 6 * 3600.0  # the wait doubling with each refusal, to at most this


class Refusals:
    """The checkpoints a store refused to delete (a policy that denies deletes, an object
    lock), each tried again after a wait that doubles with each refusal (``REFUSED_RETRY_S``
    up to ``REFUSED_RETRY_MAX_S``), not at every retention pass: a store that refuses every
    delete got a request for each checkpoint it kept at every upload, more at each. Said once
    (a warning naming what was refused and what to grant), then in INFO lines.

    A delete the store carries out after refusals (its rights fixed, a lock expired) makes
    each other refused checkpoint due at the next pass, once per checkpoint (:meth:`deleted`):
    it waited up to ``REFUSED_RETRY_MAX_S`` after the fix, and a store that keeps refusing
    some (an object lock) still gets at most one request per checkpoint per pass, and no
    early one again. A checkpoint no longer listed (deleted by someone else) is forgotten
    (:meth:`prune`)."""

    def __init__(self) -> None:
        # name -> (refusals, monotonic next try, whether a delete of another shortened it)
        self._names: dict[str, tuple[int, float, bool]] = {}
        self.warned = False

    def due(self, name: str, now: float | None = None) -> bool:
        """Whether ``name`` may be asked for again (never refused, or its wait is over)."""
        got = self._names.get(name)
        return got is None or (time.monotonic() if now is None else now) >= got[1]

    def refused(self, name: str, now: float | None = None) -> float:
        """``name`` was refused (again): the seconds until it is tried again."""
        n, _, early = self._names.get(name, (0, 0.0, False))
        wait = backoff_s(n + 1, REFUSED_RETRY_S, REFUSED_RETRY_MAX_S, jitter=False)
        self._names[name] = (n + 1, (time.monotonic() if now is None else now) + wait, early)
        return wait

    def deleted(self, name: str, now: float | None = None) -> None:
        """``name`` was deleted: forgotten, and each other refused checkpoint not shortened
        before is due from ``now`` (the store's rights may have been fixed)."""
        self._names.pop(name, None)
        at = time.monotonic() if now is None else now
        for other, (n, next_try, early) in list(self._names.items()):
            if not early:
                self._names[other] = (n, min(next_try, at), True)

    def prune(self, listed: Collection[str]) -> None:
        """Forget the checkpoints not in ``listed`` (a listing of the store): gone."""
        for name in [x for x in self._names if x not in listed]:
            del self._names[name]


def delete_checkpoint(thread: UploadThread, store: Any, name: str, what: str) -> bool:
    """Delete the remote checkpoint ``name`` (``store.delete``) for a retention, which goes
    on with the other checkpoints whatever the store refuses; log ``what`` once deleted.
    Returns whether ``name`` is no longer committed: True where it is gone or the store
    refused only some of its files (the folder stays uncommitted), False where it refused
    the manifest (nothing deleted: still committed and whole) or refused it before and its
    wait is not over (:class:`Refusals`: nothing asked)."""
    refusals = thread._refusals
    if not refusals.due(name):
        return False
    not_superseded(store.url)
    log = logging.getLogger("resilient_callbacks")
    try:
        store.delete(name)
    except RemoteDeleteRefusedError as e:
        wait = refusals.refused(name)
        log.log(
            logging.INFO if refusals.warned else logging.WARNING,
            "remote retention on %s: %s. Tried again in %.0f min, then less and less often "
            "(at most every %.0f h)%s",
            url_text(store.url),
            e,
            wait / 60,
            REFUSED_RETRY_MAX_S / 3600,
            "" if refusals.warned else "; said once in this run (INFO lines after)",
        )
        refusals.warned = True
        return not e.committed
    refusals.deleted(name)
    log.info("%s: %s/%s", what, store.url, name)
    return True


class UploadThread:
    """A daemon thread (:meth:`_run`, given by the subclass) and the condition variable that
    guards the subclass's queue. The subclass calls ``super().__init__(name, writer)`` first
    and :meth:`_start` once its own attributes exist. The thread is named ``name`` and a
    number of this process (``rc-upload-3``): every writer's would be ``name`` alone, and a
    warning about one (:meth:`_wait_previous`) names it and its ``writer`` (its
    Checkpointer's dirpath)."""

    def __init__(self, name: str, writer: str = "") -> None:
        self.writer = writer
        self._cond = threading.Condition()
        self._retention_warned: float | None = None  # when a retention failure last warned
        self._refusals = Refusals()  # the checkpoints the store refused to delete
        self._stop = False
        self._previous: list[UploadThread] = []  # (see _after_previous)
        self._waiting_since: float | None = None  # (_wait_previous: when it began waiting)
        self._waiting_on: UploadThread | None = None  # (_wait_previous: the one waited for)
        self._progress: Progress | None = None  # of the transfer under way (:meth:`_transfer`)
        self._moved_at: float | None = None  # when its last transfer that ended last moved
        self._thread = threading.Thread(
            target=self._run, name=f"{name}-{next(_numbers)}", daemon=True
        )

    def _start(self) -> None:
        self._thread.start()

    def _after_previous(self, key: str) -> None:
        """Before :meth:`_start`: this thread uploads to the store ``key``
        (:attr:`.RemoteStore.key`); those of this process that uploaded there before, were
        stopped, and still run (an attempt that outlived its Checkpointer's close, which gave
        up on it: a shared mode's upload, a node's upload of its part, a remote commit) are
        waited for by :meth:`_wait_previous`."""
        with _last_lock:
            for k in list(_last_on):
                _last_on[k] = [r for r in _last_on[k] if _running_or_new(r())]
                if not _last_on[k]:
                    del _last_on[k]
            refs = _last_on.setdefault(key, [])
            prev = [t for r in refs if (t := r()) is not None and t._thread.is_alive()]
            refs.append(weakref.ref(self))
        self._previous = prev

    def _wait_previous(self, url: str) -> bool:
        """The thread, before its first attempt: wait for :meth:`_after_previous`'s threads
        that were stopped to end (each only finishes its attempt: stopped, it commits or
        uploads nothing else and deletes nothing). Both uploaded the same checkpoint at once,
        and the old one committed it again, or put a node's part of it again, after the new
        one's retention had deleted its files: a damaged checkpoint, or a name the retention
        had just deleted back in the store. False once stopped meanwhile. While it waits,
        :meth:`_waited_stall_s`; once that passes ``HANDOVER_OUTAGE_S`` (an attempt hung in
        a store that stopped answering it) it gives up, said in a warning, and the one given
        up on begins no commit, retention delete or blob collection again
        (:func:`not_superseded`). The store call it is inside still goes on: the rest of a
        checkpoint's files (one ``fs.put``), or a manifest write that may land after this
        writer's retention deleted that checkpoint (committed-looking and damaged: a restore
        falls back from it with a warning; docs/remote.md)."""
        # (one not stopped is another writer's, open, or this writer's other thread: not
        # waited for; nor one an earlier writer gave up on, fenced: each next writer of the
        # process waited out the outage limit for it again, and warned again)
        prevs = [
            p
            for p in self._previous
            if p._stop and p._thread.is_alive() and p._thread not in _superseded
        ]
        log = logging.getLogger("resilient_callbacks")
        try:
            if not prevs:
                return True
            log.info(
                "remote %s: this writer waits for the upload of the previous writer of this "
                "store in this process (its close() gave up on it) to end before it uploads",
                url_text(url),
            )
            self._waiting_since = time.monotonic()
            warned_local = False
            for prev in prevs:
                self._waiting_on = prev
                while prev._thread.is_alive():
                    prev._thread.join(timeout=HANDOVER_LOOK_S)  # (and looks at stop())
                    if self._stop:
                        return False
                    limit = max(HANDOVER_OUTAGE_S, self._allowance_s())  # (a part in flight)
                    if prev._thread.is_alive() and self._waited_stall_s() > limit:
                        if _is_local(url):
                            if not warned_local:
                                warned_local = True
                                log.warning(
                                    "remote %s: the upload thread %s of the previous writer "
                                    "of this store in this process (%sits close() gave up on "
                                    "it) has moved no byte for %.0f s; a copy into a "
                                    "local store that hangs is inside its file system and "
                                    "goes on writing once that returns: this writer keeps "
                                    "waiting for it (two writers copying into one folder "
                                    "could tear a file). If the store's file system hangs, "
                                    "restarting the process ends it",
                                    url_text(url),
                                    prev._thread.name,
                                    _of(prev),
                                    HANDOVER_OUTAGE_S,
                                )
                            continue
                        _superseded.add(prev._thread)  # (before this writer's first request)
                        log.warning(
                            "remote %s: the upload thread %s of the previous writer of this "
                            "store in this process (%sits close() gave up on it) moved no byte "
                            "for %.0f s; this writer stops waiting for it and uploads its "
                            "checkpoints now. That thread begins no commit or delete again, but "
                            "the store call it is in may still end (the rest of a checkpoint's "
                            "files; a manifest write landing late leaves a damaged checkpoint, "
                            "which a restore skips with a warning). If its store hangs "
                            "like this again, check the store's endpoint and the network; "
                            "restarting the process ends that thread",
                            url_text(url),
                            prev._thread.name,
                            _of(prev),
                            HANDOVER_OUTAGE_S,
                        )
                        break
                self._waiting_since = time.monotonic()  # (the next one's stall counts anew)
            return True
        finally:
            self._waiting_since, self._waiting_on, self._previous = None, None, []

    def _waited_stall_s(self) -> float:
        """While :meth:`_wait_previous` waits: how long no byte has moved for this writer
        (since the previous thread's upload last moved one, or since the wait began), else 0.
        close() gives up on a stalled wait as on a stalled upload of its own: an attempt of
        the previous writer that never returned held the next writer's close() for ever."""
        since, prev = self._waiting_since, self._waiting_on
        if since is None:
            return 0.0
        progress = getattr(prev, "_progress", None)  # (an upload under way)
        moved = getattr(prev, "_moved_at", None)  # (one that ended: its deletes, commit since)
        last = max(since, moved or since, since if progress is None else progress.last_update)
        return max(0.0, time.monotonic() - last)

    def _allowance_s(self) -> float:
        """How long the transfer under way (or, while :meth:`_wait_previous` waits, the
        previous writer's) may move no counted byte and still be moving: its store counts
        bytes per part (:meth:`.Progress.allowance_s`: at most an hour); 0 for no put under
        way (its settle and commit have none in flight). A stall is
        judged after the longer of this and the outage limit."""
        p = self._progress
        if p is None and self._waiting_since is not None:
            p = getattr(self._waiting_on, "_progress", None)
        return 0.0 if p is None else p.allowance_s()

    @contextlib.contextmanager
    def _transfer(self, progress: Progress) -> Iterator[Progress]:
        """The thread: a transfer under way, whose bytes ``progress`` counts (its last byte's
        time tells a stalled store: ``stalled_s``, and :meth:`_waited_stall_s` of the next
        writer waiting for this thread, also once it ended)."""
        self._progress = progress
        try:
            yield progress
        finally:
            self._moved_at, self._progress = progress.last_update, None
            progress.close()

    def _run(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def stop(self, join_s: float | None = None) -> None:
        """Stop after the current attempt; what is still queued is not uploaded. ``join_s``:
        how long to wait for the current attempt (0: not at all, a dropped Checkpointer; None:
        :data:`STOP_JOIN_S`, 1 s)."""
        if join_s is None:
            join_s = STOP_JOIN_S
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if join_s > 0:
            self._thread.join(timeout=join_s)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called: past its attempt under way it uploads nothing more
        (a close nested in another, from a signal handler, gave up on it), so a wait for its
        queue to drain has nothing left to wait for."""
        return self._stop

    def _wait_for_work(self, has_work: Callable[[], object]) -> bool:
        """The thread, holding the lock: block until ``has_work()`` or :meth:`stop`; False once
        stopped."""
        self._cond.wait_for(lambda: has_work() or self._stop)
        return not self._stop

    def _pause(self, seconds: float) -> bool:
        """The thread, holding the lock, after a failed attempt: wait ``seconds``, or less if
        :meth:`stop` is called; True once stopped."""
        return self._cond.wait_for(lambda: self._stop, timeout=seconds)


def _running_or_new(t: UploadThread | None) -> bool:
    """Whether ``t`` still counts for :meth:`UploadThread._after_previous`: running, or not
    started yet (its constructor's :meth:`~UploadThread._start` to come)."""
    return t is not None and (t._thread.ident is None or t._thread.is_alive())


def by_grace(deadline: float | None, grace_left: Callable[[], float | None] | None) -> float | None:
    """``deadline`` (monotonic), brought forward to a preemption's hard kill less a margin to
    exit, once ``grace_left()`` says one is coming."""
    grace = grace_left() if grace_left is not None else None
    if grace is None:
        return deadline
    by = time.monotonic() + max(0.0, grace - EXIT_MARGIN_S)
    return by if deadline is None else min(deadline, by)
