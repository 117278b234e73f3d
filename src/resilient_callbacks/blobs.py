"""The run directory's content-addressed store of tensors shared by checkpoints
(``incremental=True``).

::

    ckpts/run1/
      blobs/
        3f2a...9c.safetensors       one tensor, named by the xxh3-128 of its dtype, shape and bytes
        77b0...e1.zs1.safetensors.zst  compressed: zstd level 1, shuffled (see :mod:`.compression`)
        .tmp-<key>-<random>         a blob being written (or left by a crash)
      step_000000060/
        manifest.json               "blobs": [{"path": "3f2a...9c.safetensors", "size", "xxh3_64"}]
        shared.json                 "blobs": {"model/embed.weight": "3f2a...9c.safetensors"}

A blob is written to a temporary name, fsynced and renamed into place (and the folder fsynced)
before the manifest that refers to it is written, so a committed checkpoint never names a blob
that is not complete. A blob is never rewritten once a manifest names it.

A reference resolves first inside the checkpoint (``<checkpoint>/blobs/<name>``: a
self-contained copy), then in the run directory's store (``<dirpath>/blobs/<name>``).

Deletion (:meth:`BlobStore.collect`): the live set is every blob named by any committed
manifest in the directory (every run's); blobs pinned by a save in flight in this process are
live too. Only the directory's one writer (who holds its lock) collects, so no other process can
be saving meanwhile; a manifest that cannot be read stops the collection (its references are
unknown). A crash anywhere leaves at worst unreferenced blobs, which the next collection
(retention, ``resilient-ckpt gc``, or the next writer opening the directory) removes.

Which ranks call what: only the coordinator (rank 0) writes the replicated tensors, so only it
uses the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from .commit import CKPT_RE, STAGING_PREFIX, TRASH_PREFIX, ensure_dir, fsync_dir
from .errors import CheckpointCorruptError, UnsafeManifestError
from .filewrite import digest_file
from .manifest import BLOB_KIND, BLOB_NAME_RE, MANIFEST_NAME, FileEntry, Manifest, read_manifest

if TYPE_CHECKING:  # tensorfile imports torch: only saves need it (the CLI's ls and gc not)
    import torch

    from .tensorfile import DirectBuffer

log = logging.getLogger("resilient_callbacks")

BLOBS_DIR = "blobs"
BLOB_MIN = 16 << 10  # smaller tensors stay in the checkpoint's own files
TMP_PREFIX = ".tmp-"
NAME_RE = BLOB_NAME_RE


def content_key(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's dtype, shape and bytes: the name of its blob."""
    from .tensorfile import _as_bytes

    h = xxhash.xxh3_128()
    h.update(f"{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
    h.update(_as_bytes(t))
    return h.hexdigest()


def blob_name(key: str, compress: tuple[int, bool] | None = None) -> str:
    """The file name of blob ``key``: the codec's parameters are part of it, so that one name
    always means the same stored bytes (zstd is deterministic for given parameters)."""
    if compress is None:
        return f"{key}.safetensors"
    level, shuffle = compress
    return f"{key}.z{'s' if shuffle else ''}{level}.safetensors.zst"


def key_of(name: str) -> str:
    if NAME_RE.match(name) is None:
        raise UnsafeManifestError(f"{name!r} is not a blob name")
    return name[:32]


def store_dir(root: str) -> str:
    return os.path.join(root, BLOBS_DIR)


def blob_path(ckpt_path: str, name: str) -> str:
    """Where a checkpoint's reference to blob ``name`` resolves: inside the checkpoint if it
    holds its own copy, else in the run directory's store."""
    inside = os.path.join(ckpt_path, BLOBS_DIR, name)
    if os.path.exists(inside):
        return inside
    return os.path.join(os.path.dirname(os.path.abspath(ckpt_path)), BLOBS_DIR, name)


def is_incremental(m: Manifest) -> bool:
    return bool(m.blobs)


def live_blobs(root: str) -> set[str] | None:
    """The blob names every committed manifest of ``root`` names; None when a manifest cannot
    be read (its references are unknown: collecting then could delete a live blob)."""
    from .catalog import Depth, Status, scan

    live: set[str] = set()
    for e in scan(root, Depth.NONE):
        if e.status is Status.INCOMPLETE:
            continue
        if e.manifest is None:
            return None
        live.update(b.path for b in e.manifest.blobs)
    return live | copies_blobs(root)


def copies_blobs(root: str) -> set[str]:
    """The blobs named by the user's own copies of checkpoints in ``root`` (a folder such as
    ``step_000000500.bak`` with a manifest of ours): never loaded or counted as checkpoints,
    but the blobs they refer to stay while they are there. A copy whose manifest cannot be
    read keeps nothing (it is the user's, and no checkpoint)."""
    kept: set[str] = set()
    try:
        names = os.listdir(root)
    except OSError:
        return kept
    for name in names:
        if CKPT_RE.match(name) or name.startswith((TRASH_PREFIX, STAGING_PREFIX, BLOBS_DIR)):
            continue
        path = os.path.join(root, name)
        if not os.path.isfile(os.path.join(path, MANIFEST_NAME)) or os.path.islink(path):
            continue
        try:
            kept.update(b.path for b in read_manifest(path).blobs)
        except Exception:  # not a manifest of ours, or damaged: it refers to nothing we keep
            continue
    return kept


def write_blob(
    folder: str,
    key: str,
    t: torch.Tensor,
    *,
    compress: tuple[int, bool] | None = None,
    direct: bool = False,
    bounce: DirectBuffer | None = None,
    rank: int = 0,
) -> FileEntry:
    """Write blob ``key`` (``t``'s bytes) into ``folder`` atomically: a temporary name, fsync,
    rename (over an unreferenced leftover at most). The caller fsyncs ``folder`` before a
    manifest names the blob."""
    from .tensorfile import write_tensors

    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{TMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}")
    meta = {"format": "resilient_callbacks", "part": "blob"}
    try:
        if compress is not None:
            from .compression import write_tensors_compressed

            level, with_shuffle = compress
            d, codec = write_tensors_compressed(
                tmp, {"tensor": t}, meta, level=level, with_shuffle=with_shuffle
            )
        else:
            d = write_tensors(tmp, {"tensor": t}, meta, direct=direct, bounce=bounce)
            codec = ""
        name = blob_name(key, compress)
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return FileEntry(name, d.size, d.xxh3_64, rank, BLOB_KIND, codec)


def stored_intact(folder: str, entry: FileEntry, checked: set[str]) -> bool:
    """Whether blob ``entry`` is in ``folder`` with its size, and its checksum unless its name is
    in ``checked`` (the blobs this process wrote or verified already; it is added there). Says
    so when it is not: the caller writes it again."""
    path = os.path.join(folder, entry.path)
    try:
        ok = os.path.getsize(path) == entry.size
        if ok and entry.path not in checked:
            ok = digest_file(path, like=entry.xxh3_64).xxh3_64 == entry.xxh3_64
    except OSError:
        ok = False
    if ok:
        checked.add(entry.path)
    else:
        log.warning("blob %s is missing or damaged; writing it again", path)
    return ok


class BlobStore:
    """The blob store of one checkpoint directory, as its one writer uses it: what exists (an
    index built from the manifests), pins held by saves in flight, writing and collecting."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dir = store_dir(root)
        self._lock = threading.RLock()
        self._pins: Counter[str] = Counter()
        self._index: dict[str, FileEntry] | None = None
        self._checked: set[str] = set()  # indexed blobs whose checksum this process verified

    # ------------------------------------------------------------------ pins

    def pin(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._pins.subtract(keys)
            self._pins += Counter()  # drop counts <= 0

    @contextlib.contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[None]:
        keys = list(keys)
        self.pin(keys)
        try:
            yield
        finally:
            self.unpin(keys)

    # ------------------------------------------------------------------ lookup

    def _load_index(self) -> dict[str, FileEntry]:
        from .catalog import Depth, scan

        index: dict[str, FileEntry] = {}
        for e in scan(self.root, Depth.NONE):
            if e.manifest is not None:
                for b in e.manifest.blobs:
                    index.setdefault(key_of(b.path), b)
        return index

    def lookup(self, key: str, name: str | None = None) -> FileEntry | None:
        """The entry of a stored blob of ``key`` that a committed manifest names (its checksum
        verified once per process), or one this process wrote; None if there is none. ``name``:
        the file a write would create (if it exists unindexed, the index is re-read first).
        Call with ``key`` pinned."""
        with self._lock:
            if self._index is None:
                self._index = self._load_index()
            entry = self._index.get(key)
            if entry is None and name is not None and os.path.exists(os.path.join(self.dir, name)):
                # on disk but not indexed: a checkpoint committed since the index was built
                # (downloaded from the remote tier) may name it; never write over it blindly
                self._index = self._load_index()
                entry = self._index.get(key)
            if entry is None:
                return None
            if not stored_intact(self.dir, entry, self._checked):
                del self._index[key]
                return None
            return entry

    def has_all(self, keys: Iterable[str]) -> bool:
        return all(self.lookup(k) is not None for k in keys)

    # ------------------------------------------------------------------ write

    def write(
        self,
        key: str,
        t: torch.Tensor,
        *,
        compress: tuple[int, bool] | None = None,
        direct: bool = False,
        bounce: DirectBuffer | None = None,
    ) -> FileEntry:
        """Write blob ``key`` (``t``'s bytes) atomically into the store (:func:`write_blob`).
        The caller fsyncs the store folder (:meth:`sync`) before a manifest names it. Call with
        ``key`` pinned."""
        ensure_dir(self.dir)  # (created: its name durable before a manifest names a blob)
        entry = write_blob(self.dir, key, t, compress=compress, direct=direct, bounce=bounce)
        with self._lock:
            if self._index is not None:
                self._index[key] = entry
            self._checked.add(entry.path)
        return entry

    def sync(self) -> None:
        if os.path.isdir(self.dir):
            fsync_dir(self.dir)

    # ------------------------------------------------------------------ collect

    def collect(self, *, dry_run: bool = False) -> list[str]:
        """Delete every blob (and leftover temporary file) that no committed manifest names and
        no save in flight pinned; return the names. Only the directory's writer calls this."""
        removed: list[str] = []
        with self._lock:
            if os.path.islink(self.dir):
                log.warning(
                    "not deleting unused blobs: %s is a symbolic link, and what it points to "
                    "may hold other files of that name",
                    self.dir,
                )
                return removed
            try:
                names = os.listdir(self.dir)
            except FileNotFoundError:
                return removed
            live = live_blobs(self.root)
            if live is None:
                log.warning(
                    "not deleting unused blobs in %s: a checkpoint's manifest cannot be read, "
                    "so what it refers to is unknown (`resilient-ckpt gc --remove-corrupt` "
                    "removes corrupt checkpoints)",
                    self.dir,
                )
                return removed
            pinned = set(self._pins)
            for name in names:
                if name.startswith(TMP_PREFIX):
                    key = name[len(TMP_PREFIX) :].split("-", 1)[0]
                elif NAME_RE.match(name):
                    key = key_of(name)
                    if name in live:
                        continue
                else:
                    continue  # not ours: leave it
                if key in pinned:
                    continue
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.dir, name))
                    indexed = self._index.get(key) if self._index is not None else None
                    if indexed is not None and indexed.path == name:
                        del self._index[key]  # type: ignore[union-attr]
                    self._checked.discard(name)  # (it grew by every blob ever written)
                removed.append(name)
            if removed and not dry_run:
                fsync_dir(self.dir)
        return removed


