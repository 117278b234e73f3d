"""Putting an upload's files (a checkpoint's, its blobs, a node's part) into the remote store:
every byte counted as it moves, and the writer's fence checked between files.

- A local store (``file://``): fsspec's local ``put_file`` calls no progress callback, so a
  copy counted no byte until the whole put ended, and ``close()`` gave up on a healthy copy
  longer than the outage limit (5 minutes: a large checkpoint onto a slow network mount). The
  files are copied here, in chunks of :data:`CHUNK`, each counted once written.
- An object store: fsspec's ``put``, its bytes counted as the store's client reports them.
- The fence (:func:`.upload_thread.not_superseded`): as each file's put begins, and at each
  count of its bytes on an object store, the upload thread checks that the next writer of the
  store has not taken it over (it gave up waiting for this thread). One taken over stops with
  :class:`~.errors.RemoteUnavailableError` (fsspec cancels its other puts under way, s3fs
  aborts a multipart upload it was in) instead of putting the rest of a checkpoint's blobs and
  files for as long as they take. A membership test in this process: no request.

Which ranks call what: the thread that uploads (the coordinator's; a node leader's).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fsspec.callbacks import Callback

from .upload_thread import not_superseded

if TYPE_CHECKING:
    from .progress import Progress
    from .remote import RemoteStore

__all__ = ["CHUNK", "put"]

CHUNK = 8 << 20  # a copy into a local store counts its bytes this often


def put(
    store: RemoteStore, local: Sequence[str], remote: Sequence[str], progress: Progress | None
) -> None:
    """Put each file ``local[i]`` at ``remote[i]`` in ``store``, its bytes counted in
    ``progress``; :class:`~.errors.RemoteUnavailableError` once the next writer of the store
    took this upload thread over (checked before each file, and at each count on an object
    store). A local store's parent folders must exist."""
    if store.is_local:
        buf = bytearray(CHUNK)
        for src, dst in zip(local, remote, strict=True):
            not_superseded(store.url)
            _copy(src, dst, memoryview(buf), progress)
        return
    fenced = _Fenced(store.url, threading.current_thread(), progress)
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


class _Fenced(Callback):
    """fsspec's callback of a multi-file ``put`` (the parent) and of each file's (a child,
    :meth:`branched`): each file's put checks the fence of ``thread`` (the upload thread; these
    may run in fsspec's event loop) as it begins, and a child at each count of its bytes, which
    it adds to ``progress``. The parent's counts are files done, not bytes."""

    def __init__(
        self, url: str, thread: threading.Thread, progress: Progress | None, child: bool = False
    ) -> None:
        super().__init__()
        self._url, self._thread, self._progress, self._child = url, thread, progress, child
        self._seen = 0

    def relative_update(self, inc: int = 1) -> None:
        if self._child:
            if self._progress is not None:
                self._progress.update(inc)
            not_superseded(self._url, self._thread)

    def absolute_update(self, value: int) -> None:
        inc, self._seen = value - self._seen, value
        self.relative_update(inc)

    def set_size(self, size: int) -> None:
        pass

    def branched(self, path_1: Any, path_2: Any, **kwargs: Any) -> Callback:
        not_superseded(self._url, self._thread)
        return _Fenced(self._url, self._thread, self._progress, child=True)
