"""Whether a blob already on the remote store holds the bytes of the local blob of that name.

A blob's name is the xxh3-128 of its tensor's dtype, shape and bytes (plus the codec's
parameters), not of the stored bytes: the same name can hold other bytes of the same size (a
zstd of another version, or another run writing to the same URL, encoding the same tensor
differently; a blob damaged in place; a leftover of a write that filled the file only in
part). An upload that finds a blob of the right size there checks it before a manifest names
it, once per process (:class:`Verified`):

- cheaply where the store lists an MD5 (S3's ETag of a single-part object, or of a multipart
  one uploaded in parts of a size the ETag's part count allows, s3fs's 50 MiB by default;
  GCS's ``md5Hash``): the MD5 of the local blob is computed and compared;
- else, or where that MD5 does not match (an ETag is no MD5 under SSE-KMS), by reading the
  remote blob back and comparing its xxh3-64 with the local one's (the manifest's).

A verified blob is not checked again in this process while the store lists it with the same
fingerprint (ETag, MD5, modification time): a blob replaced meanwhile is checked again.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .blobs import BLOBS_DIR, blob_path
from .checksum import hasher_for
from .manifest import FileEntry
from .remote_objects import md5

if TYPE_CHECKING:
    from .remote import RemoteStore

PIECE = 8 << 20
PART_SIZES = (50 << 20, 8 << 20, 16 << 20, 5 << 20, 64 << 20, 100 << 20)  # multipart ETags


def fingerprint(info: Mapping[str, Any]) -> str:
    """What changes when the object is replaced: its ETag, MD5 or modification time."""
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "updated", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""


def _listed_md5(info: Mapping[str, Any]) -> tuple[str, int] | None:
    """``(md5 hex, parts)`` the listing gives (parts 0: an MD5 of the whole object)."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    head, _, parts = etag.partition("-")
    if len(head) == 32 and all(c in "0123456789abcdef" for c in head):
        if not parts:
            return head, 0
        if parts.isdigit():
            return head, int(parts)
    raw = info.get("md5Hash")  # GCS: base64
    if isinstance(raw, str) and raw:
        try:
            return base64.b64decode(raw).hex(), 0
        except ValueError:
            return None
    return None


def _multipart_etag(path: str, part: int) -> str:
    """The S3 multipart ETag of the file uploaded in parts of ``part`` bytes."""
    parts: list[bytes] = []
    h = hashlib.md5(usedforsecurity=False)
    filled = 0
    with open(path, "rb") as f:
        while chunk := f.read(min(PIECE, part - filled)):
            h.update(chunk)
            filled += len(chunk)
            if filled == part:
                parts.append(h.digest())
                h, filled = hashlib.md5(usedforsecurity=False), 0
    if filled:
        parts.append(h.digest())
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"


def _md5_matches(local: str, size: int, info: Mapping[str, Any]) -> bool:
    listed = _listed_md5(info)
    if listed is None:
        return False
    digest, n = listed
    try:
        if n == 0:
            return md5(local) == digest
        for part in PART_SIZES:
            if -(-size // part) == n and _multipart_etag(local, part) == f"{digest}-{n}":
                return True
    except OSError:  # the local blob unreadable: the read-back compares with the manifest
        pass
    return False


def _read_back_matches(store: RemoteStore, entry: FileEntry) -> bool:
    h = hasher_for(entry.xxh3_64)
    size = 0
    with store.fs.open(posixpath.join(store._path(BLOBS_DIR), entry.path), "rb") as f:
        while chunk := f.read(PIECE):
            h.update(chunk)
            size += len(chunk)
    return (size, h.hexdigest()) == (entry.size, entry.xxh3_64)


class Verified:
    """One process's memory of the remote blobs it has verified (or uploaded) for a store."""

    def __init__(self) -> None:
        # blob name -> (size, xxh3-64, fingerprint) of the bytes verified there
        self._ok: dict[str, tuple[int, str, str]] = {}
        self.read_back = 0  # blobs read back from the store (a count, for tests and logs)
        self.dead: set[str] = set()  # collection markers left by a killed collection
        # in-flight markers of uploads whose first listing showed a collection running (only
        # those settle before their commit: see remote_blob_put.settle)
        self.beside_collection: set[str] = set()

    def remember(self, entry: FileEntry, info: Mapping[str, Any]) -> None:
        self._ok[entry.path] = (entry.size, entry.xxh3_64, fingerprint(info))

    def differ(
        self,
        store: RemoteStore,
        local_dir: str,
        entries: list[FileEntry],
        infos: Mapping[str, Mapping[str, Any]],
    ) -> list[str]:
        """The names of ``entries`` (each on the store with its size; ``infos``: the store's
        listing) whose remote bytes are not the local blob's."""
        bad = []
        for e in entries:
            info = infos[e.path]
            if self._ok.get(e.path) == (e.size, e.xxh3_64, fingerprint(info)):
                continue
            if _md5_matches(blob_path(local_dir, e.path), e.size, info):
                self.remember(e, info)
                continue
            self.read_back += 1
            if _read_back_matches(store, e):
                self.remember(e, info)
            else:
                bad.append(e.path)
        return bad
