"""Verify a checkpoint's copy in a remote store where it lies: every file it lists (and every blob
it refers to) is read as a stream and checked against the manifest -- present, same size, same
checksum -- without a byte written to local disk.

Listing sizes (what ``ls --remote`` and ``push`` compare) finds a missing or torn object; only
reading the bytes finds one of the right size whose content rotted or was overwritten. Runs in
one process: no collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .blobs import BLOBS_DIR
from .catalog import read_blob_once
from .checksum import hasher_for
from .manifest import FileEntry
from .progress import Progress
from .remote import RemoteEntry, RemoteStore

CHUNK = 8 << 20  # bytes read per request: large enough for an object store's throughput


def _objects(st: RemoteStore, entry: RemoteEntry) -> Iterator[tuple[str, str, FileEntry, bool]]:
    """``(fsspec path, URL to name in messages, its manifest entry, is a blob)`` of every
    object the committed ``entry`` lists."""
    assert entry.manifest is not None
    for f in entry.manifest.files:
        yield st._path(entry.name, f.path), f"{st.url}/{entry.name}/{f.path}", f, False
    for b in entry.manifest.blobs:
        yield st._path(BLOBS_DIR, b.path), f"{st.url}/{BLOBS_DIR}/{b.path}", b, True


@dataclass
class Damage:
    """What reading a remote copy found: the first problem, and the blobs found bad (shared
    with other checkpoints, so a repair uploads them again by name)."""

    problem: str | None = None
    bad_blobs: list[str] = field(default_factory=list)


def check_remote(
    st: RemoteStore, entry: RemoteEntry, *, progress: bool | None = None, first_only: bool = True
) -> Damage:
    """Read every object of ``entry`` (committed) and compare it with the manifest: present,
    same size, same checksum. ``first_only``: stop at the first problem. Store errors
    (unreachable, denied) propagate as the store raises them."""
    if entry.manifest is None:
        return Damage(f"{st.url}/{entry.name}: {entry.problem or 'no manifest'}")
    objects = list(_objects(st, entry))
    bar = Progress(
        sum(f.size for _, _, f, _ in objects), f"verifying {entry.name} in {st.url}", bar=progress
    )
    damage = Damage()
    try:
        for path, url, f, blob in objects:
            problem = read_blob_once(path, f, partial(_check, st, path, url, f, bar), "remote")
            if problem is None:
                continue
            damage.problem = damage.problem or problem
            if blob:
                damage.bad_blobs.append(f.path)
            if first_only:
                break
    finally:
        bar.close()
    return damage


def _check(st: RemoteStore, path: str, url: str, f: FileEntry, bar: Progress) -> str | None:
    """The problem of one object, or None."""
    try:
        size = int(st.fs.size(path))
    except FileNotFoundError:
        return f"{url}: listed in the manifest but missing"
    if size != f.size:
        return f"{url}: size {size} bytes, manifest says {f.size} (truncated or overwritten)"
    hasher = hasher_for(f.xxh3_64)
    read = 0
    with st.fs.open(path, "rb", block_size=CHUNK) as fh:
        while True:
            chunk: Any = fh.read(CHUNK)
            if not chunk:
                break
            hasher.update(chunk)
            read += len(chunk)
            bar.update(len(chunk))
    if read != f.size:  # changed while it was read
        return f"{url}: read {read} bytes, manifest says {f.size}"
    got = hasher.hexdigest()
    if got != f.xxh3_64:
        return (
            f"{url}: checksum mismatch (xxh3_64 {got}, manifest says {f.xxh3_64}): its content "
            "is not what was saved"
        )
    return None
