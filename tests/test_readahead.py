"""Reading ahead of the verifying reader: same bytes, same verdicts, bounded lead, no leftovers."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import torch

from resilient_callbacks import CheckpointCorruptError
from resilient_callbacks import readahead as ra
from resilient_callbacks.filewrite import digest_file
from resilient_callbacks.tensorfile import (
    map_tensors_verified,
    read_tensors_verified,
    write_tensors,
)


def _prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rc-prefetch")]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 136 MB file: large enough for the prefetch helpers to run (two 64 MB windows)."""
    p = str(tmp_path_factory.mktemp("ra") / "big.safetensors")
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(17 << 20 >> 2, generator=g) for i in range(8)}
    return p, write_tensors(p, tensors), tensors


def test_mapped_read_with_prefetch_gives_the_written_tensors(big):
    p, digest, tensors = big
    got = map_tensors_verified(p, digest)
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(got[k], t)
    assert _prefetch_threads() == []  # joined before returning


def test_corruption_deep_in_a_big_file_is_found_with_prefetch(big, tmp_path):
    p, digest, _ = big
    bad = str(tmp_path / "bad.safetensors")
    with open(p, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read())
    with open(bad, "r+b") as f:
        f.seek(100 << 20)
        b = f.read(1)
        f.seek(100 << 20)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        map_tensors_verified(bad, digest)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        read_tensors_verified(bad, digest)
    assert digest_file(bad).xxh3_64 != digest.xxh3_64
    assert digest_file(p) == digest
    assert _prefetch_threads() == []


def test_prefetch_stays_a_bounded_distance_ahead_of_the_reader(big):
    p, _, _ = big
    size = os.path.getsize(p)
    with open(p, "rb") as f:
        import mmap

        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    ahead = ra.STEP  # at most one window beyond the reader
    pf = ra.MappedPrefetch(mm, size, workers=2, ahead=ahead)
    try:
        time.sleep(0.5)  # the reader has not moved: helpers must wait
        assert pf._next <= ahead + ra.STEP
        pf.advance(size)
        deadline = time.monotonic() + 120
        while pf._next < size and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pf._next >= size  # once the reader moves, the helpers cover the whole file
    finally:
        pf.close()
    assert _prefetch_threads() == []


def test_readahead_requests_a_sliding_bounded_window(tmp_path, monkeypatch):
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(ra, "_advise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    p = tmp_path / "f.bin"
    size = 10 * ra.STEP
    with open(p, "wb") as f:
        f.truncate(size)
    with open(p, "rb") as f:
        r = ra.Readahead(f.fileno(), size, ahead=2 * ra.STEP)
        for pos in range(0, size, ra.STEP // 4):
            r.advance(pos)
            needs = [(o, n) for o, n, a in calls if a == os.POSIX_FADV_WILLNEED]
            assert max((o + n for o, n in needs), default=0) <= min(size, pos + 2 * ra.STEP)
        r.close()
    needs = sorted((o, n) for o, n, a in calls if a == os.POSIX_FADV_WILLNEED)
    # the windows tile the file: no gap, no overlap, up to the end
    assert needs[0][0] == 0
    for (o1, n1), (o2, _) in itertools.pairwise(needs):
        assert o1 + n1 == o2
    assert needs[-1][0] + needs[-1][1] == size


def test_readahead_is_harmless_where_advice_is_refused(tmp_path, monkeypatch):
    def refuse(*_):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(ra, "_advise", refuse)
    p = str(tmp_path / "x.safetensors")
    d = write_tensors(p, {"a": torch.arange(1000.0)})
    assert torch.equal(read_tensors_verified(p, d)["a"], torch.arange(1000.0))
    assert digest_file(p) == d
