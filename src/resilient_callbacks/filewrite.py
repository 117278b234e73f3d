"""The write side of tensor files: whole buffers handed to the kernel, hashed once each.

Small pieces (the bytes of small tensors, a file's head) are gathered into one buffer and
written and hashed together (:class:`Coalesced`); background saves of large files write with
``O_DIRECT`` through one reused page-aligned buffer (:class:`DirectBuffer`,
:func:`write_direct`), hashing each full buffer once. Either way the bytes and their order are
those of the pieces, and the checksum is the one :class:`~.checksum.FileHasher` gives for them
fed in any cut (it streams).
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from typing import Any

from .checksum import FileHasher, digest_path
from .errors import CheckpointCorruptError

CHUNK = 16 << 20  # bytes per write/hash call


@dataclass(frozen=True)
class FileDigest:
    size: int
    xxh3_64: str


def digest_file(path: str, like: str | None = None) -> FileDigest:
    """Size and checksum of the file at ``path``, in the scheme of the checksum ``like`` (a
    manifest's, to compare with it), else in the scheme files are written in."""
    try:
        size, digest = digest_path(path, like)
    except ValueError as e:  # a scheme this version does not know
        raise CheckpointCorruptError(f"{path}: {e} in the manifest") from None
    return FileDigest(size, digest)


SMALL = 64 << 10  # tensors of fewer bytes are gathered into one write (and one hasher call)
COALESCE = 1 << 20  # the buffer they are gathered in


class Coalesced:
    """Consecutive small pieces of a file gathered into one buffer, written and hashed once
    per :data:`COALESCE` bytes: a state of 20,000 small tensors made 20,000 ``write`` calls
    and as many hasher calls per file. The bytes and their order are unchanged."""

    def __init__(self, f: Any, hasher: FileHasher) -> None:
        self.f, self.hasher = f, hasher
        self.buf = bytearray(COALESCE)  # (1 MiB per file written: nothing to keep between files)
        self.fill = 0

    def put(self, mv: memoryview) -> None:
        if self.fill + len(mv) > len(self.buf):
            self.flush()
        if len(mv) > len(self.buf):  # (a head larger than the buffer)
            write_all(self.f, mv)
            self.hasher.update(mv)
            return
        self.buf[self.fill : self.fill + len(mv)] = mv
        self.fill += len(mv)

    def flush(self) -> None:
        if self.fill:
            view = memoryview(self.buf)[: self.fill]
            write_all(self.f, view)
            self.hasher.update(view)
            self.fill = 0


DIRECT_ALIGN = 4096


def open_direct(path: str) -> int | None:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
        return None


class DirectBuffer:
    """The page-aligned bounce buffer O_DIRECT writes go through, allocated and touched once:
    a Checkpointer keeps one for all its background saves (one persist runs at a time), so
    saves after the first allocate no memory."""

    def __init__(self, size: int = CHUNK) -> None:
        self.mm = mmap.mmap(-1, size)  # anonymous mappings are page aligned
        for off in range(0, size, mmap.PAGESIZE):
            self.mm[off] = 0  # fault every page in now, not during the first write


def write_direct(
    fd: int, head: list[bytes], bodies: list[memoryview], fsync: bool, bounce: DirectBuffer
) -> FileDigest:
    """Stream ``head`` then ``bodies`` through the page-aligned ``bounce`` buffer with O_DIRECT
    writes of whole aligned blocks; the padded tail is truncated away at the end."""
    hasher = FileHasher()
    view = memoryview(bounce.mm)[:CHUNK]
    fill = size = 0
    try:

        def flush(n: int, padded: int) -> None:
            hasher.update(view[:n])  # once per buffer, not once per (small) tensor
            data = view[:padded]
            while len(data):
                k = os.write(fd, data)
                if k <= 0:  # pragma: no cover - raw writes return the count or raise
                    raise OSError("short write")
                data = data[k:]

        for piece in [*(memoryview(h) for h in head), *bodies]:
            size += len(piece)
            while len(piece):
                k = min(len(piece), CHUNK - fill)
                view[fill : fill + k] = piece[:k]
                fill += k
                piece = piece[k:]
                if fill == CHUNK:
                    flush(CHUNK, CHUNK)
                    fill = 0
        if fill:
            flush(fill, fill + (-fill % DIRECT_ALIGN))  # O_DIRECT writes whole blocks
            os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)  # the truncation's metadata, and the file's
    finally:
        view.release()
        os.close(fd)
    return FileDigest(size, hasher.hexdigest())


def write_all(f: Any, data: memoryview) -> None:
    while len(data):
        n = f.write(data)
        if n is None or n <= 0:  # pragma: no cover - raw files return the count or raise
            raise OSError("short write")
        data = data[n:]


#: documents that encode to more bytes than this are written on one line, without indentation
INDENT_MAX = 64 << 10


def encode_json(obj: Any) -> bytes:
    """The bytes :func:`write_json` writes for ``obj``: indented (one space) when that is small
    enough to read, else on one line. Only ``json.dumps`` without ``indent`` runs in C: the
    structure of 20,000 tensors (``shared.json``, an entry per tensor) took 0.056 s in
    Python's encoder against 0.015 s. Readers parse either; checksums are of the bytes
    written."""
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    if len(data) > INDENT_MAX:
        return data.encode("utf-8")
    return json.dumps(obj, indent=1, sort_keys=False, allow_nan=False).encode("utf-8")


def write_json(path: str, obj: Any, *, fsync: bool = True) -> FileDigest:
    return write_bytes(path, encode_json(obj), fsync=fsync)


def write_bytes(path: str, data: bytes, *, fsync: bool = True) -> FileDigest:
    """Write ``data`` as the whole file ``path`` (fsynced unless ``fsync=False``)."""
    with open(path, "wb", buffering=0) as f:
        write_all(f, memoryview(data))
        if fsync:
            os.fsync(f.fileno())
    h = FileHasher()  # the hasher of files being written
    h.update(data)
    return FileDigest(len(data), h.hexdigest())
