"""A safetensors file's header, and a whole small file read and verified, without torch
(moved from :mod:`.tensorfile`): ``resilient-ckpt inspect`` names a checkpoint's tensors from
their headers, and reads a ZeroPart's JSON indexes, without importing torch."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from .checksum import WRITTEN, FileHasher, hasher_for, segment_size
from .dtype_codes import dtype_name
from .errors import CheckpointCorruptError, ConfigError
from .filewrite import CHUNK, FileDigest


def _checked_size(path: str, expect: FileDigest | None) -> int:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: file listed in the manifest is missing") from None
    if expect is not None and size != expect.size:
        raise CheckpointCorruptError(
            f"{path}: size {size} bytes, manifest says {expect.size} (truncated or overwritten)"
        )
    return size


def _scheme(path: str, expect: FileDigest | None) -> str:
    """The checksum ``expect`` holds (the scheme to verify in), or the writers' scheme."""
    if expect is None:
        return WRITTEN
    try:
        segment_size(expect.xxh3_64)
    except ValueError as e:
        raise CheckpointCorruptError(f"{path}: {e} in the manifest") from None
    return expect.xxh3_64


def _hasher(path: str, expect: FileDigest | None) -> FileHasher:
    return hasher_for(_scheme(path, expect))


def _check_digest(path: str, got: str, expect: FileDigest | None) -> None:
    if expect is not None and got != expect.xxh3_64:
        raise CheckpointCorruptError(
            f"{path}: checksum mismatch (xxh3_64 {got}, manifest says {expect.xxh3_64}): "
            "the bytes read are not the ones written (damaged or overwritten since)"
        )


def read_verified(path: str, expect: FileDigest | None) -> bytearray:
    """Read a whole file, checking its size and checksum against ``expect``."""
    size = _checked_size(path, expect)
    buf = bytearray(size)
    hasher = _hasher(path, expect)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos : min(size, pos + CHUNK)])
            if not n:
                raise CheckpointCorruptError(f"{path}: file shrank while being read")
            hasher.update(view[pos : pos + n])
            pos += n
    _check_digest(path, hasher.hexdigest(), expect)
    return buf


def parse_header(
    buf: bytes | bytearray | memoryview, path: str = "<buffer>"
) -> tuple[dict[str, Any], int]:
    if len(buf) < 8:
        raise CheckpointCorruptError(f"{path}: too short to be a safetensors file")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    if hlen > len(buf) - 8:
        raise CheckpointCorruptError(f"{path}: header length {hlen} exceeds the file size")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]))
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(
            f"{path}: unreadable safetensors header: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + hlen


def header_bytes(f: Any, where: str) -> bytearray:
    """The length prefix and JSON header of a safetensors stream ``f`` (a file, or a
    decompressing reader), read from its start and nothing more."""
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointCorruptError(f"{where}: too short to be a safetensors file")
    (hlen,) = struct.unpack("<Q", head)
    if hlen > 100 << 20:
        raise CheckpointCorruptError(f"{where}: implausible header length {hlen}")
    return bytearray(head + f.read(hlen))


def tensor_meta(path_or_buf: str | bytearray) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` from a safetensors header, reading only the header."""
    if isinstance(path_or_buf, str):
        with open(path_or_buf, "rb") as f:
            buf = header_bytes(f, path_or_buf)
        header, _ = parse_header(buf, path_or_buf)
    else:
        header, _ = parse_header(path_or_buf)
    try:
        return {
            k: (dtype_name(v["dtype"]), [int(d) for d in v["shape"]])
            for k, v in header.items()
            if k != "__metadata__"
        }
    except (KeyError, TypeError, ValueError) as e:
        where = path_or_buf if isinstance(path_or_buf, str) else "a tensor file"
        raise CheckpointCorruptError(
            f"{where}: malformed safetensors header ({type(e).__name__}: {e})"
        ) from None


def zstd() -> Any:
    """The ``zstandard`` module, or a :class:`ConfigError` naming the extra to install (moved
    from :mod:`.compression`)."""
    try:
        import zstandard
    except ImportError:
        raise ConfigError(
            "compression='zstd'/'auto' needs the zstandard package, which is not installed: "
            "pip install 'resilient-callbacks[zstd]' (or compression='none')"
        ) from None
    return zstandard


def compressed_meta(path: str) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` of a compressed tensor file, decompressing only its header."""
    with open(path, "rb") as f, zstd().ZstdDecompressor().stream_reader(f) as r:
        return tensor_meta(header_bytes(r, path))
