"""The upload side of the remote blob store (:mod:`.remote_blobs`: its layout, listing and
collection): :func:`upload` puts the blobs a checkpoint refers to that the store lacks, under an
in-flight marker, before the checkpoint's files and its manifest; :func:`settle`, before the
commit, waits for a collection by another process announced before and uploads again what it
deleted. Moved from ``remote_blobs.py`` (see its docstring for the rules both follow).

Which ranks call what: only the coordinator talks to the remote store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import socket
import time
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from . import remote_blobs, remote_put
from .blobs import BLOBS_DIR, blob_path
from .catalog import verify_entries
from .commit import fsync_dir
from .manifest import FileEntry, Manifest
from .remote_blob_clash import check_other_bytes, check_torn
from .remote_blobs import (
    COLLECT_PREFIX,
    INFLIGHT_PREFIX,
    LIST_PAGE,
    UPLOAD_PREFIX,
    _dir,
    _infos,
    end_upload,
)
from .remote_objects import modified_time

if TYPE_CHECKING:
    from .progress import Progress
    from .remote import RemoteStore

log = logging.getLogger("resilient_callbacks")


def upload(
    store: RemoteStore,
    local_dir: str,
    manifest: Manifest,
    again: Collection[str] = (),
    progress: Progress | None = None,
) -> str | None:
    """Put the blobs ``manifest`` refers to that the remote store lacks (and those named in
    ``again``, found rotten there), their bytes counted in ``progress`` (its total grown by
    them: before, none counted, and an upload of mostly blobs read as a stalled store); return
    the in-flight marker to remove once the checkpoint is committed (None: no blobs)."""
    if not manifest.blobs:
        return None
    marker = posixpath.join(_dir(store), f"{INFLIGHT_PREFIX}{uuid.uuid4().hex[:12]}.json")
    if store.is_local:
        store.fs.makedirs(_dir(store), exist_ok=True)
    body = {
        "created": time.time(),
        "blobs": sorted(b.path for b in manifest.blobs),
        "run_id": manifest.run_id,
    }
    store.fs.pipe_file(marker, json.dumps(body).encode())
    try:
        infos = _infos(store)
        if any(n.startswith(COLLECT_PREFIX) for n in infos):  # (see settle)
            store.blobs_verified.beside_collection.add(marker)
        have = {n: int(i.get("size") or 0) for n, i in infos.items()}
        clash = [b.path for b in manifest.blobs if b.path in have and have[b.path] != b.size]
        if clash:
            check_torn(store, clash, have, manifest.run_id, marker, local_dir)
        reuse = [b for b in manifest.blobs if have.get(b.path) == b.size and b.path not in again]
        other = store.blobs_verified.differ(store, local_dir, reuse, infos)
        if other:
            check_other_bytes(store, other, manifest, marker, local_dir)
        reused = {b.path for b in reuse}
        todo = [b for b in manifest.blobs if b.path not in reused or b.path in other]
        if todo:
            verify_entries(local_dir, todo)  # a rotten local blob is never uploaded
            if progress is not None:
                progress.expect(sum(b.size for b in todo))
            _put_checked(store, local_dir, todo, len(infos), progress)
    except BaseException:
        end_upload(store, marker)
        raise
    return marker


def _put_checked(
    store: RemoteStore,
    local_dir: str,
    todo: list[FileEntry],
    listed: int,
    progress: Progress | None = None,
) -> None:
    """Upload the blobs ``todo`` and check their sizes there; remembered as verified. Only
    those blobs are asked for: by a request each (HEAD), or by one listing of ``blobs/``
    (``listed``: the names the upload's listing held; a listing request answers 1000) where
    that sends fewer requests (every blob was listed after each upload, a few put or not)."""
    _put(store, [blob_path(local_dir, b.path) for b in todo], [b.path for b in todo], progress)
    if len(todo) <= -(-(listed + len(todo)) // LIST_PAGE):
        infos = {}
        for b in todo:
            path = posixpath.join(_dir(store), b.path)
            store.fs.invalidate_cache(path)
            with contextlib.suppress(FileNotFoundError):
                infos[b.path] = store.fs.info(path)
    else:
        infos = _infos(store)
    for b in todo:
        size = int(infos[b.path].get("size") or 0) if b.path in infos else None
        if size != b.size:
            raise OSError(
                f"{store.url}/{BLOBS_DIR}/{b.path}: {size} bytes after upload, expected {b.size}"
            )
        store.blobs_verified.remember(b, infos[b.path])


def _put(
    store: RemoteStore, local: list[str], names: list[str], progress: Progress | None = None
) -> None:
    """Upload blobs (their bytes counted in ``progress``; the writer's fence checked before
    each: :mod:`.remote_put`); on a ``file://`` remote through temporary names renamed into
    place (and fsynced), so that a kill part-way never leaves a torn blob under a blob's name."""
    final = [posixpath.join(_dir(store), n) for n in names]
    if not store.is_local:
        remote_put.put(store, local, final, progress)  # one object each: whole or absent
        return
    tag = uuid.uuid4().hex[:8]
    tmp = [posixpath.join(_dir(store), f"{UPLOAD_PREFIX}{tag}-{n}") for n in names]
    try:
        remote_put.put(store, local, tmp, progress)  # (counted as it is copied)
        store._fsync_local(tmp)
        for t, f in zip(tmp, final, strict=True):
            os.replace(t, f)
        fsync_dir(_dir(store))
    finally:
        for t in tmp:
            with contextlib.suppress(OSError):
                os.unlink(t)


def settle(store: RemoteStore, local_dir: str, manifest: Manifest, marker: str | None) -> None:
    """Before the commit of an upload (its files are up, its in-flight marker still there):
    wait until no collection by another process (another run given the same URL) that was
    announced before is running, then check that every blob the manifest names is there with
    its size. A collection that read the in-flight markers before this upload wrote its own
    may have deleted a blob the upload found there and relied on: it is uploaded again,
    loudly, before the manifest names it (a collection announced later sees the marker).

    A collection marker is waited for at most :data:`COLLECT_MAX_S` + :data:`COLLECT_MARGIN_S`
    from its first sight, then removed (a kill left it). One the store lists as written longer
    than that before this upload's own marker (the store's clock, both), or written by a
    process of this host that has exited (its host and pid are in it), is removed at once: a
    run killed mid-collection does not hold up its next run's first upload.

    Where the upload's first listing of the blobs (after its marker was written) showed no
    collection marker, nothing is listed again (one listing of every blob per upload less):
    a collection that read the markers before this upload's was announced before that too,
    so it had either ended, its deletions in that listing, or was listed running (one that
    sent a delete without getting an answer, which may land later, leaves its marker:
    :func:`.remote_blobs.collect`)."""
    if marker is None:
        return
    if marker not in store.blobs_verified.beside_collection:
        return
    store.blobs_verified.beside_collection.discard(marker)
    first_seen: dict[str, float] = {}
    bound = remote_blobs.COLLECT_MAX_S + remote_blobs.COLLECT_MARGIN_S
    while True:
        infos = _infos(store)
        now = time.monotonic()
        mine = modified_time(infos.get(posixpath.basename(marker)) or {})
        running = []
        for name in infos:
            if name.startswith(COLLECT_PREFIX) and name not in store.blobs_verified.dead:
                announced = modified_time(infos[name])
                # announced longer than its time bound before this upload's marker was
                # written (the store's clock, both): it deleted nothing this upload found
                over = mine is not None and announced is not None and mine - announced > bound
                if over or (name not in first_seen and _exited(store, name)):
                    first_seen[name] = now - bound  # its writer is gone: dead now
                if now - first_seen.setdefault(name, now) < bound:
                    running.append(name)
                else:  # a collection killed part-way: it deletes nothing any more
                    store.blobs_verified.dead.add(name)
                    end_upload(store, posixpath.join(_dir(store), name))
        if not running:
            break
        time.sleep(remote_blobs.COLLECT_POLL_S)
    gone = [b for b in manifest.blobs if int((infos.get(b.path) or {}).get("size") or -1) != b.size]
    if not gone:
        return
    log.warning(
        "remote %s: %s, which this upload found there and relied on, %s deleted meanwhile by "
        "another process writing to this URL (another run given the same remote URL?); "
        "uploading %s again. Give each run a remote URL of its own.",
        store.url,
        ", ".join(f"{BLOBS_DIR}/{b.path}" for b in gone),
        "was" if len(gone) == 1 else "were",
        "it" if len(gone) == 1 else "them",
    )
    verify_entries(local_dir, gone)
    _put_checked(store, local_dir, gone, len(infos))


def _exited(store: RemoteStore, name: str) -> bool:
    """Whether the collection marker ``name`` was written by a process of this host that has
    exited (a run killed mid-collection, restarted at once on the same node)."""
    try:
        body: Any = json.loads(store.fs.cat_file(posixpath.join(_dir(store), name)))
        pid = int(body["pid"])  # (none in one left for a delete that may land: _leave)
        if body.get("host") != socket.gethostname() or pid == os.getpid():
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except Exception:  # gone meanwhile, another host's, an older format, another user's
        return False
    return False
