"""Safetensors files written and read in one pass, with the checksum computed on the way.

The files are standard safetensors (any safetensors reader opens them): an 8-byte little-endian
header length, a JSON header, then the raw bytes of each tensor, back to back. Writing streams
each tensor's bytes to the file and into the file's checksum (:mod:`.checksum`; small tensors
gathered into one write and one hash call, :mod:`.filewrite`), then fsyncs;
reading either maps the file and verifies the mapping (several threads, one per segment), or
reads each tensor's bytes straight into a freshly allocated tensor while hashing them; the
caller loads nothing until size and checksum matched. Nothing here uses pickle.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch

from . import mapped
from .checksum import (
    FileHasher,
    digest_view,
    in_page_cache,
)
from .dtypes import DTYPE_TO_ST, ST_TO_DTYPE, unsupported
from .errors import CheckpointCorruptError, UnsupportedStateError
from .filewrite import (
    CHUNK,
    SMALL,
    Coalesced,
    DirectBuffer,
    FileDigest,
    open_direct,
    write_all,
    write_direct,
)
from .readahead import MappedPrefetch, Readahead
from .tensor_headers import _check_digest, _checked_size, _hasher, _scheme, parse_header

# Restored tensors start at addresses aligned as torch's CPU allocator aligns them: CPU kernels
# round reductions by alignment (LBFGS's dot products), and a resume must compute the same bits.
ALIGN = 64


def new_hasher() -> FileHasher:
    """The hasher of files being written (see :mod:`.checksum`)."""
    return FileHasher()


def _as_bytes(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def lay_out(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[list[str], bytes, int]:
    """The layout of a safetensors file of ``tensors``: the names in file order, the file's head
    (the 8-byte header length and the JSON header, padded with spaces to a multiple of 8) and
    the number of data bytes after it. The head is padded to a multiple of :data:`ALIGN` and
    tensors whose size is a multiple of it come first, so (nearly) every byte of a file lies in
    a tensor that a mapping of it views at an aligned address; the rest follow by element size,
    each aligned to its own. Raises :class:`UnsupportedStateError` for a dtype safetensors
    cannot store."""
    if "__metadata__" in tensors:
        raise ValueError("'__metadata__' is reserved by safetensors and cannot name a tensor")
    for name, t in tensors.items():
        if t.dtype not in DTYPE_TO_ST:
            raise UnsupportedStateError(unsupported(f"tensor {name!r}", t.dtype))
    order = sorted(
        tensors, key=lambda k: (tensors[k].nbytes % ALIGN != 0, -tensors[k].element_size(), k)
    )
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-(8 + len(hbytes)) % ALIGN)
    return order, struct.pack("<Q", len(hbytes)) + hbytes, offset


DIRECT_MIN = 8 << 20  # smaller files: buffered writes cost nothing worth avoiding


def write_tensors(
    path: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
    direct: bool = False,
    bounce: DirectBuffer | None = None,
) -> FileDigest:
    """Write ``tensors`` as a safetensors file at ``path``; return its size and checksum.

    ``direct=True`` writes with ``O_DIRECT`` where the filesystem allows it (bypassing the page
    cache: no kernel copy, no dirty-page writeback competing with training for the CPUs; used
    by background saves), else as usual. The bytes pass through ``bounce`` (one
    :class:`DirectBuffer` reused by every save) or, without one, a buffer made for this call."""
    order, head, data_size = lay_out(tensors, metadata)
    if direct and data_size >= DIRECT_MIN:
        fd = open_direct(path)
        if fd is not None:
            bodies = [_as_bytes(tensors[n]) for n in order]
            return write_direct(fd, [head], bodies, fsync, bounce or DirectBuffer())
    hasher = new_hasher()
    size = 0
    with open(path, "wb", buffering=0) as f:
        small = Coalesced(f, hasher)
        small.put(memoryview(head))
        for name in order:
            mv = _as_bytes(tensors[name])
            size += len(mv)
            if len(mv) < SMALL:
                small.put(mv)
                continue
            small.flush()
            for start in range(0, len(mv), CHUNK):
                piece = mv[start : start + CHUNK]
                write_all(f, piece)
                hasher.update(piece)
        small.flush()
        if fsync:
            os.fsync(f.fileno())
    return FileDigest(len(head) + size, hasher.hexdigest())


def _layout(
    header: dict[str, Any], data_start: int, size: int, path: str
) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """The tensors of a safetensors header in file order, validated: known dtypes, offsets that
    match the shapes and cover the data region exactly, with no gap and nothing after."""
    out = []
    pos = 0
    try:
        entries = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"),
            key=lambda kv: int(kv[1]["data_offsets"][0]),
        )
        for name, info in entries:
            dtype = ST_TO_DTYPE.get(info["dtype"])
            if dtype is None:
                raise CheckpointCorruptError(
                    f"{path}: tensor {name!r} has unknown dtype {info['dtype']}"
                )
            start, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            numel = 1
            for d in shape:
                numel *= d
            if start != pos or end - start != numel * dtype.itemsize or data_start + end > size:
                raise CheckpointCorruptError(f"{path}: tensor {name!r} has inconsistent offsets")
            out.append((name, dtype, shape, start, end))
            pos = end
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{path}: malformed safetensors header ({type(e).__name__}: {e})"
        ) from None
    if data_start + pos != size:
        raise CheckpointCorruptError(
            f"{path}: {size - data_start - pos} bytes after the last tensor"
        )
    return out


def read_tensors_verified(
    path: str, expect: FileDigest | None, metadata: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """Read a safetensors file straight into one freshly allocated tensor per entry (no
    intermediate buffer, no later copy), hashing every byte on the way; raise
    :class:`CheckpointCorruptError` if size or checksum differ from ``expect``. The tensors are
    private: callers may keep them. ``metadata``: filled with the header's ``__metadata__``."""
    size = _checked_size(path, expect)
    hasher = _hasher(path, expect)
    with open(path, "rb", buffering=0) as f, Readahead(f.fileno(), size) as ahead:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointCorruptError(f"{path}: too short to be a safetensors file")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > size - 8:
            raise CheckpointCorruptError(f"{path}: header length {hlen} exceeds the file size")
        hbytes = f.read(hlen)
        hasher.update(head)
        hasher.update(hbytes)
        header, data_start = parse_header(head + hbytes, path)
        out: dict[str, torch.Tensor] = {}
        pos = data_start
        for name, dtype, shape, start, end in _layout(header, data_start, size, path):
            t = torch.empty(shape, dtype=dtype)
            nbytes = end - start
            if nbytes:
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                for off in range(0, nbytes, CHUNK):
                    ahead.advance(pos)
                    piece = view[off : off + CHUNK]
                    got = f.readinto(piece)
                    if got != len(piece):
                        raise CheckpointCorruptError(f"{path}: file shrank while being read")
                    hasher.update(piece)
                    pos += got
            out[name] = t
    _check_digest(path, hasher.hexdigest(), expect)
    _fill_metadata(header, metadata, path)
    return out


