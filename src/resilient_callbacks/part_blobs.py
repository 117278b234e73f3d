"""Incremental saving of FileParts' files (``incremental=True`` with DCP shards or ZeRO
partitions in the state): each rank's part tensors of at least :data:`~.blobs.BLOB_MIN` bytes
are stored as blobs, like the replicated tensors (:mod:`.blobs`), so that a frozen base model
under FSDP, tensor parallelism or ZeRO (a LoRA fine-tune) is written once per run, not at every
save.

Where a rank's blobs go. Only the coordinator collects the store, and only it knows the pins of
its saves in flight, so the other ranks must neither write into the store nor trust what it
held a moment ago:

- A blob a save has to write goes into the staging directory, ``<staging>/blobs/<name>``. At
  commit the coordinator moves the staged blobs into the store before it writes the manifest
  (:func:`promote_staged`) and refuses to commit a manifest that names a blob the store lacks.
- A blob is referenced without being written only when the newest checkpoint this process
  committed, or the one it restored from, names it: nothing deletes it before the next commit,
  which names it too (retention keeps the newest checkpoint and protects the restored one, and
  the store is collected only after a commit or at that restore). Its size in the store is
  checked at every reuse, and its checksum once per process unless this process wrote it.

With ``incremental=True`` a tensor the part's tracker knows unchanged
(:class:`~.unchanged.PartTracker`) is not copied: its host buffer still holds its bytes, and
its content key comes with it (``hints``), so it is not hashed either.

A part's tensor file holds its small tensors; its safetensors metadata maps each tensor stored
as a blob to the blob's name (``"blobs"``, JSON), covered by the file's checksum.
:func:`~.part_reads.read_part_tensors` resolves them through the manifest's list of blobs,
each verified.

Which ranks call what: every rank has its own :class:`PartBlobs` (in its Saver) and, for each
save, a :class:`PartBlobSession` used by the thread that writes that rank's files; every rank
reports its blob entries (kind ``"blob"``) with its files; :func:`promote_staged` runs on the
coordinator inside the commit.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .blobs import (
    BLOB_MIN,
    BLOBS_DIR,
    TMP_PREFIX,
    blob_name,
    content_key,
    key_of,
    stored_intact,
    write_blob,
)
from .commit import ensure_dir, fsync_dir
from .errors import CheckpointCorruptError, CheckpointWriteError
from .filewrite import digest_file
from .manifest import FileEntry, Manifest
from .tensorfile import DirectBuffer
from .unchanged import Sig, buffer_sig

REFS_KEY = "blobs"  # a part file's safetensors metadata: {tensor name: blob name}, as JSON


class PartBlobs:
    """One rank's memory of which blobs its next save may reference without writing them."""

    def __init__(self, root: str) -> None:
        self.store = os.path.join(root, BLOBS_DIR)
        self._known: dict[str, FileEntry] = {}  # content key -> entry, reusable
        self._checked: set[str] = set()  # blob names whose bytes this process wrote or verified

    def session(
        self,
        staging: str,
        rank: int,
        *,
        compress: tuple[int, bool] | None = None,
        direct: bool = False,
        bounce: DirectBuffer | None = None,
        hints: Mapping[Sig, str] | None = None,
    ) -> PartBlobSession:
        return PartBlobSession(self, staging, rank, compress, direct, bounce, dict(hints or {}))

    def committed(self, session: PartBlobSession, manifest: Manifest | None = None) -> None:
        """This rank's save through ``session`` is committed: it is now the newest checkpoint,
        and the blobs it names are the ones the next save may reference. ``manifest``: the
        committed one, whose entries win (:func:`promote_staged` may have kept the stored copy
        of a blob this rank staged, with other bytes)."""
        entries = dict(session.entries)
        if manifest is not None:
            recorded = {b.path: b for b in manifest.blobs}
            entries = {n: recorded.get(n, e) for n, e in entries.items()}
        self._known = {key_of(e.path): e for e in entries.values()}
        self._checked.update(
            n for n in session.written_names if _same(entries[n], session.entries[n])
        )
        self._forget_unknown()

    def restored(self, manifest: Manifest) -> None:
        """The run resumed from a checkpoint of this directory: its blobs may be referenced."""
        self._known = {key_of(b.path): b for b in manifest.blobs}
        self._forget_unknown()

    def _forget_unknown(self) -> None:
        """Only blobs the next save may reference need remembering as checked (the set grew
        by every blob ever written: memory over a long run)."""
        names = {e.path for e in self._known.values()}
        self._checked &= names

    def reusable(self, key: str, name: str) -> FileEntry | None:
        """The stored blob ``name`` of ``key`` if the next save may reference it, else None."""
        entry = self._known.get(key)
        if entry is None or entry.path != name:
            return None
        if not stored_intact(self.store, entry, self._checked):
            del self._known[key]
            return None
        return entry


