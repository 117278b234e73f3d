"""Optional zstd compression of tensor files, with a byte-shuffle for multi-byte dtypes, and the
``"auto"`` choice that turns it on only where it pays.

A compressed tensor file is one zstd frame (content size and zstd's own checksum included) of
the safetensors bytes the uncompressed writer would write, except that with the shuffle each
tensor's data is byte-shuffled in blocks of :data:`SHUFFLE_BLOCK` bytes: the first byte of
every element, then every second byte, ... (bf16/fp16/fp32 exponents line up and compress).
Its name ends in ``.zst`` and its manifest entry has ``"codec": "zstd"`` or
``"zstd+shuffle"``; the manifest's size and xxh3-64 are those of the compressed file on disk,
so integrity checks read the stored bytes exactly as for an uncompressed file.

``zstandard`` is an optional extra (``pip install 'resilient-callbacks[zstd]'``), imported only
when compression is used; without it a clear :class:`~.errors.ConfigError` names the extra.

The ``"auto"`` rule (:func:`worth_compressing`): compressing wins when the time to compress
plus the time to move the smaller bytes through every sink (the local disk, and the upload
where there is a remote tier) is below the time to move the raw bytes: ``1/C + r * sum(1/S) <
margin * sum(1/S)`` for compression throughput ``C``, ratio ``r`` (stored/raw) and sink
throughputs ``S``. No overlap of compression and writing is assumed (conservative).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import CheckpointCorruptError, ConfigError
from .tensor_headers import header_bytes, parse_header, zstd
from .tensorfile import (
    CHUNK,
    FileDigest,
    _as_bytes,
    _layout,
    lay_out,
    new_hasher,
)

SUFFIX = ".zst"
SHUFFLE_BLOCK = 16 << 20  # a multiple of every element size (and the write chunk)
CODECS = ("zstd", "zstd+shuffle")
MODES = ("none", "zstd", "auto")
SAMPLE_BYTES = 32 << 20  # what "auto" compresses to measure throughput and ratio


def check_options(mode: Any, level: Any, shuffle: Any) -> None:
    """Validate ``compression``, ``compression_level`` and ``compression_shuffle``."""
    if mode not in MODES:
        raise ConfigError(
            f"compression={mode!r}: use 'none' (default), 'zstd', or 'auto' (zstd only where "
            "the measured compression throughput beats the disk/upload throughput)"
        )
    if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
        raise ConfigError(
            f"compression_level={level!r}: a zstd level, an int from -7 (fastest) to 22 "
            "(smallest); 1..3 suit checkpoints"
        )
    if not isinstance(shuffle, bool):
        raise ConfigError(f"compression_shuffle={shuffle!r}: must be True or False")
    if mode != "none":
        zstd()


def _threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def compressor(level: int) -> Any:
    return zstd().ZstdCompressor(
        level=level, threads=_threads(), write_checksum=True, write_content_size=True
    )


# ------------------------------------------------------------------------------ shuffle


def shuffle(mv: memoryview, itemsize: int) -> memoryview:
    """The bytes of ``mv`` byte-shuffled block by block (a new buffer; ``mv`` is untouched)."""
    if itemsize == 1 or not len(mv):
        return mv
    src = np.frombuffer(mv, dtype=np.uint8)
    out = np.empty_like(src)
    for start in range(0, len(src), SHUFFLE_BLOCK):
        block = src[start : start + SHUFFLE_BLOCK]
        out[start : start + len(block)] = block.reshape(-1, itemsize).T.reshape(-1)
    return memoryview(out)  # type: ignore[arg-type]


def unshuffle_(buf: np.ndarray, itemsize: int) -> None:
    """Undo :func:`shuffle` in place on ``buf`` (a uint8 array)."""
    if itemsize == 1:
        return
    for start in range(0, len(buf), SHUFFLE_BLOCK):
        block = buf[start : start + SHUFFLE_BLOCK]
        block[:] = block.copy().reshape(itemsize, -1).T.reshape(-1)


# ------------------------------------------------------------------------------ write / read


class _HashingWriter:
    """A file object that hashes what goes to disk (the compressed bytes)."""

    def __init__(self, f: Any) -> None:
        self.f, self.hasher, self.size = f, new_hasher(), 0

    def write(self, data: Any) -> int:
        mv = memoryview(data)
        while len(mv):
            n = self.f.write(mv)
            if n is None or n <= 0:  # pragma: no cover - raw files return the count or raise
                raise OSError("short write")
            self.hasher.update(mv[:n])
            self.size += n
            mv = mv[n:]
        return len(data)

    def flush(self) -> None:
        pass


def write_tensors_compressed(
    path: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    level: int = 3,
    with_shuffle: bool = True,
    fsync: bool = True,
) -> tuple[FileDigest, str]:
    """Write ``tensors`` as a zstd-compressed safetensors file at ``path`` (multithreaded);
    return the stored file's size and checksum, and its codec."""
    order, head, data_size = lay_out(tensors, metadata)
    total = len(head) + data_size
    with open(path, "wb", buffering=0) as f:
        sink = _HashingWriter(f)
        with compressor(level).stream_writer(sink, size=total, closefd=False) as z:
            z.write(head)
            for name in order:
                t = tensors[name]
                mv = _as_bytes(t)
                for start in range(0, len(mv), CHUNK):
                    piece = mv[start : start + CHUNK]
                    z.write(shuffle(piece, t.element_size()) if with_shuffle else piece)
        if fsync:
            os.fsync(f.fileno())
    return FileDigest(sink.size, sink.hasher.hexdigest()), codec_name(with_shuffle)


