"""A remote store's objects and names: when an object was last modified (from a listing), the
MD5 that a single-part object's ETag is (the upload's check), and which remote name a commit
may take when another run writes to the same URL."""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from .manifest import Manifest


def modified_time(info: Mapping[str, Any]) -> float | None:
    """An object's modification time from an fsspec listing (local: ``mtime``; S3:
    ``LastModified``; GCS: ``updated``), as a POSIX time; None if the listing has none."""
    for key in ("mtime", "LastModified", "updated", "last_modified"):
        t = info.get(key)
        if isinstance(t, (int, float)):
            return float(t)
        if isinstance(t, datetime.datetime):
            return t.timestamp()
        if isinstance(t, str) and t:
            try:
                return datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def md5(path: str) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# MD5-compare single-part objects up to this size (bigger ones: the store validates the CRC32
# checksum botocore sends with every PUT and part)
ETAG_CHECK_MAX = 8 << 20


def check_uploaded(info: Mapping[str, Any], where: str, size: int, local_path: str) -> None:
    """An object just uploaded from ``local_path`` (``info``: the store's listing of it, at
    ``where``) has the local file's size and, single-part up to :data:`ETAG_CHECK_MAX`, its
    MD5 as ETag; else :class:`OSError` naming it."""
    if int(info.get("size") or 0) != size:
        raise OSError(f"{where}: {info.get('size')} bytes after upload, expected {size}")
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    if etag and "-" not in etag and len(etag) == 32 and size <= ETAG_CHECK_MAX:
        digest = md5(local_path)
        if digest != etag:
            raise OSError(f"{where}: ETag {etag} does not match the local MD5 {digest}")


class RemoteNameTaken(FileExistsError):
    """:meth:`RemoteStore.upload`: ``name`` is a committed remote checkpoint of another commit
    (``key``: its run id and commit number), which the upload leaves alone."""

    def __init__(self, name: str, key: tuple[str, int]) -> None:
        super().__init__(f"{name} is another commit's remote checkpoint (run {key[0]})")
        self.name, self.key = name, key


def key_of(raw: bytes) -> tuple[str, int] | None:
    """The (run id, commit number) of a manifest's bytes; None if they cannot be read."""
    try:
        m = Manifest.from_json(json.loads(raw), "")
    except Exception:
        return None
    return (m.run_id, m.seq)


def free_name(name: str, key: tuple[str, int], taken: Mapping[str, tuple[str, int]]) -> str:
    """``name``, unless ``taken`` (remote name -> the commit it holds) gives it to another
    commit than ``key`` (another run writing to the same URL): then ``name-rN``."""
    candidate, n = name, 0
    while candidate in taken and taken[candidate] != key:
        n += 1
        candidate = f"{name}-r{n}"
    return candidate
