"""Checking a checkpoint's files against its manifest: :func:`verify` (every file and blob it
lists present with its size and, at :attr:`Depth.FULL`, its checksum; the first bad one raises
:class:`CheckpointCorruptError` naming it), :func:`verify_entries` for some of them (an uploader
checks the bytes it is about to upload), and :func:`blobs_read_once`, within which a blob that
several checkpoints name is found intact once. :mod:`.catalog` judges each checkpoint it scans
with these (and re-exports them, their old home). Which ranks call what: each caller checks the
files it reads or uploads; ``verify(ranks=...)`` restricts a check to the files those ranks
wrote (the shared files and the blobs are rank 0's), nothing here is collective.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from enum import StrEnum
from functools import partial

from . import checking
from .errors import CheckpointCorruptError
from .filewrite import digest_file
from .layout_meta import SHARED_STRUCTURE, json_object, rank_structure, shared_refs
from .manifest import BLOB_KIND, FileEntry, Manifest


class Depth(StrEnum):
    NONE = "none"  # manifest only
    SIZE = "size"  # + every file present with its size
    FULL = "full"  # + every checksum


def verify(
    path: str, manifest: Manifest, depth: Depth = Depth.FULL, ranks: Iterable[int] | None = None
) -> None:
    """Raise :class:`CheckpointCorruptError` naming the first bad file, or the first blob it
    refers to that is missing or bad. ``ranks`` restricts the check to the files those ranks
    wrote (the shared files and the blobs are written by rank 0)."""
    wanted = None if ranks is None else set(ranks)
    checking.reading(path, manifest, every_checksum=depth is Depth.FULL)  # (the CLI says so)
    entries = [*manifest.files, *manifest.blobs]
    verify_entries(path, [f for f in entries if wanted is None or f.rank in wanted], depth)
    if depth is not Depth.NONE and (wanted is None or 0 in wanted):
        verify_structure(path, manifest)
    if depth is Depth.FULL:  # (at SIZE, as in every save's retention pass: sizes only)
        verify_rank_structures(path, manifest, wanted)


def verify_structure(path: str, manifest: Manifest) -> None:
    """Raise :class:`CheckpointCorruptError` when the checkpoint's shared structure file (if
    its manifest lists one) is no JSON object, names no structure or holds malformed blob
    references: every checksum may match, yet no restore can load it. Reads that one small
    file, no tensor."""
    entry = next((f for f in manifest.files if f.path == SHARED_STRUCTURE), None)
    if entry is None:
        return  # (a checkpoint of dcp.save, a node's part without the shared files)
    where = os.path.join(path, SHARED_STRUCTURE)
    try:
        with open(where, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where}: listed in the manifest but missing") from None
    try:
        shared_refs(json_object(raw, where), path)
    except CheckpointCorruptError:
        _as_checksum(where, entry)
        raise


def verify_rank_structures(path: str, manifest: Manifest, ranks: set[int] | None = None) -> None:
    """Raise :class:`CheckpointCorruptError` when a per-rank structure file the manifest lists
    (``rank_<r>.json``, of ``ranks`` or of all) is missing, no JSON object, or not rank ``r``'s
    (its ``rank``, ``per_rank`` and ``rng`` malformed): the restore of that rank would fail on
    it, whatever its checksum. Reads those small files, no tensor: one per rank, so only
    :func:`verify` at :attr:`Depth.FULL` calls it (a check of sizes alone, ``ls --fast``, every
    save's retention pass, reads the one shared structure file, not a file per rank). A
    manifest of this layout that lists none for a rank that saved is corrupt too (see
    :func:`_unlisted_rank`)."""
    missing = _unlisted_rank(manifest, ranks)
    if missing is not None:
        raise CheckpointCorruptError(
            f"{os.path.join(path, 'manifest.json')}: lists no {rank_structure(missing)} although "
            f"rank {missing} of the {manifest.world_size} that saved it wrote one: the restore "
            f"of rank {missing} cannot load it (a manifest edited or written by another tool?). "
            "Resume from another checkpoint, or delete this one (resilient-ckpt gc "
            "--remove-corrupt)"
        )
    for entry in manifest.files:
        if entry.path != rank_structure(entry.rank) or (
            ranks is not None and entry.rank not in ranks
        ):
            continue
        where = os.path.join(path, entry.path)
        try:
            with open(where, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where}: listed in the manifest but missing") from None
        try:
            doc = json_object(raw, where)
            if doc.get("rank", entry.rank) != entry.rank:
                raise CheckpointCorruptError(
                    f"{where}: the structure of rank {doc.get('rank')!r}, not of rank {entry.rank}"
                )
            if not isinstance(doc.get("per_rank") or {}, dict) or not isinstance(
                doc.get("rng") or {}, dict
            ):
                raise CheckpointCorruptError(f"{where}: malformed per-rank state or RNG states")
        except CheckpointCorruptError:
            _as_checksum(where, entry)
            raise


def _unlisted_rank(manifest: Manifest, ranks: set[int] | None) -> int | None:
    """The first rank (of ``ranks``, or of all) whose ``rank_<r>.json`` a manifest of the
    Checkpointer's layout (it lists ``shared.json`` and a ``rank_<r>.json``) should list and
    does not: every rank of its ``world_size`` writes one (layout.py), or, for one node's part
    in node-local mode, every rank its ``extra["node"]["ranks"]`` names below ``world_size``
    (a node lists only its own ranks, and rank 0's when it downloaded them for a rank the save
    did not have). Other writers (``dcp.save`` through ``ResilientStorageWriter``, a user's
    ``CommitSession``) list no ``shared.json``: nothing is expected of them."""
    listed = {f.rank for f in manifest.files if f.path == rank_structure(f.rank)}
    if not listed or not any(f.path == SHARED_STRUCTURE for f in manifest.files):
        return None
    node = manifest.extra.get("node")
    if isinstance(node, dict):
        expected = {r for r in node.get("ranks") or () if isinstance(r, int)}
    else:
        expected = set(range(manifest.world_size))
    expected = {r for r in expected if 0 <= r < manifest.world_size}
    if ranks is not None:
        expected &= ranks
    return min(expected - listed, default=None)


def _as_checksum(where: str, entry: FileEntry) -> None:
    """After a check of sizes alone, a structure file that cannot be read is said as what its
    bytes are, where its checksum does not match: a bad checksum (raised); else nothing."""
    problem = _problem(where, entry, Depth.FULL)
    if problem is not None:
        raise CheckpointCorruptError(problem) from None


#: the blobs found intact, while :func:`blobs_read_once` is in effect
_BLOBS_READ: ContextVar[dict[tuple[str, int, str, str], None] | None] = ContextVar(
    "blobs_read", default=None
)


@contextlib.contextmanager
def blobs_read_once() -> Iterator[None]:
    """Within this block (in this thread), a blob that several checkpoints name is read once:
    the checks of :func:`verify` and :func:`~.remote_verify.check_remote` take a blob found
    intact as intact (one found bad is read again, so a repair meanwhile is seen). For one command that checks many checkpoints (``ls``, ``verify
    --all``, ``gc``): a frozen base model that every checkpoint names is read once, not once
    per checkpoint. Never for a long-lived process, which must see a blob that rots later."""
    token = _BLOBS_READ.set({})
    try:
        yield
    finally:
        _BLOBS_READ.reset(token)


def read_blob_once(
    where: str, f: FileEntry, read: Callable[[], str | None], how: str = "full"
) -> str | None:
    """``read()`` (the problem of blob ``f`` at ``where``, or None), or None without reading if
    it found the blob intact before within :func:`blobs_read_once` (``how``: how deep
    ``read`` checks; a size check is never taken for a checksum)."""
    memo = _BLOBS_READ.get()
    if memo is None or f.kind != BLOB_KIND:
        return read()
    key = (where, f.size, f.xxh3_64, how)
    if key in memo:
        return None
    problem = read()
    if problem is None:  # only what was intact: a repair (push) is seen by the next check
        memo[key] = None
    return problem


def verify_entries(path: str, entries: Iterable[FileEntry], depth: Depth = Depth.FULL) -> None:
    """:func:`verify` for some of a checkpoint's files and blobs (an uploader checks the bytes
    it is about to upload: a file that rotted on the local disk after its commit must never be
    committed remotely as durable)."""
    from .blobs import blob_path

    for f in entries:
        full = blob_path(path, f.path) if f.kind == BLOB_KIND else os.path.join(path, f.path)
        problem = read_blob_once(full, f, partial(_problem, full, f, depth), str(depth))
        if problem is not None:
            raise CheckpointCorruptError(problem)


def _problem(full: str, f: FileEntry, depth: Depth) -> str | None:
    """What is wrong with the file ``full`` that the manifest lists as ``f``, or None."""
    try:
        size = os.path.getsize(full)
    except FileNotFoundError:
        return f"{full}: listed in the manifest but missing"
    if size != f.size:
        return f"{full}: size {size} bytes, manifest says {f.size} (truncated or overwritten)"
    if depth is not Depth.FULL:
        return None
    try:
        d = digest_file(full, like=f.xxh3_64)
    except FileNotFoundError:
        return f"{full}: listed in the manifest but missing"
    if d.xxh3_64 != f.xxh3_64:
        return f"{full}: checksum mismatch (xxh3_64 {d.xxh3_64}, manifest says {f.xxh3_64})"
    return None