def codec_name(with_shuffle: bool) -> str:
    return "zstd+shuffle" if with_shuffle else "zstd"


def read_tensors_compressed(
    path: str, expect: FileDigest | None, codec: str
) -> dict[str, torch.Tensor]:
    """Read a compressed tensor file: the stored bytes are checked against ``expect`` (size and
    xxh3-64) before anything is decompressed; zstd checks its own checksum while decoding.

    Host memory: the checksum is computed by streaming the file (as ``verify`` does), then the
    file is decompressed a chunk at a time straight into one freshly allocated tensor per entry
    (unshuffled in place): the peak is the restored tensors plus a few chunks, and each tensor
    owns its memory, so an object that keeps some of them (an optimizer on the CPU) keeps no
    more than those. (Reading the whole stored file into memory and decompressing it into one
    buffer that the tensors viewed held the stored and the decompressed bytes at once, and a
    kept tensor kept the whole buffer: on the CPU, the model's share of it stayed for the run.)
    The second pass reads the file from the page cache where it fits there; a file changed
    between the passes fails zstd's content checksum."""
    if codec not in CODECS:
        raise CheckpointCorruptError(
            f"{path}: codec {codec!r} is unknown to this version of resilient-callbacks; "
            "upgrade it to read this checkpoint"
        )
    _check_stored(path, expect)
    z = zstd()
    result: dict[str, torch.Tensor] = {}
    try:
        with open(path, "rb") as f:
            size = z.frame_content_size(f.read(18))
            if size < 0:
                raise CheckpointCorruptError(f"{path}: the zstd frame does not record its size")
            f.seek(0)
            with z.ZstdDecompressor().stream_reader(f, read_size=CHUNK) as reader:
                head = header_bytes(reader, path)
                header, data_start = parse_header(head, path)
                for name, dtype, shape, start, end in _layout(header, data_start, size, path):
                    t = torch.empty(shape, dtype=dtype)
                    if end > start:
                        flat = t.reshape(-1).view(torch.uint8).numpy()
                        _read_exactly(reader, memoryview(flat), path)  # type: ignore[arg-type]
                        if codec == "zstd+shuffle":
                            unshuffle_(flat, dtype.itemsize)
                    result[name] = t
                if reader.read(1):  # (also makes zstd check the frame's content checksum)
                    raise CheckpointCorruptError(f"{path}: data after the last tensor")
    except z.ZstdError as e:
        raise CheckpointCorruptError(f"{path}: cannot decompress ({e})") from None
    return result


