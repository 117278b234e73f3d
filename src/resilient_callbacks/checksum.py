"""File checksums that many threads can verify at once.

A file's checksum in a manifest (the ``xxh3_64`` field) is one of two schemes, named by the
string itself, so a reader never needs to be told which:

- ``"d00379e7512f1386"`` (16 hex digits): the xxh3-64 of the whole file. Every file of at most
  one segment (64 MiB) is written this way, and every file written before segmented checksums
  existed.
- ``"seg26:5b1c0e93d2a4f870"``: the file cut into segments of 2**26 bytes (64 MiB) at file
  offsets 0, 2**26, ...; the xxh3-64 of each segment, each as 8 big-endian bytes, concatenated
  in order; the xxh3-64 of that. Files larger than one segment are written this way.

Writing costs the same either way: the writer streams the bytes once through
:class:`FileHasher`. Verifying differs: one xxh3 pass over a whole file runs on one core
(~7 GB/s here), while the segments of a segmented file are hashed by several threads at once
(xxhash releases the GIL): a restore from the page cache, where hashing is most of the time,
verifies at the speed of the node's cores. A changed byte anywhere changes its segment's digest
and therefore the file's.

A manifest with a segmented checksum is format version 3 (:mod:`.manifest`): a library that
does not know the scheme refuses it with a message to upgrade instead of calling every large
file corrupt.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

SEGMENT_LOG2 = 26
SEGMENT = 1 << SEGMENT_LOG2  # bytes per segment of the files this library writes
PIECE = 16 << 20  # bytes per hasher call (and per read when verifying a file by reading it)
MAX_THREADS = 8
WRITTEN = f"seg{SEGMENT_LOG2}:"  # the scheme of the files this library writes, as a prefix


def is_segmented(digest: str) -> bool:
    return digest.startswith("seg")


def segment_size(digest: str) -> int | None:
    """The segment size named by ``digest``; None for a whole-file digest. Raises ValueError
    for a malformed scheme."""
    if not is_segmented(digest):
        return None
    head, _, _ = digest.partition(":")
    log2 = int(head[3:]) if head[3:].isdigit() else -1
    if not 12 <= log2 <= 40:
        raise ValueError(f"unknown checksum scheme {head!r}")
    return 1 << log2


class FileHasher:
    """Streaming checksum of a file: feed its bytes in order with :meth:`update`.

    ``segment=None`` gives a whole-file xxh3-64. With a segment size, the result is a whole-file
    xxh3-64 when the file fits in one segment, else the segmented checksum described above."""

    def __init__(self, segment: int | None = SEGMENT) -> None:
        self._segment = segment
        self._h = xxhash.xxh3_64()
        self._in_segment = 0
        self._digests: list[bytes] = []

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if self._segment is None:
            self._h.update(mv)
            return
        while len(mv):
            room = self._segment - self._in_segment
            if len(mv) < room:
                self._h.update(mv)
                self._in_segment += len(mv)
                return
            self._h.update(mv[:room])
            mv = mv[room:]
            self._digests.append(self._h.digest())
            self._h = xxhash.xxh3_64()
            self._in_segment = 0

    def hexdigest(self) -> str:
        if self._segment is None:
            return self._h.hexdigest()
        if not self._digests:
            return self._h.hexdigest()  # less than one segment: the whole file's xxh3-64
        if len(self._digests) == 1 and not self._in_segment:
            return self._digests[0].hex()  # exactly one segment: the same
        tail = [self._h.digest()] if self._in_segment else []
        return _combine(self._segment, self._digests + tail)


def _combine(segment: int, digests: list[bytes]) -> str:
    return f"seg{segment.bit_length() - 1}:{xxhash.xxh3_64_hexdigest(b''.join(digests))}"


def hasher_for(expect: str | None) -> FileHasher:
    """A hasher computing the scheme ``expect`` is written in (the writers' scheme for None).
    Raises ValueError for a scheme this version does not know."""
    return FileHasher(segment_size(WRITTEN if expect is None else expect))


def threads_for(size: int, segment: int) -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1, -(-size // segment)))


PROBES = 32
_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def in_page_cache(fd: int, size: int) -> bool:
    """Whether the file is (nearly) all in the page cache, judged from ``PROBES`` one-byte reads
    spread over it that may not wait for the disk (``RWF_NOWAIT``, Linux). Where that cannot be
    asked, True.

    Verification hashes segments in parallel only for a cached file: there hashing is the whole
    cost and it scales with cores. A file coming from the disk is read as one stream with
    helpers faulting ahead of it (:class:`~.readahead.MappedPrefetch`): the disk is the limit,
    and several hashing threads each faulting their own segment read it no faster (1.5 GB, 8
    alternating cold restores each: median 1.07 s in parallel, 1.02 s as one stream)."""
    if _NOWAIT is None or size <= 0:
        return True
    one = bytearray(1)
    misses = 0
    for i in range(PROBES):
        try:
            os.preadv(fd, [one], size * i // PROBES, _NOWAIT)
        except BlockingIOError:
            misses += 1
        except OSError:  # the filesystem does not support the flag
            return True
    return misses <= PROBES // 10


def digest_view(
    view: memoryview,
    expect: str,
    *,
    parallel: bool = True,
    progress: Callable[[int], None] | None = None,
) -> str:
    """The checksum of the bytes in ``view`` (e.g. a memory mapping of a whole file) in the
    scheme of ``expect``; with ``parallel``, segments are hashed by several threads at once.
    ``progress(offset)`` is called, from the calling thread, with the offset below which every
    byte has been hashed (e.g. to keep a prefetcher ahead)."""
    size = len(view)
    segment = segment_size(expect)
    if segment is None or size <= segment or not parallel or threads_for(size, segment) == 1:
        h = FileHasher(segment)
        for off in range(0, size, PIECE):
            if progress is not None:
                progress(off)
            h.update(view[off : off + PIECE])
        return h.hexdigest()

    def one(lo: int) -> bytes:
        h = xxhash.xxh3_64()
        for off in range(lo, min(lo + segment, size), PIECE):
            h.update(view[off : min(off + PIECE, lo + segment, size)])
        return h.digest()

    return _combine(segment, _in_threads(one, size, segment, progress))


def digest_path(path: str, expect: str | None = None) -> tuple[int, str]:
    """``(size, checksum)`` of the file at ``path``, in the scheme of ``expect`` (the writer's
    scheme for None), read with ``pread`` by several threads for a segmented checksum."""
    from .readahead import Readahead

    segment = SEGMENT if expect is None else segment_size(expect)
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        with Readahead(fd, size) as ahead:
            if (
                segment is None
                or not hasattr(os, "preadv")  # (Windows) one sequential reader
                or size <= segment
                or threads_for(size, segment) == 1
                or not in_page_cache(fd, size)
            ):
                h = FileHasher(segment)
                pos = 0
                while chunk := f.read(PIECE):
                    ahead.advance(pos)
                    h.update(chunk)
                    pos += len(chunk)
                return pos, h.hexdigest()

            def one(lo: int) -> bytes:
                h = xxhash.xxh3_64()
                buf = bytearray(PIECE)
                view = memoryview(buf)
                end = min(lo + segment, size)
                pos = lo
                while pos < end:
                    n = os.preadv(fd, [view[: min(PIECE, end - pos)]], pos)
                    if n <= 0:
                        raise OSError(f"{path}: file shrank while being read")
                    h.update(view[:n])
                    pos += n
                return h.digest()

            return size, _combine(segment, _in_threads(one, size, segment, ahead.advance))


def _in_threads(
    one: Callable[[int], bytes],
    size: int,
    segment: int,
    progress: Callable[[int], None] | None,
) -> list[bytes]:
    """``one(offset)`` for every segment, at most ``threads_for`` at a time, in file order:
    segments are submitted as earlier ones finish, so reading moves through the file front to
    back (a cold file is read as a few sequential streams, not all over at once)."""
    starts = range(0, size, segment)
    n = threads_for(size, segment)
    out: list[bytes] = []
    with ThreadPoolExecutor(n, thread_name_prefix="rc-verify") as ex:
        pending: list[Future[bytes]] = []
        todo: Iterator[int] = iter(starts)
        for lo in todo:
            pending.append(ex.submit(one, lo))
            if len(pending) >= n:
                break
        while pending:
            if progress is not None:
                progress(len(out) * segment)
            out.append(pending.pop(0).result())
            lo_next = next(todo, None)
            if lo_next is not None:
                pending.append(ex.submit(one, lo_next))
    return out
