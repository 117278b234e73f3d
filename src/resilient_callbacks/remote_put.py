"""Putting an upload's files (a checkpoint's, its blobs, a node's part) into the remote store:
every byte counted as it moves, and the writer's fence checked between files.

- A local store (``file://``): fsspec's local ``put_file`` calls no progress callback, so a
  copy counted no byte until the whole put ended, and ``close()`` gave up on a healthy copy
  longer than the outage limit (5 minutes: a large checkpoint onto a slow network mount). The
  files are copied here, in chunks of :data:`CHUNK`, each counted once written.
- An object store: fsspec's ``put``, its bytes counted as the store's client reports them. s3fs
  reports a file under twice its part size (50 MiB) only when it ends and a larger one per
  part, many at once (:func:`in_flight`): on a slow link a healthy upload moves no counted byte
  for longer than the outage limit. The progress is told, for the put alone
  (:meth:`.Progress.putting`), how many bytes may move before a count: the stall is judged
  after the time they take at :data:`.progress.SLOWEST_LINK_BPS`, at most
  :data:`.progress.MAX_ALLOWANCE_S`, if that is longer than the outage limit.
- The fence (:func:`.upload_thread.not_superseded`): as each file's put begins, and at each
  count of its bytes on an object store, the upload thread checks that the next writer of the
  store has not taken it over (it gave up waiting for this thread). One taken over stops with
  :class:`~.errors.RemoteUnavailableError` (fsspec cancels its other puts under way, s3fs
  aborts a multipart upload it was in) instead of putting the rest of a checkpoint's blobs and
  files for as long as they take. A membership test in this process: no request.

Which ranks call what: the thread that uploads (the coordinator's; a node leader's).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .progress import files_callback
from .upload_thread import not_superseded

if TYPE_CHECKING:
    from .progress import Progress
    from .remote import RemoteStore

__all__ = ["CHUNK", "in_flight", "put"]

CHUNK = 8 << 20  # a copy into a local store counts its bytes this often
S3_PART = 50 << 20  # s3fs's part size (its default), where s3fs does not say it
S3_MAX_PARTS = 10_000
BATCH = 128  # files fsspec puts at once, where fsspec does not say it
POOL = 10  # botocore's connection pool (its default max_pool_connections): requests at once


def put(
    store: RemoteStore, local: Sequence[str], remote: Sequence[str], progress: Progress | None
) -> None:
    """Put each file ``local[i]`` at ``remote[i]`` in ``store``, its bytes counted in
    ``progress``; :class:`~.errors.RemoteUnavailableError` once the next writer of the store
    took this upload thread over (checked before each file, and at each count on an object
    store). A local store's parent folders must exist."""
    with contextlib.ExitStack() as stack:
        if store.is_local:
            if progress is not None:
                stack.enter_context(progress.putting())  # (counted every CHUNK)
            buf = bytearray(CHUNK)
            for src, dst in zip(local, remote, strict=True):
                not_superseded(store.url)
                _copy(src, dst, memoryview(buf), progress)
            return
        if progress is not None:  # (its allowance ends with the put: not its settle, commit)
            sizes = [os.path.getsize(p) for p in local]
            stack.enter_context(progress.putting(in_flight(store.fs, sizes)))
        thread = threading.current_thread()  # (the fence is the upload thread's)
        fenced = files_callback(progress, check=lambda: not_superseded(store.url, thread))
        store.fs.put(list(local), list(remote), callback=fenced)


def _source(path: str) -> io.RawIOBase:
    """The file a copy into a local store reads (unbuffered: :func:`_copy` reads it in chunks
    into its own buffer)."""
    return open(path, "rb", buffering=0)


def _copy(src: str, dst: str, buf: memoryview, progress: Progress | None) -> None:
    with _source(src) as f, open(dst, "wb") as out:
        while n := f.readinto(buf):
            out.write(buf[:n])
            if progress is not None:
                progress.update(n)


def in_flight(fs: Any, sizes: Sequence[int]) -> int:
    """The most bytes a ``put`` of files of ``sizes`` into ``fs`` may move before its client
    counts one. s3fs: a file under twice its part size (50 MiB) is one request, counted when
    it ends; a larger one goes in requests of one part each, up to ``max_concurrency`` (10)
    of that file at once, each counted when it ends; up to ``batch_size`` files go at once
    (fsspec's default: an eighth of the open-file limit), but their requests share botocore's
    connection pool (``config_kwargs["max_pool_connections"]``, 10): the bytes of the largest
    requests that can be open at once. On a slow link shared by them, a count comes at the
    latest once all of those have moved. Other stores: 0 (the most bytes one of their counts
    carried tells: :attr:`.Progress.unit`)."""
    if not type(fs).__module__.startswith("s3fs"):
        return 0
    at_once = max(1, int(getattr(fs, "max_concurrency", 1) or 1))
    per_file = []
    for size in sizes:
        part = _part_size(size)
        if size < min(5 << 30, 2 * part):
            per_file.append([size])
            continue
        parts = math.ceil(size / part)  # (sent in order, at_once at a time)
        per_file.append(([part] * (parts - 1) + [size - part * (parts - 1)])[:at_once])
    files = int(getattr(fs, "batch_size", None) or _batch_size())
    if files < 1:  # (-1: all at once)
        files = len(per_file)
    per_file.sort(key=sum, reverse=True)
    requests = sorted((r for f in per_file[:files] for r in f), reverse=True)
    return sum(requests[: _connections(fs)])


def _connections(fs: Any) -> int:
    """The requests an s3fs ``fs`` has open at once: its botocore connection pool's size."""
    kwargs = getattr(fs, "config_kwargs", None)
    n = kwargs.get("max_pool_connections") if isinstance(kwargs, dict) else None
    return max(1, int(n or POOL))


def _part_size(size: int) -> int:
    try:
        from s3fs.core import calculate_chunksize

        return int(calculate_chunksize(size))
    except (ImportError, TypeError):  # (another s3fs version)
        return max(S3_PART, math.ceil(size / S3_MAX_PARTS))


def _batch_size() -> int:
    try:
        from fsspec.asyn import _get_batch_size

        return int(_get_batch_size())
    except (ImportError, TypeError):  # (another fsspec version)
        return BATCH