def _check_stored(path: str, expect: FileDigest | None) -> None:
    """Size and checksum of the stored (compressed) file against ``expect``, streamed."""
    from .filewrite import digest_file
    from .tensor_headers import _check_digest, _checked_size

    _checked_size(path, expect)
    if expect is not None:
        _check_digest(path, digest_file(path, expect.xxh3_64).xxh3_64, expect)


def _read_exactly(reader: Any, view: memoryview, path: str) -> None:
    pos = 0
    while pos < len(view):
        n = reader.readinto(view[pos : min(len(view), pos + CHUNK)])
        if not n:
            raise CheckpointCorruptError(f"{path}: the zstd frame ended early")
        pos += n


# ------------------------------------------------------------------------------ auto


def worth_compressing(
    ratio: float, compress_bps: float, sink_bps: list[float], margin: float = 0.9
) -> bool:
    """True when compressing at ``compress_bps`` (raw bytes/s) to ``ratio`` (stored/raw) and
    then moving the stored bytes through every sink is faster than moving the raw bytes:
    ``1/C + r * sum(1/S) < margin * sum(1/S)``."""
    sinks = [s for s in sink_bps if s > 0]
    if not sinks or compress_bps <= 0:
        return False
    per_byte = sum(1.0 / s for s in sinks)
    return 1.0 / compress_bps + ratio * per_byte < margin * per_byte


@dataclass
class Sample:
    ratio: float  # stored / raw
    compress_bps: float  # raw bytes per second


def measure(
    tensors: Mapping[str, torch.Tensor],
    level: int,
    with_shuffle: bool,
    limit: int = SAMPLE_BYTES,
) -> Sample:
    """Compress up to ``limit`` bytes drawn from the largest ``tensors`` (as a save would) and
    time it."""
    pieces: list[memoryview] = []
    taken = 0
    for t in sorted(tensors.values(), key=lambda t: -t.numel() * t.element_size()):
        if taken >= limit:
            break
        mv = _as_bytes(t)[: limit - taken]
        mv = mv[: len(mv) - len(mv) % t.element_size()]
        pieces.append(shuffle(mv, t.element_size()) if with_shuffle else mv)
        taken += len(mv)
    if not taken:
        return Sample(1.0, 0.0)
    data = b"".join(bytes(p) for p in pieces)
    cctx = compressor(level)
    t0 = time.perf_counter()
    out = cctx.compress(data)
    dt = max(time.perf_counter() - t0, 1e-9)
    return Sample(len(out) / len(data), len(data) / dt)


class Chooser:
    """The codec of each save: ``"none"``, always zstd, or ``"auto"``: the first save is written
    raw (it measures the disk), compression is measured on the state, and later saves are
    compressed only if :func:`worth_compressing` says so for the disk and, with a remote tier,
    the measured upload throughput."""

    def __init__(
        self,
        mode: str,
        level: int,
        with_shuffle: bool,
        upload_bps: Callable[[], float | None] | None = None,
    ) -> None:
        self.mode, self.level, self.with_shuffle = mode, level, with_shuffle
        self.upload_bps = upload_bps
        self.disk_bps: float | None = None
        self.sample: Sample | None = None
        self.decision: bool | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def compress_now(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether this save compresses (``tensors``: what it writes, to sample from)."""
        if self.mode == "none":
            return False
        if self.mode == "zstd":
            return True
        if self.disk_bps is None:
            return False  # measure the raw disk first
        if self.sample is None and tensors:
            self.sample = measure(tensors, self.level, self.with_shuffle)
        if self.sample is None:
            return False
        sinks = [self.disk_bps]
        up = self.upload_bps() if self.upload_bps is not None else None
        if up:
            sinks.append(up)
        self.decision = worth_compressing(self.sample.ratio, self.sample.compress_bps, sinks)
        return self.decision

    def observe_raw_write(self, nbytes: int, seconds: float) -> None:
        """A raw (uncompressed) write of ``nbytes`` took ``seconds`` (write + fsync)."""
        if nbytes >= 1 << 20 and seconds > 0:
            bps = nbytes / seconds
            self.disk_bps = bps if self.disk_bps is None else 0.5 * (self.disk_bps + bps)
