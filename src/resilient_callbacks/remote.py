"""The durable tier: committed checkpoints mirrored to any fsspec URL (``s3://``, ``gs://``,
``az://``, ``memory://``, ``file://``, ...).

Layout: ``<url>/<checkpoint name>/<files>``, the same files as the local checkpoint, and
``<url>/blobs/`` for the tensors incremental checkpoints share (:mod:`.remote_blobs`). The remote
commit point is the manifest, uploaded **after** every file it lists is uploaded and checked
(size, and the MD5 ETag where the store gives one for a single-part object); object stores
have no rename, so this ordering is what makes a remote checkpoint atomic. A listing shows a
checkpoint only when its manifest is there; deletion removes the manifest first, so an
interrupted deletion leaves an invisible, incomplete directory, never a committed one with
files missing. Files are uploaded concurrently, large ones in parallel multipart parts (the
filesystem's own ``put``).

Which ranks call what: only the coordinator talks to the remote store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import threading
import uuid
from collections.abc import Collection, Mapping
from typing import Any

import fsspec

from . import (
    remote_blob_put,
    remote_blobs,
    remote_download,
    remote_listing,
    remote_objects,
    remote_paths,
    remote_put,
)
from .catalog import verify_entries
from .commit import fsync_dir
from .errors import RemoteDeleteRefusedError, RemoteUnavailableError
from .global_rngs import preserved
from .manifest import MANIFEST_NAME, Manifest
from .progress import Progress
from .redact import options_text, url_text
from .remote_blob_check import Verified
from .remote_claims import CLAIM_PREFIX, RemoteNameTaken, claim, key_of, same_commit
from .remote_listing import (  # noqa: F401 (re-exported: their old home)
    NO_MANIFEST,
    RemoteEntry,
    retention_candidates,
)
from .remote_objects import ManifestLastCommit, check_uploaded
from .remote_url import azure_account_hint, pinned, refuse_cache, unknown_scheme_error
from .store_key import IDENTITY_OPTIONS, store_identity  # noqa: F401 (re-exported: their old home)

log = logging.getLogger("resilient_callbacks")

PROBE_PREFIX = ".resilient-probe-"
STALE_UPLOAD_S = 24 * 3600.0  # untouched this long, a folder without a manifest is dead


class RemoteStore:
    """Checkpoint directories under one fsspec URL."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"remote={url!r}: an fsspec URL such as 's3://bucket/prefix'")
        # the URL as messages, logs and listings show it: without a user, password or signed
        # query (the store opens the URL as given)
        self.url = url_text(url.rstrip("/"))
        self.options = dict(options or {})
        try:
            # importing the backend may draw from the global RNGs (see global_rngs)
            with preserved():
                opening, endpoint = pinned(url, self.options)
                self.fs, root = fsspec.core.url_to_fs(url.rstrip("/"), **opening)
        except ImportError as e:
            raise RemoteUnavailableError(
                f"remote={self.url!r}: the filesystem for this URL is not installed ({e}). For "
                "s3:// install `resilient-callbacks[s3]` (s3fs); for gs:// gcsfs; for az:// adlfs."
                + azure_account_hint(url, self.options)
            ) from e
        except (TypeError, ValueError) as e:
            if unknown := unknown_scheme_error(url, options_text(self.options)):
                raise unknown from e  # a typo (s4://): a usage error
            raise RemoteUnavailableError(
                f"remote={self.url!r} with remote_options {options_text(self.options)}: "
                f"{url_text(str(e))}"
            ) from e
        refuse_cache(self.fs, url)
        self.root = root.rstrip("/")
        proto = self.fs.protocol
        self.protocol = proto if isinstance(proto, str) else proto[0]
        self.is_local = self.protocol in ("file", "local")
        #: the store as one writer of this process owns it (``lock.claim_remote``) and as the
        #: upload threads hand it over (``UploadThread._after_previous``): protocol and root,
        #: a local root through its links, and the options that say which service holds it
        #: (:func:`store_identity`: one bucket name on two endpoints is two stores)
        where = os.path.realpath(self.root) if self.is_local else self.root
        self.key = f"{self.protocol}://{where}"
        if ident := store_identity(
            getattr(self.fs, "storage_options", None) or self.options, self.protocol, endpoint
        ):
            self.key += " " + json.dumps(ident, sort_keys=True)
        # name -> (its manifest's listed size, time, etag; the manifest): see _read_manifests
        self._manifests: dict[str, tuple[tuple[Any, ...], Manifest]] = {}
        self.blobs_verified = Verified()  # remote blobs whose bytes this process checked

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    # ------------------------------------------------------------------ preflight

    def preflight(self, timeout: float = 30.0) -> None:
        """Prove the store is reachable and writable: write, read back and delete a small
        probe object. Raises :class:`RemoteUnavailableError` within ``timeout`` seconds; a
        store that does not let it delete (uploads work; remote retention cannot) is a
        warning, once."""
        probe = self._path(f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}")

        def run() -> None:
            if self.is_local:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"resilient_callbacks preflight")
            try:
                if self.fs.cat_file(probe) != b"resilient_callbacks preflight":
                    raise OSError("the probe object read back different bytes")
            finally:
                try:
                    self.fs.rm_file(probe)
                except Exception as e:
                    log.warning(
                        "remote %s: deleting an object there failed (%s: %s): uploads work, but "
                        "the remote retention cannot delete old checkpoints. Grant %s, or "
                        "pass remote_keep_last='all'",
                        self.url,
                        type(e).__name__,
                        url_text(str(e)),
                        remote_paths.delete_right(self.protocol),
                    )

        outcome: list[Exception | None] = []

        def attempt() -> None:
            try:
                run()
                outcome.append(None)
            except Exception as e:
                outcome.append(e)

        # A daemon thread: a store that never answers must not keep the process from exiting
        # once the error is raised (an executor's worker is joined at interpreter exit).
        worker = threading.Thread(target=attempt, name="rc-preflight", daemon=True)
        worker.start()
        worker.join(timeout)
        if not outcome:
            raise RemoteUnavailableError(
                f"remote {self.url}: no answer within {timeout:g} s (endpoint unreachable or "
                f"very slow). remote_options: {options_text(self.options)}"
            )
        if (e := outcome[0]) is not None:
            check = remote_objects.preflight_advice(e, self.is_local)
            raise RemoteUnavailableError(
                f"remote {self.url} is not usable: {type(e).__name__}: "
                f"{url_text(str(e)).rstrip('. ')}. {check} "
                f"(remote_options: {options_text(self.options)})."
            ) from e

    # ------------------------------------------------------------------ listing

    def scan(self) -> list[RemoteEntry]:
        """Every checkpoint-like directory under the URL (:func:`.remote_listing.scan`)."""
        return remote_listing.scan(self)

    def scan_with_blobs(self) -> tuple[list[RemoteEntry], dict[str, int]]:
        """:meth:`scan` and the blobs its listing saw (:func:`.remote_listing.scan_with_blobs`)."""
        return remote_listing.scan_with_blobs(self)

    def read_file(self, name: str, filename: str) -> bytes:
        """The bytes of file ``filename`` of checkpoint ``name`` in the store."""
        return self.fs.cat_file(self._path(name, filename))

    def read_manifest(self, name: str) -> Manifest:
        return remote_listing.parse_manifest(self, name, self.read_file(name, MANIFEST_NAME))

    def _read_manifests(
        self,
        names: list[str],
        signs: Mapping[str, tuple[Any, ...] | None],
        hints: dict[str, int] | None = None,
    ) -> dict[str, Manifest | Exception]:
        return remote_listing.read_manifests(self, names, signs, hints)

    # ------------------------------------------------------------------ upload

    def upload(
        self,
        local_dir: str,
        manifest: Manifest,
        name: str,
        progress: Progress | None = None,
        *,
        repair: bool = False,
        blobs_again: Collection[str] = (),
    ) -> None:
        """Upload one committed local checkpoint as ``name``; the manifest goes last, after
        every file is checked. Raises on any failure (nothing is committed remotely then).
        ``repair``: the remote copy of this commit is damaged (a file missing, torn or rotten):
        uncommit it and upload every file again. ``blobs_again``: blobs it refers to that are
        on the remote at the right size but with other bytes (read and found rotten): uploaded
        again too (every checkpoint recording it with the local checksum wants exactly these
        bytes). :class:`RemoteNameTaken` if ``name`` holds another commit, or a manifest that
        cannot be read (never replaced, not even to repair: the caller takes a free name)."""
        existing = self._manifest_bytes(name)
        with open(os.path.join(local_dir, MANIFEST_NAME), "rb") as fh:
            manifest_bytes = fh.read()
        if existing == manifest_bytes and not repair:
            return  # already committed there (an earlier run uploaded it)
        if existing is not None and not same_commit(existing, manifest):
            # another commit's (another run writing to this URL, or another process resuming
            # this run), or one whose manifest cannot be read here (damaged, newer): never
            # uncommitted for ours (the caller takes a free name); only `gc --remote
            # --remove-corrupt` deletes a damaged one
            raise RemoteNameTaken(name, key_of(existing))
        verify_entries(local_dir, manifest.files)  # the committed bytes, or nothing goes up
        mark = claim(self, name, manifest, existing)  # one writer at a time
        try:
            uncommit = existing is not None or repair  # none there: no delete (a store may deny it)
            self._upload(local_dir, manifest, name, manifest_bytes, progress, blobs_again, uncommit)
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm_file(mark)

    def _upload(
        self,
        local_dir: str,
        manifest: Manifest,
        name: str,
        manifest_bytes: bytes,
        progress: Progress | None,
        blobs_again: Collection[str],
        uncommit: bool,
    ) -> None:
        """:meth:`upload` under the mark of :func:`~.remote_claims.claim`; ``uncommit``: the
        name has a manifest (this commit's, damaged) to remove first."""
        commit = ManifestLastCommit(self, name, local_dir)
        commit.begin(manifest.step, uncommit=uncommit)
        lpaths = [os.path.join(local_dir, f.path) for f in manifest.files]
        rpaths = [self._path(name, f.path) for f in manifest.files]
        if self.is_local:
            for entry in manifest.files:
                if "/" in entry.path:
                    parent = posixpath.dirname(self._path(name, entry.path))
                    self.fs.makedirs(parent, exist_ok=True)
        # the blobs not there yet (their bytes counted in progress)
        marker = remote_blob_put.upload(self, local_dir, manifest, blobs_again, progress)
        try:
            remote_put.put(self, lpaths, rpaths, progress)  # (counted, fenced)
            # before the commit, a blob another run's collection deleted meanwhile is uploaded
            # again: a committed manifest never names a deleted blob, even if a kill follows
            remote_blob_put.settle(self, local_dir, manifest, marker)
            commit.commit(name, manifest.step, manifest_bytes)
        finally:
            remote_blobs.end_upload(self, marker)
        if progress is not None:
            progress.update(len(manifest_bytes))

    def _manifest_bytes(self, name: str) -> bytes | None:
        try:
            data: bytes = self.fs.cat_file(self._path(name, MANIFEST_NAME))
            return data
        except FileNotFoundError:
            return None

    def _check_uploaded(self, local_dir: str, manifest: Manifest, name: str) -> None:
        self.fs.invalidate_cache()
        listing = self.fs.find(self._path(name), detail=True)
        by_rel = {
            self.fs._strip_protocol(p)[len(self._path(name)) + 1 :]: info
            for p, info in listing.items()
        }
        for f in manifest.files:
            info = by_rel.get(f.path)
            where = f"{self.url}/{name}/{f.path}"
            if info is None:
                raise OSError(f"{where}: not visible after upload")
            check_uploaded(info, where, f.size, os.path.join(local_dir, f.path))

    def _fsync_local(self, paths: list[str]) -> None:
        dirs = set()
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(os.path.dirname(p))
        for d in dirs:
            fsync_dir(d)

    # ------------------------------------------------------------------ download

    def download(
        self,
        entry: RemoteEntry,
        local_root: str,
        progress: bool | None = None,
        staging: str | None = None,
    ) -> tuple[str, str]:
        """Download a committed remote checkpoint into a staging directory under
        ``local_root`` (``staging``: that one, kept when this raises, a retry fetching only
        what did not arrive whole) and verify every checksum (:func:`.remote_download.download`)."""
        return remote_download.download(self, entry, local_root, progress, staging)

    # ------------------------------------------------------------------ delete

    def delete(self, name: str) -> None:
        """Mark the name as being deleted (an upload that finds it without its manifest then
        takes another name: the removal of the folder would take its files with it), uncommit
        (manifest first: the checkpoint is never seen committed with files missing), then
        remove the files in batches that name each key refused (:func:`.remote_paths.delete`;
        s3fs's recursive ``rm`` dropped them silently), and the mark last. Raises
        :class:`.RemoteDeleteRefusedError` where the store refused some: the manifest (nothing
        else deleted, the checkpoint stays committed and whole), files or the mark itself
        (the folder stays uncommitted, with its mark, for a later deletion)."""
        folder, mark = self._path(name), self._path(name, f"{CLAIM_PREFIX}deleting")
        # one name for every attempt: a store that refuses deletes keeps one, not one a retry
        with contextlib.suppress(Exception):  # (a folder already gone; a store that refuses)
            self.fs.pipe_file(mark, b"")
        manifest = self._path(name, MANIFEST_NAME)
        try:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(manifest)
        except Exception as e:
            if not remote_paths.answered(self.fs, e):
                raise  # (no answer: the store may still carry it out; as before)
            with contextlib.suppress(Exception):  # (the folder is whole: no mark left in it)
                self.fs.rm_file(mark)
            raise _refused(self.url, name, {manifest: e}, True, self.protocol) from e
        try:
            found = self.fs.find(folder)
        except FileNotFoundError:
            found = []
        own = self.fs._strip_protocol(mark)
        refused = remote_paths.delete(self.fs, [p for p in found if p != own])
        if refused:  # the mark stays: an upload under this name would lose files to a retry
            raise _refused(self.url, name, refused, False, self.protocol)
        try:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(mark)
        except Exception as e:  # (refused alone: a refusal as the files', not a bare error)
            if not remote_paths.answered(self.fs, e):
                raise
            raise _refused(self.url, name, {own: e}, False, self.protocol) from e
        if not remote_paths.reports_refusals(self.fs):  # (a folder of its own on a filesystem)
            with contextlib.suppress(FileNotFoundError):
                remote_paths.rm_tree(self.fs, folder)


def _refused(
    url: str, name: str, refused: Mapping[str, BaseException], committed: bool, protocol: str
) -> RemoteDeleteRefusedError:
    shown = ", ".join(f"{p} ({e})" for p, e in list(refused.items())[:3])
    more = f" and {len(refused) - 3} more" if len(refused) > 3 else ""
    state = (
        "nothing was deleted: the checkpoint is still committed and whole"
        if committed
        else "it is no longer committed (every reader ignores it); those objects are left"
    )
    return RemoteDeleteRefusedError(
        f"remote {url_text(url)}: the store refused to delete {len(refused)} object(s) of "
        f"{name}: {url_text(shown)}{more}; {state}. Allow deletes under this prefix (grant "
        f"{remote_paths.delete_right(protocol)}; lift object locks); the next deletion of "
        "it (retention, `resilient-ckpt gc --remote`) tries again",
        {p: f"{type(e).__name__}: {e}" for p, e in refused.items()},
        committed,
    )
