"""The blob store of the remote tier: ``<url>/blobs/<name>``, shared by the remote checkpoints
as the local store is by the local ones (see :mod:`.blobs`).

- Upload: a blob already there with its size is not uploaded again; the blobs go up before the
  checkpoint's files and its manifest (the commit point), so a committed remote checkpoint
  never names a missing blob. While an upload runs, an in-flight marker
  ``blobs/.inflight-<id>.json`` lists the blobs it relies on (and the run), so that a
  collection by another process writing to the same URL (another run) does not delete them; a
  marker older than :data:`INFLIGHT_TTL_S` was left by a crash and is ignored and removed.
- A blob of the same name with another size is never replaced while a committed remote
  checkpoint or another run's fresh marker names it. Otherwise it is what a killed upload left
  (a torn copy: an earlier process of this run, the only one uploading the run) and is
  uploaded again. On a ``file://`` remote each blob is copied to a temporary name and renamed
  into place, so a kill leaves no torn blob there (an object store's put is atomic already).
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
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from .blobs import BLOBS_DIR, NAME_RE, TMP_PREFIX, blob_path, key_of, store_dir
from .catalog import verify_entries
from .commit import fsync_dir
from .errors import CheckpointCorruptError
from .manifest import Manifest
from .tensorfile import digest_file

if TYPE_CHECKING:
    from .remote import RemoteEntry, RemoteStore

log = logging.getLogger("resilient_callbacks")

INFLIGHT_PREFIX = ".inflight-"
INFLIGHT_TTL_S = 24 * 3600.0
UPLOAD_PREFIX = ".upload-"  # a blob being copied to a file:// remote, renamed when complete


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


def upload(
    store: RemoteStore, local_dir: str, manifest: Manifest, again: Collection[str] = ()
) -> str | None:
    """Put the blobs ``manifest`` refers to that the remote store lacks (and those named in
    ``again``, found rotten there); return the in-flight marker to remove once the checkpoint
    is committed (None: the checkpoint has no blobs)."""
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
        have = listing(store)
        clash = [b.path for b in manifest.blobs if b.path in have and have[b.path] != b.size]
        if clash:
            _check_torn(store, clash, have, manifest.run_id, marker, local_dir)
        todo = [b for b in manifest.blobs if have.get(b.path) != b.size or b.path in again]
        if todo:
            verify_entries(local_dir, todo)  # a rotten local blob is never uploaded
            _put(store, [blob_path(local_dir, b.path) for b in todo], [b.path for b in todo])
            have = listing(store)
            for b in todo:
                if have.get(b.path) != b.size:
                    raise OSError(
                        f"{store.url}/{BLOBS_DIR}/{b.path}: {have.get(b.path)} bytes after "
                        f"upload, expected {b.size}"
                    )
    except BaseException:
        end_upload(store, marker)
        raise
    return marker


def _check_torn(
    store: RemoteStore,
    clash: list[str],
    have: dict[str, int],
    run_id: str,
    marker: str,
    local_dir: str,
) -> None:
    """Blobs of the names ``clash`` are on the remote (sizes ``have``) with another size than
    the local ones: raise unless none of them is held by a committed remote checkpoint (one
    whose manifest lists it with the size it has there: another writer's valid bytes of that
    name) or by another run's fresh in-flight marker; then they are torn copies (a killed
    upload of this run left them, or damage that every checkpoint naming them shares)."""
    named: set[str] = set()
    for e in store.scan():
        if e.manifest is not None:
            named.update(b.path for b in e.manifest.blobs if have.get(b.path) == b.size)
    mine = posixpath.basename(marker)
    for name, (fresh, blobs, owner) in _markers(store).items():
        if fresh and name != mine and owner != run_id:
            named.update(blobs)
    held = [c for c in clash if c in named]
    if held:  # never replace a blob remote checkpoints may name with other bytes
        raise OSError(
            f"{store.url}/{BLOBS_DIR} holds {', '.join(held)} with another size than "
            f"{local_dir} has, named by a remote checkpoint or another run's upload; not "
            "replacing it. Remove the remote checkpoints that name it or upload to another URL."
        )
    log.warning(
        "remote %s: %s %s another size than the local copy and no remote checkpoint holds "
        "it at that size (an upload killed part-way left it, or it was damaged); uploading it "
        "again",
        store.url,
        ", ".join(f"{BLOBS_DIR}/{c}" for c in clash),
        "has" if len(clash) == 1 else "have",
    )


def _put(store: RemoteStore, local: list[str], names: list[str]) -> None:
    """Upload blobs; on a ``file://`` remote through temporary names renamed into place (and
    fsynced), so that a kill part-way never leaves a torn blob under a blob's name."""
    final = [posixpath.join(_dir(store), n) for n in names]
    if not store.is_local:
        store.fs.put(local, final)  # one object each: complete or absent
        return
    tag = uuid.uuid4().hex[:8]
    tmp = [posixpath.join(_dir(store), f"{UPLOAD_PREFIX}{tag}-{n}") for n in names]
    try:
        store.fs.put(local, tmp)
        store._fsync_local(tmp)
        for t, f in zip(tmp, final, strict=True):
            os.replace(t, f)
        fsync_dir(_dir(store))
    finally:
        for t in tmp:
            with contextlib.suppress(OSError):
                os.unlink(t)


