"""Reads from the remote store that an error burst must not turn into a fallback: which errors
may pass (:func:`may_pass`), and the manifests of a listing read again when one failed so
(:func:`cat_manifests`). A 5xx or ``SlowDown`` burst longer than the store's client's own retries
made a restore skip the newest checkpoint for an older one (a whole save interval of training
lost over a few seconds of errors).

Which ranks call what: those that read the remote store (the coordinator; in node-local mode
each node's leader); nothing collective.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any

from . import remote_paths
from .errors import CheckpointCorruptError, RemoteUnavailableError
from .redact import url_text
from .upload_thread import backoff_s

log = logging.getLogger("resilient_callbacks")
READ_TRIES = 3  # a read that failed for an error that may pass is made this often in all


def may_pass(e: BaseException) -> bool:
    """Whether ``e`` is an error of the store that a later try may not get (a 5xx, a reset,
    a timeout): an ``OSError`` other than a missing object, a refusal (403), a checksum
    mismatch, a full local disk or a stall already given up on."""
    final = FileNotFoundError | PermissionError | CheckpointCorruptError | RemoteUnavailableError
    return (
        isinstance(e, OSError)
        and not isinstance(e, final)
        and e.errno not in (errno.ENOSPC, errno.EDQUOT)
    )


def cat_manifests(fs: Any, paths: list[str], url: str) -> dict[str, Any]:
    """``fs.cat(paths, on_error="return")``, each path taken literally (path -> bytes, or the exception reading it
    raised), with the paths whose read failed for an error that :func:`may_pass` read again,
    up to :data:`READ_TRIES` times in all (after 1 s, then 2 s; a warning says so)."""
    got = remote_paths.cat(fs, paths)
    for attempt in range(1, READ_TRIES):
        again = [p for p, v in got.items() if isinstance(v, BaseException) and may_pass(v)]
        if not again:
            break
        wait = backoff_s(attempt, 1.0, jitter=False)
        e = got[again[0]]
        log.warning(
            "remote %s: reading %d manifest(s) failed (%s: %s); trying again in %g s",
            url,
            len(again),
            type(e).__name__,
            url_text(str(e)),
            wait,
        )
        time.sleep(wait)
        got.update(remote_paths.cat(fs, again))
    return got
