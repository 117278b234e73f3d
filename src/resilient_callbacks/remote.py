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
import shutil
import threading
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec

from . import remote_blobs, remote_objects, remote_reads
from .blobs import BLOBS_DIR
from .catalog import PLAIN_DCP_METADATA, Depth, verify, verify_entries
from .commit import STAGING_PREFIX, fsync_dir, fsync_tree
from .errors import CheckpointCorruptError, RemoteUnavailableError
from .global_rngs import preserved
from .manifest import MANIFEST_NAME, NEWER_FORMAT, Manifest
from .progress import Progress
from .redact import options_text, url_text
from .remote_blob_check import Verified
from .remote_objects import (
    CLAIM_PREFIX,
    ManifestLastCommit,
    RemoteNameTaken,
    check_uploaded,
    claim,
    key_of,
    modified_time,
    raw_seq,
    same_commit,
)
from .retention import Candidate

log = logging.getLogger("resilient_callbacks")

PROBE_PREFIX = ".resilient-probe-"
NO_MANIFEST = "no manifest (incomplete)"  # a RemoteEntry's problem: files, no manifest yet
STALE_UPLOAD_S = 24 * 3600.0  # untouched this long, a folder without a manifest is dead


@dataclass
class RemoteEntry:
    name: str
    manifest: Manifest | None  # None: files without a manifest (being uploaded, or torn)
    sizes: dict[str, int]  # relative path -> size, as listed
    problem: str | None = None
    modified: float | None = None  # newest object's modification time (None: not listed)
    # its manifest is listed but could not be read here (the store did not answer that read,
    # or a newer version wrote it): not known to be damaged, so never deleted as corrupt
    unread: bool = False
    # its manifest cannot be read here but its JSON gives a commit number (a newer format's)
    seq_hint: int | None = None

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def key(self) -> tuple[str, int] | None:
        return (self.manifest.run_id, self.manifest.seq) if self.manifest else None