def map_tensors_verified(
    path: str, expect: FileDigest | None, metadata: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """Map a safetensors file privately (copy-on-write: the file is never written), hash every
    byte of the mapping, and return tensors that view it: no read buffer and no copy. Loading
    into live objects then copies once (``load_state_dict``), and objects that keep the tensors
    (optimizers) keep mapped pages that are copied only when written.

    Falls back to :func:`read_tensors_verified` where the file cannot be mapped. ``metadata``:
    filled with the header's ``__metadata__``."""
    size = _checked_size(path, expect)
    scheme = _scheme(path, expect)
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # a file that cannot be mapped (or is empty)
            return read_tensors_verified(path, expect, metadata)
        mapped.register(mm, path)  # objects that keep tensors get copies (mapped.private)
        cached = in_page_cache(f.fileno(), size)
    # A file in the page cache: its segments are hashed by several threads (checksum.py). One
    # coming from the disk: one thread hashes, helper threads fault the mapping in ahead of it.
    with memoryview(mm) as view, MappedPrefetch(mm, 0 if cached else size) as ahead:
        hashed = _Dropper(mm)

        def progress(offset: int) -> None:
            ahead.advance(offset)
            hashed.upto(offset)

        got = digest_view(view, scheme, parallel=cached, progress=progress)
        _check_digest(path, got, expect)
        header, data_start = parse_header(view[: min(size, 8 + (100 << 20))], path)
    hashed.upto(size)
    _fill_metadata(header, metadata, path)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, start, end in _layout(header, data_start, size, path):
        if end == start:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - start, offset=data_start + start)
        if (data_start + start) % ALIGN:
            raw = raw.clone()  # a small tensor's tail, or a file from another writer (see ALIGN)
        out[name] = raw.view(dtype).reshape(shape)
    return out


class _Dropper:
    """Drops the pages of a mapping nothing has written yet from the resident set, front to back
    as they are hashed (``MADV_DONTNEED``: they stay in the page cache; loading faults the same
    bytes back in). Verifying a file otherwise left all of it resident (:mod:`.mapped`)."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm, self.done = mm, 0

    def upto(self, offset: int) -> None:
        end = min(offset, len(self.mm)) // mmap.PAGESIZE * mmap.PAGESIZE
        if offset >= len(self.mm):
            end = len(self.mm)
        if end <= self.done or not hasattr(mmap, "MADV_DONTNEED"):
            return
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, self.done, end - self.done)
        except (OSError, ValueError):  # pragma: no cover - only an optimisation
            return
        self.done = end


def _fill_metadata(header: dict[str, Any], out: dict[str, str] | None, path: str) -> None:
    if out is None:
        return
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{path}: malformed safetensors metadata")
    out.update({str(k): str(v) for k, v in meta.items()})
