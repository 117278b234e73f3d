"""Download of the remote tier's blobs (moved from :mod:`.remote_blobs`, which re-exports
:func:`download` and :data:`DIGESTING`): each blob into the local store (``<dir>/blobs``),
through a temporary name, verified (size, xxh3-64) before it is renamed into place.

Which ranks call what: only the coordinator (or a node's leader) reads the remote store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import uuid
from typing import TYPE_CHECKING, Any

from .blobs import BLOBS_DIR, TMP_PREFIX, key_of, store_dir
from .commit import ensure_dir, fsync_dir
from .errors import CheckpointCorruptError
from .filewrite import digest_file
from .manifest import Manifest

if TYPE_CHECKING:
    from .remote import RemoteStore

__all__ = ["DIGESTING", "download"]

log = logging.getLogger("resilient_callbacks")
DIGESTING: set[str] = set()  # the stagings whose download reads a blob back (stall.download)


def _dir(store: RemoteStore) -> str:
    return store._path(BLOBS_DIR)


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
            d = _digest(staging, dest, b.xxh3_64)
            if (d.size, d.xxh3_64) == (b.size, b.xxh3_64):
                continue
            if recorded is None:
                recorded = _recorded(local_root)
            if (d.size, d.xxh3_64) in recorded.get(b.path, ()):
                target = store_dir(staging)  # another checkpoint's whole copy: kept
                dest = os.path.join(target, b.path)
            else:  # damaged (or a leftover): the verified copy repairs the store
                log.warning("%s is damaged or unknown; replacing it with a verified copy", dest)
        ensure_dir(target)  # (created: its name durable, as the blobs in it)
        tmp = os.path.join(target, f"{TMP_PREFIX}{key_of(b.path)}-{uuid.uuid4().hex[:8]}")
        try:
            store.fs.get([posixpath.join(_dir(store), b.path)], [tmp])  # (lists: no glob)
            d = _digest(staging, tmp, b.xxh3_64)
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


def _digest(staging: str, path: str, like: str) -> Any:
    """``digest_file``, ``staging`` in :data:`DIGESTING` meanwhile: reading a blob back is local
    work (minutes for a large one on a slow disk), not a store that stalls."""
    DIGESTING.add(staging)
    try:
        return digest_file(path, like=like)
    finally:
        DIGESTING.discard(staging)


def _recorded(local_root: str) -> dict[str, set[tuple[int, str]]]:
    """blob name -> the (size, xxh3-64) the committed local manifests record for it."""
    from .catalog import Depth, scan

    out: dict[str, set[tuple[int, str]]] = {}
    for e in scan(local_root, Depth.NONE):
        for b in e.manifest.blobs if e.manifest is not None else ():
            out.setdefault(b.path, set()).add((b.size, b.xxh3_64))
    return out
