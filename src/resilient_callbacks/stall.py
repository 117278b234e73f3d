"""Bounding the remote tier's reads at restore: a store that accepts connections and then
stalls or fails every read must not hang a restarted job at its start.

The store's client has its own timeouts (s3fs: about 7 minutes per request, retries
included: docs/remote.md), other fsspec filesystems may have none. So a restore runs its
listing and each download in a daemon thread and waits for it while it makes progress: a
listing gets :func:`limit_s` seconds in all, a download as long as bytes keep arriving (the
files growing in its staging folder, or the transfer's own byte count), until none has
arrived for :func:`limit_s` seconds (the limit after which ``close()`` gives up on uploads).
It then raises :class:`~.errors.RemoteUnavailableError` naming what stalled, and the restore
goes on as for any other failed read: the next candidate, loudly, or an error. The thread is
abandoned (a daemon: it never keeps the process alive); what it writes later lies in a hidden
staging folder that the next writer of the directory sweeps.

Used by the restore (shared and node-local mode: there every node's leader lists and downloads
its own part) and by ``resilient-ckpt pull``. Which ranks call what: those that read the
remote store (the coordinator; in node-local mode each node's leader); nothing collective.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import RemoteUnavailableError, RemoteWaitPreemptedError
from .redact import url_text
from .remote_reads import READ_TRIES, may_pass
from .store_wait import carried
from .upload_thread import backoff_s

if TYPE_CHECKING:
    from .remote import RemoteEntry, RemoteStore

log = logging.getLogger("resilient_callbacks")
T = TypeVar("T")
# seconds of failing uploads before close() gives up (UploadIncompleteError); of a stalled restore
CLOSE_OUTAGE_S = 300.0  # (checkpointer.CLOSE_OUTAGE_S: set it there)
LOG_EVERY_S = 30.0  # a long download says how far it got this often


def limit_s() -> float:
    """Seconds without progress after which a restore's remote read is given up: the outage
    limit of ``close()`` (``checkpointer.CLOSE_OUTAGE_S``, 5 minutes, as it is set there once that
    module is imported: the CLI's pull imports no checkpointer, nor torch)."""
    checkpointer = sys.modules.get(f"{__package__}.checkpointer")
    return float(getattr(checkpointer, "CLOSE_OUTAGE_S", CLOSE_OUTAGE_S))


def run(
    fn: Callable[[], T],
    what: str,
    moved: Callable[[], tuple[int | None, str]] | None = None,
    who: str = "the restore",
    preemptible: bool = False,
) -> T:
    """``fn()`` in a daemon thread: its result, or its exception. ``moved()``: the bytes
    transferred so far and a few words on what is still under way, or None for the bytes
    once ``fn`` no longer waits on the store (every byte arrived, it verifies them: local
    work, not bounded, never a stall); without it ``fn`` gets
    :func:`limit_s` in all, with it until the count has not changed for that long (its
    progress logged every :data:`LOG_EVERY_S`, a warning once it stalls). Then
    :class:`RemoteUnavailableError`, naming ``what`` and what was under way.
    ``preemptible``: a preemption request pending in this process (a Checkpointer installs
    its handlers before it opens its directory) ends the wait at once,
    :class:`RemoteWaitPreemptedError` (for a listing or a download whose caller raises that,
    on every rank, rather than fall back: the limit is longer than a grace period, and the
    signal was only recorded)."""
    from .preemption import pending  # (lazily: stall is below the preemption layer)

    limit = limit_s()
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    # (with the store_wait hook the CLI set, if any: the listing's wait is said there too)
    worker = threading.Thread(target=carried(target), name="rc-restore-read", daemon=True)
    worker.start()
    t0 = last_move = last_log = time.monotonic()
    seen = -1
    while True:
        worker.join(min(1.0, limit / 4))
        if not worker.is_alive():
            break
        if preemptible and (req := pending.requests()):
            raise RemoteWaitPreemptedError(
                f"{what}: {req[0].source} arrived while {who} waited for the store's answer "
                f"({time.monotonic() - t0:.0f} s so far, up to {limit:g} s"
                f"{' without a byte' if moved is not None else ''}): the wait ended, "
                "nothing was saved. The next run resumes as this one would have; if the store "
                "stalls, check its endpoint and health"
            )
        now, (done, doing) = time.monotonic(), moved() if moved is not None else (0, "")
        if moved is not None and (done is None or done != seen):
            seen, last_move = (seen if done is None else done), now
        if now - last_move > limit:
            since = "no answer" if moved is None else f"no byte arrived for {now - last_move:.0f} s"
            raise RemoteUnavailableError(
                f"{what}: {since} (after {now - t0:.0f} s in all{'; ' + doing if doing else ''}"
                f"). The store accepts connections but stalls or fails its reads; {who} "
                f"gave up after {limit:g} s without progress. Retry when the store answers "
                "(check its endpoint and health)"
            )
        if moved is not None and now - last_log >= LOG_EVERY_S:
            last_log, idle = now, now - last_move  # a stall is a warning, progress is info
            log.log(
                logging.WARNING if idle >= LOG_EVERY_S else logging.INFO,
                "%s: %.1f MB so far after %.0f s, the last byte %.0f s ago%s",
                what,
                max(seen, 0) / 1e6,
                now - t0,
                idle,
                f" ({doing})" if doing else "",
            )
    if "error" in out:
        raise out["error"]
    return out["value"]


def on_disk(folder: str, prefix: str, sizes: dict[str, int]) -> tuple[int, str]:
    """For :func:`run`'s ``moved``: the bytes in ``folder``'s entries named ``prefix*``
    (a download's staging folder, a blob's temporary file), and the files there still short
    of their ``sizes`` (relative path in the staging folder -> expected size)."""
    total, short, present = 0, [], set()
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return 0, ""
    for n in names:
        top = os.path.join(folder, n)
        for root, _, files in os.walk(top) if os.path.isdir(top) else [("", [], [top])]:
            for f in files:
                p = os.path.join(root, f)
                try:
                    size = os.path.getsize(p)
                except OSError:
                    continue
                total += size
                rel = os.path.relpath(p, top) if root else ""
                present.add(rel)
                if rel in sizes and size < sizes[rel]:
                    short.append(f"{rel} {size / 1e6:.1f} of {sizes[rel] / 1e6:.1f} MB")
    doing = [f"under way: {', '.join(sorted(short)[:5])}"] if short else []
    if names and (waiting := len([r for r in sizes if r not in present])):
        doing.append(f"{waiting} of {len(sizes)} file(s) not begun")
    return total, "; ".join(doing)


def tried_again(fn: Callable[[], T], what: str) -> T:
    """``fn()`` (a read from the store, bounded by :func:`run`), tried again (up to
    :data:`.remote_reads.READ_TRIES` in all, after 1 s, then 2 s, and none begun once
    :func:`limit_s` has passed) when it fails for an error of the store that may pass (:func:`may_pass`: a 5xx, a
    reset, a timeout; not a missing object, a refusal, a checksum mismatch or a stall), a
    warning naming ``what`` each time: an error burst longer than the client's own retries made
    the restore skip the newest checkpoint for an older one."""
    t0 = time.monotonic()
    for attempt in range(1, READ_TRIES + 1):
        try:
            return fn()
        except OSError as e:
            if not may_pass(e) or attempt == READ_TRIES or time.monotonic() - t0 > limit_s():
                raise
            wait = backoff_s(attempt, 1.0, jitter=False)
            log.warning(
                "%s failed (try %d of %d): %s: %s; trying again in %g s",
                what,
                attempt,
                READ_TRIES,
                type(e).__name__,
                url_text(str(e)),
                wait,
            )
            time.sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


def download(
    st: RemoteStore,
    entry: RemoteEntry,
    dirpath: str,
    url: str,
    who: str = "the restore",
    preemptible: bool = False,
) -> tuple[str, str]:
    """:func:`_download_once`, :func:`tried_again` when it fails for an error that may pass
    (``preemptible``: as :func:`run`'s; a :class:`RemoteWaitPreemptedError` is not tried
    again). Every try downloads into one staging folder: a try after one cut part-way (a
    reset, a 5xx burst) fetches only the files that did not arrive whole
    (:func:`.remote_download.download`); the folder is removed once this raises."""
    from .commit import STAGING_PREFIX

    staging = os.path.join(dirpath, f"{STAGING_PREFIX}{entry.name}-{uuid.uuid4().hex[:12]}")
    try:
        return tried_again(
            lambda: _download_once(st, entry, staging, url, who, preemptible), f"downloading {url}"
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _download_once(
    st: RemoteStore, entry: RemoteEntry, staging: str, url: str, who: str, preemptible: bool
) -> tuple[str, str]:
    """:meth:`RemoteStore.download` of ``entry`` (at ``url``) into ``staging``, given up once no
    byte has arrived for :func:`limit_s` (its staging folder's files and the store's blobs'
    temporary files not growing): :class:`RemoteUnavailableError` naming the files under way;
    ``preemptible``: a pending preemption request ends it at once (:func:`run`)."""
    from .blobs import TMP_PREFIX, store_dir
    from .remote_blobs import DIGESTING

    assert entry.manifest is not None
    sizes = {f.path: f.size for f in entry.manifest.files}
    dirpath, name = os.path.split(staging)

    def moved() -> tuple[int | None, str]:
        if staging in DIGESTING:
            return None, "reading a blob back to verify it"  # local work, as below
        if _arrived(staging, sizes):
            return None, "every byte arrived; verifying the checksums"  # local work
        files, doing = on_disk(dirpath, name, sizes)
        blobs, _ = on_disk(store_dir(dirpath), TMP_PREFIX, {})
        return files + blobs, doing

    return run(
        lambda: st.download(entry, dirpath, progress=None, staging=staging),
        f"downloading {url}",
        moved,
        who,
        preemptible,
    )


def _arrived(staging: str, sizes: dict[str, int]) -> bool:
    """Whether a download's files and then its manifest all arrived in ``staging``: what
    :meth:`RemoteStore.download` does next (fsync, verify every checksum) reads only the
    local disk, minutes for a large checkpoint with no byte from the store to show for it."""
    from .manifest import MANIFEST_NAME

    try:
        if os.path.getsize(os.path.join(staging, MANIFEST_NAME)) == 0:
            return False
        return all(os.path.getsize(os.path.join(staging, p)) >= n for p, n in sizes.items())
    except OSError:
        return False
