"""Segmented checksums (checksum.py): what they are, that every path that verifies a file
verifies them (and still verifies whole-file checksums of older checkpoints), that a changed
byte in any segment is caught, and that the manifest says which format version it needs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import xxhash

from resilient_callbacks import Checkpointer, checksum, manifest, tensorfile
from resilient_callbacks.checksum import (
    SEGMENT,
    FileHasher,
    digest_path,
    digest_view,
    in_page_cache,
)
from resilient_callbacks.errors import CheckpointCorruptError
from resilient_callbacks.filewrite import digest_file
from resilient_callbacks.manifest import Manifest, read_manifest
from resilient_callbacks.tensor_headers import read_verified
from resilient_callbacks.tensorfile import (
    FileDigest,
    map_tensors_verified,
    read_tensors_verified,
    write_tensors,
)

MIB = 1 << 20


def segmented(data: bytes, log2: int) -> str:
    """The segmented checksum, computed from its definition (docs/format.md)."""
    seg = 1 << log2
    parts = b"".join(xxhash.xxh3_64_digest(data[i : i + seg]) for i in range(0, len(data), seg))
    return f"seg{log2}:{xxhash.xxh3_64_hexdigest(parts)}"


@pytest.mark.parametrize("size", [0, 1, MIB - 1, MIB])
def test_a_file_of_at_most_one_segment_has_the_whole_file_xxh3(size):
    data = os.urandom(size)
    h = FileHasher(MIB)
    h.update(data)
    assert h.hexdigest() == xxhash.xxh3_64_hexdigest(data)


@pytest.mark.parametrize("size", [MIB + 1, 2 * MIB, 5 * MIB + 12345])
def test_the_segmented_checksum_matches_its_definition_on_every_path(tmp_path, size):
    data = os.urandom(size)
    want = segmented(data, 20)
    h = FileHasher(MIB)
    for i in range(0, size, 77_777):  # pieces that straddle segment boundaries
        h.update(data[i : i + 77_777])
    assert h.hexdigest() == want
    assert digest_view(memoryview(data), want) == want
    path = tmp_path / "f"
    path.write_bytes(data)
    assert digest_path(str(path), want) == (size, want)
    assert digest_file(str(path), like=want) == FileDigest(size, want)
    assert read_verified(str(path), FileDigest(size, want)) == data


def _big_file(tmp_path, mb: int = 70) -> tuple[str, FileDigest, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(mb * MIB // 4 // 5, generator=g) for i in range(5)}
    path = str(tmp_path / "big.safetensors")
    return path, write_tensors(path, tensors, fsync=False), tensors


def test_files_over_one_segment_are_written_with_segmented_checksums(tmp_path):
    path, d, tensors = _big_file(tmp_path)
    assert d.size > SEGMENT
    assert d.xxh3_64 == segmented(Path(path).read_bytes(), 26)
    got = map_tensors_verified(path, d)
    assert all(torch.equal(got[k], t) for k, t in tensors.items())
    got = read_tensors_verified(path, d)
    assert all(torch.equal(got[k], t) for k, t in tensors.items())
    assert digest_file(path) == d


@pytest.fixture(params=["cached", "from disk"])
def cache_state(request, monkeypatch):
    """Both verification paths: a file in the page cache (segments hashed by several threads)
    and one coming from the disk (one hashing thread with prefetching helpers)."""
    cached = request.param == "cached"
    monkeypatch.setattr(tensorfile, "in_page_cache", lambda fd, size: cached)
    monkeypatch.setattr(checksum, "in_page_cache", lambda fd, size: cached)
    monkeypatch.setattr(checksum, "MAX_THREADS", 4)
    monkeypatch.setattr(checksum.os, "cpu_count", lambda: 4)  # several threads even on 1 cpu
    return request.param


@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_a_flipped_byte_in_any_segment_is_caught_by_every_reader(tmp_path, where, cache_state):
    path, d, tensors = _big_file(tmp_path)
    got = map_tensors_verified(path, d)
    assert all(torch.equal(got[k], t) for k, t in tensors.items())
    del got
    assert digest_file(path, like=d.xxh3_64) == d
    data_start = 8 + int.from_bytes(Path(path).read_bytes()[:8], "little")
    offset = {"first": data_start + 100, "middle": SEGMENT + 7, "last": d.size - 1}[where]
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        map_tensors_verified(path, d)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        read_tensors_verified(path, d)
    assert digest_file(path, like=d.xxh3_64).xxh3_64 != d.xxh3_64


def test_a_damaged_header_is_reported_as_corrupt_by_every_reader(tmp_path):
    path, d, _ = _big_file(tmp_path, mb=2)
    with open(path, "r+b") as f:
        f.seek(f.read(4096).index(b'"shape"'))  # still JSON, no longer a safetensors header
        f.write(b'"shapf"')
    for read in (map_tensors_verified, read_tensors_verified):
        with pytest.raises(CheckpointCorruptError):
            read(path, d)
    with pytest.raises(CheckpointCorruptError):
        read_tensors_verified(path, None)  # nothing to compare with: the header is still checked


def test_whole_file_checksums_of_older_checkpoints_still_verify(tmp_path):
    path, d, tensors = _big_file(tmp_path)
    data = Path(path).read_bytes()
    old = FileDigest(d.size, xxhash.xxh3_64_hexdigest(data))  # as written before segments
    got = map_tensors_verified(path, old)
    assert all(torch.equal(got[k], t) for k, t in tensors.items())
    assert digest_file(path, like=old.xxh3_64) == old
    with open(path, "r+b") as f:
        f.seek(d.size // 2)
        f.write(b"\x00\x01\x02")
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        map_tensors_verified(path, old)


def test_an_unknown_checksum_scheme_is_a_clear_error(tmp_path):
    path, d, _ = _big_file(tmp_path, mb=1)
    with pytest.raises(CheckpointCorruptError, match="unknown checksum scheme 'seg99'"):
        map_tensors_verified(path, FileDigest(d.size, "seg99:0123456789abcdef"))
    with pytest.raises(CheckpointCorruptError, match="unknown checksum scheme"):
        digest_file(path, like="segx:0123456789abcdef")


def test_a_checkpoint_with_segmented_checksums_is_format_3_and_older_readers_refuse_it(
    tmp_path, monkeypatch
):
    state = {"w": torch.randn(20 * MIB)}  # 80 MB: one file over a segment
    with Checkpointer(str(tmp_path / "ck"), preemption=False) as ck:
        ck.save(1, state)
    (entry,) = [e for e in os.scandir(tmp_path / "ck") if e.name.startswith("step_")]
    m = read_manifest(entry.path)
    assert any(f.xxh3_64.startswith("seg26:") for f in m.files)
    raw = json.loads(Path(entry.path, "manifest.json").read_text())
    assert raw["format_version"] == 3

    fresh = {"w": torch.zeros(20 * MIB)}
    with Checkpointer(str(tmp_path / "ck"), preemption=False) as ck:
        assert ck.restore(fresh) == 1
    assert torch.equal(fresh["w"], state["w"])

    monkeypatch.setattr(manifest, "FORMAT_VERSION", 2)  # a library from before segments
    with pytest.raises(CheckpointCorruptError, match="format version 3 is newer"):
        Manifest.from_json(raw)


def test_a_checkpoint_of_small_files_stays_format_1(tmp_path):
    with Checkpointer(str(tmp_path / "ck"), preemption=False) as ck:
        ck.save(1, {"w": torch.randn(1000)})
    (entry,) = [e for e in os.scandir(tmp_path / "ck") if e.name.startswith("step_")]
    raw = json.loads(Path(entry.path, "manifest.json").read_text())
    assert raw["format_version"] == 1
    assert not any(f["xxh3_64"].startswith("seg") for f in raw["files"])


def test_the_page_cache_probe_tells_a_cached_file_from_an_evicted_one(tmp_path):
    path, _, _ = _big_file(tmp_path, mb=8)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        Path(path).read_bytes()
        assert in_page_cache(fd, os.path.getsize(path))
        if not hasattr(os, "posix_fadvise") or not hasattr(os, "RWF_NOWAIT"):
            pytest.skip("no posix_fadvise/RWF_NOWAIT here: every file counts as cached")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        probe = bytearray(1)
        try:  # a probe of our own (it may start readahead there: ask only once per eviction)
            os.preadv(fd, [probe], 4 << 20, os.RWF_NOWAIT)
            pytest.skip("this filesystem keeps files in memory (tmpfs): nothing to evict")
        except BlockingIOError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert not in_page_cache(fd, os.path.getsize(path))
    finally:
        os.close(fd)