@dataclass
class PartBlobSession:
    """One save's blobs of one rank's FileParts (see the module docstring)."""

    blobs: PartBlobs
    staging: str
    rank: int
    compress: tuple[int, bool] | None = None
    direct: bool = False
    bounce: DirectBuffer | None = None
    hints: dict[Sig, str] = field(default_factory=dict)  # host copies known unchanged -> key
    keys: dict[Sig, str] = field(default_factory=dict)  # every host copy stored as a blob -> key
    entries: dict[str, FileEntry] = field(default_factory=dict)  # blob name -> entry
    written_names: set[str] = field(default_factory=set)
    written: int = 0  # bytes of the blobs this save wrote

    def split(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``(tensors kept in the part's file, {tensor name: blob name})``; the blobs not stored
        yet are written into the staging directory."""
        inline: dict[str, torch.Tensor] = {}
        refs: dict[str, str] = {}
        staged = False
        for name in sorted(tensors):
            t = tensors[name]
            if t.numel() * t.element_size() < BLOB_MIN:
                inline[name] = t
                continue
            sig = buffer_sig(t)
            key = self.hints.get(sig) or content_key(t)  # a hint: its bytes are not hashed
            self.keys[sig] = key
            bname = blob_name(key, self.compress)
            entry = self.entries.get(bname) or self.blobs.reusable(key, bname)
            if entry is None:
                entry = write_blob(
                    os.path.join(self.staging, BLOBS_DIR),
                    key,
                    t,
                    compress=self.compress,
                    direct=self.direct,
                    bounce=self.bounce,
                    rank=self.rank,
                )
                self.written += entry.size
                self.written_names.add(bname)
                staged = True
            self.entries[bname] = entry
            refs[name] = bname
        if staged:
            fsync_dir(os.path.join(self.staging, BLOBS_DIR))
        return inline, refs


def refs_metadata(refs: Mapping[str, str]) -> dict[str, str]:
    """A part file's safetensors metadata for ``refs`` (nothing when there are none)."""
    return {REFS_KEY: json.dumps(dict(refs), sort_keys=True)} if refs else {}


def parse_refs(meta: Mapping[str, str], where: str) -> dict[str, str]:
    """``{tensor name: blob name}`` from a part file's safetensors metadata."""
    raw = meta.get(REFS_KEY)
    if raw is None:
        return {}
    try:
        refs = json.loads(raw)
    except ValueError:
        refs = None
    if not isinstance(refs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in refs.items()
    ):
        raise CheckpointCorruptError(f"{where}: malformed blob references")
    return refs


def _same(a: FileEntry, b: FileEntry) -> bool:
    return (a.size, a.xxh3_64) == (b.size, b.xxh3_64)


def promote_staged(staging: str, root: str, manifest: Manifest) -> None:
    """Coordinator, at commit, before the manifest is written: move the blobs the ranks staged
    into the run's store, fsync the store, and check that every blob ``manifest`` names is
    there. Raises :class:`CheckpointWriteError` (nothing is committed) for one that is not.

    A name is the hash of the tensor, not of the stored bytes: a compressed blob of the same
    tensor can have other bytes (another zstd version), and the manifests that name it record
    the checksum of the stored bytes. So a stored blob of that name that verifies against a
    committed manifest is never replaced: the staged copy is dropped and ``manifest`` is made
    to name the stored bytes. One no manifest records with its bytes (damaged, or a crash's
    leftover) is replaced."""
    staged = os.path.join(staging, BLOBS_DIR)
    store = os.path.join(root, BLOBS_DIR)
    try:
        names = [n for n in os.listdir(staged) if not n.startswith(TMP_PREFIX)]
    except FileNotFoundError:
        names = []
    if names:
        ensure_dir(store)  # (a new folder: its name durable before a manifest names it)
        recorded: dict[str, list[FileEntry]] | None = None
        for name in names:
            if os.path.exists(os.path.join(store, name)):
                if recorded is None:
                    recorded = _recorded(root)
                kept = _verified(store, name, recorded.get(name, []))
                if kept is not None:  # whole, and older checkpoints name these bytes
                    os.unlink(os.path.join(staged, name))
                    manifest.blobs = [
                        dataclasses.replace(b, size=kept.size, xxh3_64=kept.xxh3_64)
                        if b.path == name
                        else b
                        for b in manifest.blobs
                    ]
                    continue
            os.replace(os.path.join(staged, name), os.path.join(store, name))
        fsync_dir(store)
    if os.path.isdir(staged):
        for left in os.listdir(staged):  # a crashed writer's temporary file
            os.unlink(os.path.join(staged, left))
        os.rmdir(staged)
    missing = [b.path for b in manifest.blobs if not os.path.exists(os.path.join(store, b.path))]
    if missing:
        raise CheckpointWriteError(
            f"the blob store {store} lacks {len(missing)} blob(s) the checkpoint names "
            f"(first: {missing[0]}); was it changed by another process?"
        )


def _recorded(root: str) -> dict[str, list[FileEntry]]:
    """blob name -> the entries the committed manifests of ``root`` record for it."""
    from .catalog import Depth, scan

    out: dict[str, list[FileEntry]] = {}
    for e in scan(root, Depth.NONE):
        for b in e.manifest.blobs if e.manifest is not None else ():
            out.setdefault(b.path, []).append(b)
    return out


def _verified(store: str, name: str, recorded: list[FileEntry]) -> FileEntry | None:
    """The entry of ``recorded`` the stored blob ``name`` matches (size and xxh3-64), or None."""
    path = os.path.join(store, name)
    for b in {(b.size, b.xxh3_64): b for b in recorded}.values():
        try:
            if (
                os.path.getsize(path) == b.size
                and digest_file(path, like=b.xxh3_64).xxh3_64 == b.xxh3_64
            ):
                return b
        except OSError:
            return None
    return None
