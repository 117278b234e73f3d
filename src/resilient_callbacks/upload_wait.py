"""close()'s wait for a directory's uploads to the remote tier: :func:`finish_uploads` waits
for the upload queue to drain (bounded by a timeout, an outage of the store, a preemption's
grace period), then says what is only local. Which ranks call what: the coordinator (the rank
that opened the directory, the only one with a remote tier). Moved from ``directory.py``
(``Directory.finish_uploads``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .redact import push_command
from .upload_thread import EXIT_MARGIN_S

if TYPE_CHECKING:
    from .directory import Directory
    from .sync import SyncStatus

__all__ = ["finish_uploads"]

log = logging.getLogger("resilient_callbacks")

LOOK_S = 1.0  # how often close()'s waits look at the uploads' progress (node-local mode's
# NodeUploader.wait and RemoteCommitter.wait too; tests lower it)


def finish_uploads(
    d: Directory, timeout: float | None, outage_s: float, grace_left: Callable[[], float | None]
) -> list[str]:
    """close(): wait for the uploads (a bar on a terminal); say and return what is only local
    (``[]``: none). ``grace_left``: seconds to a preemption's hard kill (None: none)."""
    assert d.sync is not None and d.remote is not None
    status = d.sync.status()
    if status.pending:
        log.warning(
            "waiting for %d checkpoint(s) to upload to %s: %s%s",
            len(status.pending),
            d.remote.url,
            ", ".join(status.pending),
            "" if timeout is None else f" (at most {timeout:.0f} s)",
        )
        d.sync.show_progress = True
    if _wait_uploads(d, timeout, outage_s, grace_left):
        if status.pending:
            log.warning("all checkpoints are uploaded to %s", d.remote.url)
        return []
    status = d.sync.status()
    log.warning(
        "close(): %d checkpoint(s) are still only local in %s, not in %s: %s (last error: "
        "%s). They are kept locally; the next run with the same dirpath and remote uploads "
        "them, or run %s.",
        len(status.pending),
        d.dirpath,
        d.remote.url,
        ", ".join(status.pending),
        status.last_error or _still(status),
        push_command(d.dirpath, d.remote.url, d.remote.options),
    )
    return list(status.pending)


def _wait_uploads(
    d: Directory, timeout: float | None, outage_s: float, grace_left: Callable[[], float | None]
) -> bool:
    """Wait for the upload queue to drain: up to ``timeout``; without one, as long as the
    store answers, giving up after ``outage_s`` of failing attempts (an attempt under way
    that moves bytes is let finish) or of one that moves no byte (close() then raises; longer
    where its store counts bytes per part: ``stall_allowance_s``).
    A preemption request meanwhile bounds the wait to its grace period, less 5 s. Ends at
    once when the upload thread was stopped (a close nested in this one, from a signal
    handler, gave up on the uploads): no upload is left to come."""
    assert d.sync is not None
    deadline = None if timeout is None else time.monotonic() + timeout
    outage_since: float | None = None
    while True:
        if d.sync.stopped:  # (a close nested in this one, a signal handler's, gave up on them)
            return d.sync.wait(0)
        grace = grace_left()
        if grace is not None:
            by = time.monotonic() + max(0.0, grace - EXIT_MARGIN_S)
            deadline = by if deadline is None else min(deadline, by)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return d.sync.wait(0)
        if d.sync.wait(LOOK_S if left is None else min(left, LOOK_S)):
            return True
        st = d.sync.status()
        outage_since = (outage_since or time.monotonic()) if st.failures else None
        stall_limit = max(outage_s, st.stall_allowance_s)  # (a store counting per part)
        # (let it finish; after a failure, judged by the outage limit alone: a store that
        # failed and then counts no byte is down, not slow)
        moving = st.uploading is not None and st.stalled_s <= outage_s
        failing = 0.0 if outage_since is None or moving else time.monotonic() - outage_since
        if deadline is None and (failing > outage_s or st.stalled_s > stall_limit):
            return False


def _still(status: SyncStatus) -> str:
    """What the uploads were doing when close() gave up on them without an error."""
    if status.waits_previous:
        return (
            "none: this writer waited for the upload of the previous writer of this store in "
            "this process to end (that writer's close() gave up on it) and it never did"
        )
    return "none: still uploading, it may yet finish before the exit"
