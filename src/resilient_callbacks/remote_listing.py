"""What a remote store lists: :class:`RemoteEntry` (one checkpoint-like folder under the URL,
committed once its manifest is there, with the problem found in the listing), :func:`scan` (every
folder, committed ones by commit sequence, each checked against the sizes the listing gives and
the blobs it names), the manifests read for it (one unchanged since the last scan is not fetched
again) and :func:`retention_candidates`. :class:`~.remote.RemoteStore` lists through these
(``RemoteStore.scan``) and :mod:`.remote` re-exports the names, their old home. Which ranks call
what: only the coordinator (or a node's uploader) lists the remote store.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import remote_reads, store_wait
from .blobs import BLOBS_DIR
from .catalog import PLAIN_DCP_METADATA, archived
from .errors import CheckpointCorruptError, RemoteUnavailableError
from .manifest import MANIFEST_NAME, NEWER_FORMAT, Manifest
from .redact import options_text, url_text
from .remote_objects import modified_time, raw_seq
from .retention import Candidate

if TYPE_CHECKING:
    from .remote import RemoteStore

NO_MANIFEST = "no manifest (incomplete)"  # a RemoteEntry's problem: files, no manifest yet


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
            # an archive point under the remote policy it was written with (kept forever, as
            # the local tier counts its own: catalog.retention_candidates), also after a run
            # with other options; a manifest without one: the local policy recorded
            archived=archived(e.manifest),
            lineage=e.manifest.lineage,
        )
        for e in entries
        if e.manifest is not None
    ]


def scan(st: RemoteStore) -> list[RemoteEntry]:
    """Every checkpoint-like directory under the URL: committed ones (manifest present)
    ordered by commit sequence, oldest first, then those without a manifest."""
    return scan_with_blobs(st)[0]


def scan_with_blobs(st: RemoteStore) -> tuple[list[RemoteEntry], dict[str, int]]:
    """:func:`scan`, and the name and size of every object under ``<url>/blobs`` that its
    listing saw (blobs and markers, listed before any manifest was read): the blob
    collection needs both, and listed the blobs a second time."""
    # Other processes write here too: list afresh (s3fs caches listings per directory, and
    # invalidating a path does not invalidate the paths below it).
    st.fs.invalidate_cache()
    try:
        # every depth: a FilePart's files (parts/<id>/...) and dcp/ live in sub-folders
        # (a local folder answers or raises; only a store a client talks to is waited for)
        with store_wait.waiting(f"listing {st.url}", quiet=st.is_local):
            listing = st.fs.find(st.root, detail=True)
        if not listing and not st.is_local:
            # fsspec's walk (http://, where find is its) takes a listing that raised for
            # none: a store that did not answer read as an empty one ("no checkpoints")
            st.fs.ls(st.root, detail=False)
    except FileNotFoundError as e:
        check_bucket(st, e)
        return [], {}
    groups: dict[str, dict[str, int]] = {}
    modified: dict[str, float] = {}
    signs: dict[str, tuple[Any, ...] | None] = {}  # name -> its manifest's size, time, etag
    prefix = st.root + "/" if st.root else ""
    for path, info in listing.items():
        p = path.rstrip("/")
        if st.root and not p.startswith(prefix):
            p = st.fs._strip_protocol(p)
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
    manifests = st._read_manifests(
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
            entries.append(RemoteEntry(name, None, sizes, str(m), modified.get(name), newer, seq))
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
    return entries, {n: size for n, size in blob_sizes.items() if "/" not in n}


def check_bucket(st: RemoteStore, e: FileNotFoundError) -> None:
    """An object store's URL whose bucket does not exist is no empty store: raise
    :class:`RemoteUnavailableError` (a missing folder is empty: the first upload makes
    it)."""
    bucket = st.root.split("/", 1)[0]
    if st.is_local or not bucket:
        return
    try:
        exists = st.fs.exists(bucket)
    except Exception:  # cannot tell (no right to list it, say): as before
        return
    if not exists:
        raise RemoteUnavailableError(
            f"remote {st.url}: the bucket {bucket!r} does not exist ({e}). Check the "
            f"bucket name and the endpoint (remote_options: {options_text(st.options)})."
        ) from e


def parse_manifest(st: RemoteStore, name: str, raw: bytes) -> Manifest:
    where = f"{st.url}/{name}/{MANIFEST_NAME}"
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable manifest ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{where}: manifest is not a JSON object")
    return Manifest.from_json(data, where, name)


def read_manifests(
    st: RemoteStore,
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
    known = st._manifests
    for n in names:
        if signs.get(n) is not None and n in known and known[n][0] == signs[n]:
            out[n] = known[n][1]
    paths = {st.fs._strip_protocol(st._path(n, MANIFEST_NAME)): n for n in names if n not in out}
    got = remote_reads.cat_manifests(st.fs, list(paths), st.url) if paths else {}
    for path, name in paths.items():
        raw = got.get(path, FileNotFoundError(path))
        if isinstance(raw, Exception):
            out[name] = raw
            continue
        try:
            out[name] = parse_manifest(st, name, raw)
        except Exception as e:
            out[name] = e
            if hints is not None and (seq := raw_seq(raw)) is not None:
                hints[name] = seq
    st._manifests = {
        n: (sign, m)
        for n, m in out.items()
        if isinstance(m, Manifest) and (sign := signs.get(n)) is not None
    }
    return out