@dataclass
class BlobSession:
    """One save's use of the store (coordinator): the replicated tensors of at least
    :data:`BLOB_MIN` bytes become blobs (written only if not stored yet); smaller ones stay in
    the checkpoint's own file. ``hints``: tensor name -> content key of tensors known unchanged
    since an earlier committed save of this process (pinned by :meth:`Saver.prepare`, not
    copied, not hashed). :meth:`end` unpins everything once the save is committed or failed."""

    store: BlobStore
    hints: Mapping[str, str] = field(default_factory=dict)
    compress: tuple[int, bool] | None = None
    direct: bool = False
    bounce: DirectBuffer | None = None
    keys: dict[str, str] = field(default_factory=dict)  # tensor name -> content key
    written: int = 0  # bytes of the blobs this save wrote
    reused: int = 0  # blobs referenced without writing
    _pinned: list[str] = field(default_factory=list)

    def split(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], list[FileEntry]]:
        """``(inline tensors, {tensor name: blob name}, blob entries)``."""
        inline: dict[str, torch.Tensor] = {}
        refs: dict[str, str] = {}
        entries: dict[str, FileEntry] = {}
        new = False
        for name in sorted(set(tensors) | set(self.hints)):
            key = self.hints.get(name)
            if key is None:
                t = tensors[name]
                if t.numel() * t.element_size() < BLOB_MIN:
                    inline[name] = t
                    continue
                key = content_key(t)
                self.store.pin([key])
                self._pinned.append(key)
            entry = self.store.lookup(key, blob_name(key, self.compress))
            if entry is None:
                if name in self.hints:  # pinned and checked by prepare: it cannot vanish
                    raise CheckpointCorruptError(f"the stored copy of {name!r} disappeared")
                entry = self.store.write(
                    key,
                    tensors[name],
                    compress=self.compress,
                    direct=self.direct,
                    bounce=self.bounce,
                )
                self.written += entry.size
                new = True
            else:
                self.reused += 1
            self.keys[name] = key
            refs[name] = entry.path
            entries[entry.path] = entry
        if new:
            self.store.sync()
        return inline, refs, list(entries.values())

    def end(self) -> None:
        self.store.unpin(self._pinned)
        self._pinned.clear()
