"""A remote store's objects: when an object was last modified (from a listing), the MD5 that a
single-part object's ETag is (the upload's check), the commit number a listing's manifests give
(:func:`seq_floor`), the object store's commit strategy (:class:`ManifestLastCommit`: manifest
last), and what to check when the store fails the preflight. Which remote name a commit may take
is :mod:`.remote_claims`'s; which remote checkpoints are a process's own, :mod:`.remote_owned`'s.

Which ranks call what: whichever process lists, uploads to or commits on the store (the commit
strategy: the one process that uploads); nothing here is collective."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .manifest import MANIFEST_NAME, Manifest
from .remote_manifest import put_manifest

if TYPE_CHECKING:
    from .remote import RemoteEntry, RemoteStore

log = logging.getLogger("resilient_callbacks")


def preflight_advice(e: BaseException, is_local: bool) -> str:
    """What to check when the preflight's write, read or delete of a probe object raised
    ``e``. A keyword the filesystem does not take (``remote_options={"endpoint": ...}``)
    reaches it only at the first request, as a ``TypeError``: that is the option, not the
    bucket or the credentials (which the message said)."""
    if isinstance(e, TypeError) and "unexpected keyword argument" in str(e):
        return (
            "A key of remote_options is not an option of this URL's filesystem (fsspec passes "
            "them on unchanged): check its spelling in that filesystem's documentation (s3fs: "
            "key, secret, token, endpoint_url, client_kwargs, config_kwargs, ...)"
        )
    if is_local:
        return "Check that the path is a writable directory on a mounted filesystem"
    return "Check the bucket name, the endpoint and the credentials"


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


def raw_seq(raw: bytes) -> int | None:
    """The ``seq`` of a manifest's bytes read as plain JSON, without validating the rest (one of
    a newer format this version refuses); None if they give none."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    seq = data.get("seq") if isinstance(data, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else None


def seq_floor(url: str, entries: Sequence[RemoteEntry]) -> int:
    """The highest commit number that ``entries`` (a listing of ``url``) show: their manifests',
    and the one a manifest this version refuses still gives (a newer format). One whose number
    cannot be read (damaged, or the store did not answer) is named in a warning: commits made
    now may sort before it, or share its number, once it can be read again."""
    best, unknown = 0, []
    for e in entries:
        if e.manifest is not None or e.seq_hint is not None:
            best = max(best, e.manifest.seq if e.manifest is not None else e.seq_hint or 0)
        elif MANIFEST_NAME in e.sizes:
            unknown.append(e.name)
    if unknown:
        log.warning(
            "the commit order of %s at %s is unknown: its %s cannot be read here; checkpoints "
            "committed now may be taken for older than it once it can be read again (its name "
            "is left to it; `resilient-ckpt gc DIR --remote URL --remove-corrupt` deletes one "
            "that is damaged)",
            ", ".join(unknown),
            url,
            MANIFEST_NAME,
        )
    return best


class ManifestLastCommit:
    """The :class:`~.commit.CommitStrategy` of an object store, which has no rename and no
    atomic directory: the files go under the checkpoint's final name, and the manifest goes
    last, once every file it lists is visible there with its size (and its MD5, where the
    store's ETag is one). A remote checkpoint exists only when its manifest does
    (:meth:`~.remote.RemoteStore.scan`), so a crash before the manifest leaves an invisible,
    incomplete folder that ``gc`` removes. ``local_dir`` holds the files being uploaded (for
    the MD5 check); the staging location is the checkpoint's name under the store's URL.

    Which ranks call what: the one process that uploads (the coordinator) calls all three."""

    def __init__(self, store: RemoteStore, name: str, local_dir: str) -> None:
        self.store, self.name, self.local_dir = store, name, local_dir

    def begin(self, step: int, uncommit: bool = True) -> str:
        """Uncommit whatever checkpoint had this name (its manifest first, so it is never seen
        with files missing; ``uncommit=False``: the caller saw none) and return the name to
        put the files under."""
        st = self.store
        with contextlib.suppress(FileNotFoundError):
            if uncommit:
                st.fs.rm_file(st._path(self.name, MANIFEST_NAME))
        if st.is_local:
            st.fs.makedirs(st._path(self.name), exist_ok=True)
        return self.name

    def commit(self, staging: str, step: int, manifest: bytes) -> str:
        """Check every listed file, then put the manifest: the checkpoint exists from then on.
        Raises ``OSError`` naming a file that is missing or differs (nothing is committed)."""
        st = self.store
        where = f"{st.url}/{staging}/{MANIFEST_NAME}"
        m = Manifest.from_json(json.loads(manifest), where)
        st._check_uploaded(self.local_dir, m, staging)
        if st.is_local:
            st._fsync_local([st._path(staging, f.path) for f in m.files])
        put_manifest(st, st._path(staging, MANIFEST_NAME), manifest)
        return f"{st.url}/{staging}"

    def abort(self, staging: str) -> None:
        """Remove what was put under ``staging`` (no manifest was written)."""
        self.store.delete(staging)