def retention_candidates(entries: list[RemoteEntry], prefix: str = "") -> list[Candidate]:
    """The committed remote entries as retention candidates (names prefixed by ``prefix``,
    to plan them together with local ones)."""
    return [
        Candidate(
            prefix + e.name,
            e.manifest.step,
            e.manifest.seq,
            e.manifest.run_id,
            e.manifest.metrics,
            e.problem is None,
            lineage=e.manifest.lineage,
        )
        for e in entries
        if e.manifest is not None
    ]


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
                self.fs, root = fsspec.core.url_to_fs(url.rstrip("/"), **self.options)
        except ImportError as e:
            raise RemoteUnavailableError(
                f"remote={self.url!r}: the filesystem for this URL is not installed ({e}). For "
                "s3:// install `resilient-callbacks[s3]` (s3fs); for gs:// gcsfs; for az:// adlfs."
            ) from e
        except (TypeError, ValueError) as e:
            raise RemoteUnavailableError(
                f"remote={self.url!r} with remote_options {options_text(self.options)}: "
                f"{url_text(str(e))}"
            ) from e
        self.root = root.rstrip("/")
        proto = self.fs.protocol
        self.protocol = proto if isinstance(proto, str) else proto[0]
        self.is_local = self.protocol in ("file", "local")
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
                        "the remote retention cannot delete old checkpoints. Grant delete "
                        "rights (s3:DeleteObject), or pass remote_keep_last='all'",
                        self.url,
                        type(e).__name__,
                        url_text(str(e)),
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
        """Every checkpoint-like directory under the URL: committed ones (manifest present)
        ordered by commit sequence, oldest first, then those without a manifest."""
        # Other processes write here too: list afresh (s3fs caches listings per directory, and
        # invalidating a path does not invalidate the paths below it).
        self.fs.invalidate_cache()
        try:
            # every depth: a FilePart's files (parts/<id>/...) and dcp/ live in sub-folders
            listing = self.fs.find(self.root, detail=True)
        except FileNotFoundError as e:
            self._check_bucket(e)
            return []
        groups: dict[str, dict[str, int]] = {}
        modified: dict[str, float] = {}
        signs: dict[str, tuple[Any, ...] | None] = {}  # name -> its manifest's size, time, etag
        prefix = self.root + "/" if self.root else ""
        for path, info in listing.items():
            p = path.rstrip("/")
            if self.root and not p.startswith(prefix):
                p = self.fs._strip_protocol(p)
            rel = p[len(prefix) :] if p.startswith(prefix) else p
            if "/" not in rel or info.get("type") == "directory":
                continue
            name, file = rel.split("/", 1)
            if name.startswith("."):
                continue
            groups.setdefault(name, {})[file] = int(info.get("size") or 0)
            t = modified_time(info)
            if t is not None:
                modified[name] = max(t, modified.get(name, t))
            if file == MANIFEST_NAME:
                etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
                made = info.get("created")  # memory:// has no other
                signs[name] = (info.get("size"), t, etag, made) if t or etag or made else None
        blob_sizes = groups.pop(BLOBS_DIR, {})
        hints: dict[str, int] = {}  # (commit numbers of manifests it refuses)
        manifests = self._read_manifests(
            [n for n, sizes in groups.items() if MANIFEST_NAME in sizes], signs, hints
        )
        entries: list[RemoteEntry] = []
        for name, sizes in sorted(groups.items()):
            if MANIFEST_NAME not in sizes:
                if PLAIN_DCP_METADATA in sizes:  # plain dcp.save's (step_100): not ours, kept
                    continue
                entries.append(RemoteEntry(name, None, sizes, NO_MANIFEST, modified.get(name)))
                continue
            m = manifests[name]
            if isinstance(m, CheckpointCorruptError):  # damaged (a newer format: unread)
                newer = NEWER_FORMAT in str(m)
                seq = hints.get(name)
                entries.append(
                    RemoteEntry(name, None, sizes, str(m), modified.get(name), newer, seq)
                )
                continue
            if isinstance(m, Exception):  # the read failed: not known damaged
                bad = f"unreadable manifest: {type(m).__name__}: {url_text(str(m))}"
                entries.append(RemoteEntry(name, None, sizes, bad, modified.get(name), True))
                continue
            problem = None
            for f in m.files:
                if f.path not in sizes:
                    problem = f"{f.path} is listed in the manifest but missing remotely"
                    break
                if sizes[f.path] != f.size:
                    problem = f"{f.path}: {sizes[f.path]} bytes remotely, manifest says {f.size}"
                    break
            for b in [] if problem else m.blobs:
                if blob_sizes.get(b.path) != b.size:
                    problem = f"the blob {BLOBS_DIR}/{b.path} it refers to is missing or torn"
                    break
            entries.append(RemoteEntry(name, m, sizes, problem, modified.get(name)))
        entries.sort(key=lambda e: (e.manifest is None, e.manifest.seq if e.manifest else 0))
        return entries

    def _check_bucket(self, e: FileNotFoundError) -> None:
        """An object store's URL whose bucket does not exist is no empty store: raise
        :class:`RemoteUnavailableError` (a missing folder is empty: the first upload makes
        it)."""
        bucket = self.root.split("/", 1)[0]
        if self.is_local or not bucket:
            return
        try:
            exists = self.fs.exists(bucket)
        except Exception:  # cannot tell (no right to list it, say): as before
            return
        if not exists:
            raise RemoteUnavailableError(
                f"remote {self.url}: the bucket {bucket!r} does not exist ({e}). Check the "
                f"bucket name and the endpoint (remote_options: {options_text(self.options)})."
            ) from e

    def read_manifest(self, name: str) -> Manifest:
        return self._parse_manifest(name, self.fs.cat_file(self._path(name, MANIFEST_NAME)))

    def _parse_manifest(self, name: str, raw: bytes) -> Manifest:
        where = f"{self.url}/{name}/{MANIFEST_NAME}"
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointCorruptError(f"{where}: unreadable manifest ({e})") from None
        if not isinstance(data, dict):
            raise CheckpointCorruptError(f"{where}: manifest is not a JSON object")
        return Manifest.from_json(data, where)

    def _read_manifests(
        self,
        names: list[str],
        signs: Mapping[str, tuple[Any, ...] | None],
        hints: dict[str, int] | None = None,
    ) -> dict[str, Manifest | Exception]:
        """The manifests of ``names``, parsed, or the exception reading or parsing one raised
        (then ``hints`` gets its commit number where its JSON gives one: a newer format).
        One an earlier scan read whose listing ``signs`` (size, time, etag) is the same is
        reused (the uploader scans after each upload: fetching every manifest again took 1.5 s
        at 93); the rest are fetched in one call, which an object store's client runs
        concurrently."""
        out: dict[str, Manifest | Exception] = {}
        known = self._manifests
        for n in names:
            if signs.get(n) is not None and n in known and known[n][0] == signs[n]:
                out[n] = known[n][1]
        paths = {
            self.fs._strip_protocol(self._path(n, MANIFEST_NAME)): n for n in names if n not in out
        }
        got = remote_reads.cat_manifests(self.fs, list(paths), self.url) if paths else {}
        for path, name in paths.items():
            raw = got.get(path, FileNotFoundError(path))
            if isinstance(raw, Exception):
                out[name] = raw
                continue
            try:
                out[name] = self._parse_manifest(name, raw)
            except Exception as e:
                out[name] = e
                if hints is not None and (seq := raw_seq(raw)) is not None:
                    hints[name] = seq
        self._manifests = {
            n: (sign, m)
            for n, m in out.items()
            if isinstance(m, Manifest) and (sign := signs.get(n)) is not None
        }
        return out

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
        """:meth:`upload` under the mark of :func:`~.remote_objects.claim`; ``uncommit``: the
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
        cb = progress.multi_callback() if progress is not None else None
        kwargs: dict[str, Any] = {"callback": cb} if cb is not None else {}
        marker = remote_blobs.upload(self, local_dir, manifest, blobs_again)  # those not there
        try:
            self.fs.put(lpaths, rpaths, **kwargs)
            # before the commit, a blob another run's collection deleted meanwhile is uploaded
            # again: a committed manifest never names a deleted blob, even if a kill follows
            remote_blobs.settle(self, local_dir, manifest, marker)
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
        self, entry: RemoteEntry, local_root: str, progress: bool | None = None
    ) -> tuple[str, str]:
        """Download a committed remote checkpoint into a staging directory under
        ``local_root`` and verify every checksum. Returns ``(staging_dir, name)``; the caller
        moves it into place. Raises :class:`CheckpointCorruptError` or ``OSError``."""
        assert entry.manifest is not None
        m = entry.manifest
        staging = os.path.join(local_root, f"{STAGING_PREFIX}{entry.name}-{uuid.uuid4().hex[:12]}")
        os.makedirs(staging)
        try:
            for f in m.files:
                if "/" in f.path:
                    os.makedirs(os.path.dirname(os.path.join(staging, f.path)), exist_ok=True)
            remote_blobs.download(self, m, local_root, staging)  # verified, before the manifest
            bar = Progress(m.total_bytes, f"downloading {entry.name} from {self.url}", bar=progress)
            try:
                self.fs.get(
                    [self._path(entry.name, f.path) for f in m.files],
                    [os.path.join(staging, f.path) for f in m.files],
                    callback=bar.multi_callback(),
                )
            finally:
                bar.close()
            with open(os.path.join(staging, MANIFEST_NAME), "wb") as fh:
                fh.write(self.fs.cat_file(self._path(entry.name, MANIFEST_NAME)))
            for rel in [f.path for f in m.files] + [MANIFEST_NAME]:  # the manifest too
                with open(os.path.join(staging, rel), "rb+") as fh:
                    os.fsync(fh.fileno())
            verify(staging, m, Depth.FULL)
            fsync_tree(staging)  # (every folder: parts/<id>/ hold files too)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging, entry.name

    # ------------------------------------------------------------------ delete

    def delete(self, name: str) -> None:
        """Mark the name as being deleted (an upload that finds it without its manifest then
        takes another name: the removal of the folder would take its files with it), uncommit
        (manifest first), then remove the files and the mark."""
        # one name for every attempt: a store that refuses deletes keeps one, not one a retry
        with contextlib.suppress(Exception):  # (a folder already gone; a store that refuses)
            self.fs.pipe_file(self._path(name, f"{CLAIM_PREFIX}deleting"), b"")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name, MANIFEST_NAME))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(name), recursive=True)
