"""The blob store of the remote tier: ``<url>/blobs/<name>``, shared by the remote checkpoints
as the local store is by the local ones (see :mod:`.blobs`).

- Upload: a blob already there with its size is not uploaded again; the blobs go up before the
  checkpoint's files and its manifest (the commit point), so a committed remote checkpoint
  never names a missing blob. While an upload runs, an in-flight marker
  ``blobs/.inflight-<id>.json`` lists the blobs it relies on, so that a collection by another
  process writing to the same URL (another run) does not delete them; a marker older than
  :data:`INFLIGHT_TTL_S` was left by a crash and is ignored and removed.
- Collection (after the remote retention deleted checkpoints): the live set is every blob named
  by a committed remote manifest, plus those of fresh markers. A manifest that cannot be read
  stops the collection.
- Download: each blob into the local store (``<dir>/blobs``), through a temporary name,
  verified (size, xxh3-64) before it is renamed into place.

Which ranks call what: only the coordinator talks to the remote store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import time
import uuid
from typing import TYPE_CHECKING, Any

from .blobs import BLOBS_DIR, NAME_RE, TMP_PREFIX, blob_path, key_of, store_dir
from .commit import fsync_dir
from .errors import CheckpointCorruptError
from .manifest import Manifest
from .tensorfile import digest_file

if TYPE_CHECKING:
    from .remote import RemoteEntry, RemoteStore

log = logging.getLogger("resilient_callbacks")

INFLIGHT_PREFIX = ".inflight-"
INFLIGHT_TTL_S = 24 * 3600.0


def _dir(store: RemoteStore) -> str:
    return store._path(BLOBS_DIR)


def listing(store: RemoteStore) -> dict[str, int]:
    """Blob name -> size of every blob (and marker) under ``<url>/blobs``."""
    store.fs.invalidate_cache()
    try:
        found = store.fs.find(_dir(store), detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for path, info in found.items():
        if info.get("type") == "directory":
            continue
        out[posixpath.basename(path.rstrip("/"))] = int(info.get("size") or 0)
    return out


def upload(store: RemoteStore, local_dir: str, manifest: Manifest) -> str | None:
    """Put the blobs ``manifest`` refers to that the remote store lacks; return the in-flight
    marker to remove once the checkpoint is committed (None: the checkpoint has no blobs)."""
    if not manifest.blobs:
        return None
    marker = posixpath.join(_dir(store), f"{INFLIGHT_PREFIX}{uuid.uuid4().hex[:12]}.json")
    if store.is_local:
        store.fs.makedirs(_dir(store), exist_ok=True)
    body = {"created": time.time(), "blobs": sorted(b.path for b in manifest.blobs)}
    store.fs.pipe_file(marker, json.dumps(body).encode())
    try:
        have = listing(store)
        clash = [b.path for b in manifest.blobs if b.path in have and have[b.path] != b.size]
        if clash:  # never replace a blob remote checkpoints may name with other bytes
            raise OSError(
                f"{store.url}/{BLOBS_DIR} holds {', '.join(clash)} with another size than "
                f"{local_dir} has; not replacing it. Remove the remote checkpoints that name it "
                "or upload to another URL."
            )
        todo = [b for b in manifest.blobs if b.path not in have]
        if todo:
            store.fs.put(
                [blob_path(local_dir, b.path) for b in todo],
                [posixpath.join(_dir(store), b.path) for b in todo],
            )
            have = listing(store)
            for b in todo:
                if have.get(b.path) != b.size:
                    raise OSError(
                        f"{store.url}/{BLOBS_DIR}/{b.path}: {have.get(b.path)} bytes after "
                        f"upload, expected {b.size}"
                    )
            if store.is_local:
                store._fsync_local([posixpath.join(_dir(store), b.path) for b in todo])
    except BaseException:
        end_upload(store, marker)
        raise
    return marker


def end_upload(store: RemoteStore, marker: str | None) -> None:
    if marker is not None:
        with contextlib.suppress(Exception):
            store.fs.rm_file(marker)


def collect(store: RemoteStore, entries: list[RemoteEntry], dry_run: bool = False) -> list[str]:
    """Delete the remote blobs no committed remote checkpoint and no fresh in-flight marker
    names; ``entries``: a scan made after the deletions. Returns the names deleted (with
    ``dry_run``, those it would delete, deleting nothing)."""
    live: set[str] = set()
    for e in entries:
        if e.manifest is not None:
            live.update(b.path for b in e.manifest.blobs)
        elif e.problem and e.problem.startswith("unreadable manifest"):
            log.warning(
                "remote %s: not deleting unused blobs, the manifest of %s cannot be read",
                store.url,
                e.name,
            )
            return []
    names = listing(store)
    now = time.time()
    for name in names:
        if not name.startswith(INFLIGHT_PREFIX):
            continue
        path = posixpath.join(_dir(store), name)
        try:
            body: Any = json.loads(store.fs.cat_file(path))
            fresh = now - float(body["created"]) < INFLIGHT_TTL_S
            blobs = [str(b) for b in body["blobs"]]
        except Exception:  # torn or foreign: treat as stale
            fresh, blobs = False, []
        if fresh:
            live.update(blobs)
        elif not dry_run:
            with contextlib.suppress(Exception):
                store.fs.rm_file(path)
    doomed = sorted(n for n in names if NAME_RE.match(n) and n not in live)
    for name in [] if dry_run else doomed:
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm_file(posixpath.join(_dir(store), name))
    if doomed:
        log.info("remote: deleted %d unused blob(s) in %s/%s", len(doomed), store.url, BLOBS_DIR)
    return doomed


def download(store: RemoteStore, manifest: Manifest, local_root: str, staging: str) -> None:
    """Fetch the blobs ``manifest`` refers to into ``<local_root>/blobs``, each verified before
    it is renamed into place; one already there and intact is not fetched again. Where the
    local store holds a different file of that name (another compression of the same tensor,
    which local checkpoints may name), the blob goes into the checkpoint's own
    ``<staging>/blobs`` instead: a local blob is never replaced."""
    if not manifest.blobs:
        return
    shared = store_dir(local_root)
    fetched: set[str] = set()
    for b in manifest.blobs:
        target = shared
        dest = os.path.join(target, b.path)
        if os.path.exists(dest):
            d = digest_file(dest, like=b.xxh3_64)
            if (d.size, d.xxh3_64) == (b.size, b.xxh3_64):
                continue
            target = store_dir(staging)
            dest = os.path.join(target, b.path)
        os.makedirs(target, exist_ok=True)
        tmp = os.path.join(target, f"{TMP_PREFIX}{key_of(b.path)}-{uuid.uuid4().hex[:8]}")
        try:
            store.fs.get(posixpath.join(_dir(store), b.path), tmp)
            d = digest_file(tmp, like=b.xxh3_64)
            if (d.size, d.xxh3_64) != (b.size, b.xxh3_64):
                raise CheckpointCorruptError(
                    f"{store.url}/{BLOBS_DIR}/{b.path}: downloaded {d.size} bytes with xxh3_64 "
                    f"{d.xxh3_64}, the manifest says {b.size} bytes, {b.xxh3_64}"
                )
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.rename(tmp, dest)
            fetched.add(target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    for target in fetched:
        fsync_dir(target)