def _markers(store: RemoteStore) -> dict[str, tuple[bool, list[str], str | None]]:
    """Every in-flight marker: name -> (fresh, the blobs it names, its run or None)."""
    now, out = time.time(), {}
    for name in listing(store):
        if not name.startswith(INFLIGHT_PREFIX):
            continue
        try:
            body: Any = json.loads(store.fs.cat_file(posixpath.join(_dir(store), name)))
            fresh = now - float(body["created"]) < INFLIGHT_TTL_S
            blobs, run = [str(b) for b in body["blobs"]], body.get("run_id")
        except Exception:  # torn or foreign: treat as stale
            fresh, blobs, run = False, [], None
        out[name] = (fresh, blobs, None if run is None else str(run))
    return out


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
    for name, (fresh, blobs, _) in _markers(store).items():
        if fresh:
            live.update(blobs)
        elif not dry_run:
            with contextlib.suppress(Exception):
                store.fs.rm_file(posixpath.join(_dir(store), name))
    doomed = sorted(n for n in names if NAME_RE.match(n) and n not in live)
    if store.is_local:  # copies a kill left under their temporary names, a day old
        doomed += [n for n in names if n.startswith(UPLOAD_PREFIX) and _stale(store, n)]
    for name in [] if dry_run else doomed:
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm_file(posixpath.join(_dir(store), name))
    if doomed:
        log.info("remote: deleted %d unused blob(s) in %s/%s", len(doomed), store.url, BLOBS_DIR)
    return doomed


def _stale(store: RemoteStore, name: str) -> bool:
    try:
        age = time.time() - os.path.getmtime(posixpath.join(_dir(store), name))
    except OSError:
        return False
    return age > INFLIGHT_TTL_S


def download(store: RemoteStore, manifest: Manifest, local_root: str, staging: str) -> None:
    """Fetch the blobs ``manifest`` refers to into ``<local_root>/blobs``, each verified before
    it is renamed into place; one already there and intact is not fetched again. Where the
    local store holds a different file of that name (another compression of the same tensor,
    which local checkpoints may name), the blob goes into the checkpoint's own
    ``<staging>/blobs`` instead: a local blob that a local manifest records is never
    replaced. One that no local manifest records with its size and checksum (damaged, so
    every local checkpoint naming it is corrupt, or a crash's leftover) is replaced by the
    verified copy: that repairs those local checkpoints where the bytes are the same."""
    if not manifest.blobs:
        return
    shared = store_dir(local_root)
    fetched: set[str] = set()
    recorded: dict[str, set[tuple[int, str]]] | None = None
    for b in manifest.blobs:
        target = shared
        dest = os.path.join(target, b.path)
        if os.path.exists(dest):
            d = digest_file(dest, like=b.xxh3_64)
            if (d.size, d.xxh3_64) == (b.size, b.xxh3_64):
                continue
            if recorded is None:
                recorded = _recorded(local_root)
            if (d.size, d.xxh3_64) in recorded.get(b.path, ()):
                target = store_dir(staging)  # another checkpoint's whole copy: kept
                dest = os.path.join(target, b.path)
            else:  # damaged (or a leftover): the verified copy repairs the store
                log.warning("%s is damaged or unknown; replacing it with a verified copy", dest)
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


def _recorded(local_root: str) -> dict[str, set[tuple[int, str]]]:
    """blob name -> the (size, xxh3-64) the committed local manifests record for it."""
    from .catalog import Depth, scan

    out: dict[str, set[tuple[int, str]]] = {}
    for e in scan(local_root, Depth.NONE):
        for b in e.manifest.blobs if e.manifest is not None else ():
            out.setdefault(b.path, set()).add((b.size, b.xxh3_64))
    return out
