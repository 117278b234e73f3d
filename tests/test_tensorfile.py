"""The safetensors writer/reader: standard files, checksums, reads into private tensors."""

from __future__ import annotations

import json
import os
import struct

import pytest
import safetensors.torch
import torch
import xxhash

from resilient_callbacks import CheckpointCorruptError, UnsupportedStateError
from resilient_callbacks.filewrite import digest_file
from resilient_callbacks.tensor_headers import read_verified, tensor_meta
from resilient_callbacks.tensorfile import (
    FileDigest,
    read_tensors_verified,
    write_tensors,
)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def _table():
    g = torch.Generator().manual_seed(0)
    out = {
        f"t_{str(d).removeprefix('torch.')}": (torch.randn(3, 5, generator=g) * 50).to(d)
        for d in DTYPES
    }
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.empty(0, 4)
    out["transposed"] = torch.arange(12.0).reshape(3, 4).t()
    out["odd/name#1"] = torch.arange(3, dtype=torch.int8)
    return out


def test_written_file_is_standard_safetensors(tmp_path):
    tensors = _table()
    p = str(tmp_path / "x.safetensors")
    d = write_tensors(p, tensors, {"k": "v"})
    ref = safetensors.torch.load_file(p)
    assert set(ref) == set(tensors)
    for k, t in tensors.items():
        assert ref[k].dtype == t.dtype and ref[k].shape == t.shape and torch.equal(ref[k], t), k
    with safetensors.safe_open(p, "pt") as f:
        assert f.metadata() == {"k": "v"}
    with open(p, "rb") as f:
        data = f.read()
    assert d == FileDigest(len(data), xxhash.xxh3_64_hexdigest(data))
    assert digest_file(p) == d
    (hlen,) = struct.unpack("<Q", data[:8])
    assert hlen % 8 == 0  # tensors start 8-byte aligned


def test_reads_files_written_by_safetensors(tmp_path):
    tensors = {k: v.contiguous() for k, v in _table().items()}
    p = str(tmp_path / "ref.safetensors")
    safetensors.torch.save_file(tensors, p)
    got = read_tensors_verified(p, digest_file(p))
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    meta = tensor_meta(p)
    assert meta["t_bfloat16"] == ("bfloat16", [3, 5])


def test_reads_give_private_tensors_of_every_shape(tmp_path):
    p = str(tmp_path / "x.safetensors")
    src = {
        "a": torch.arange(16, dtype=torch.float32),
        "s": torch.tensor(3.5, dtype=torch.float64),
        "e": torch.empty(0, 3),
        "b": torch.ones(2, 2, dtype=torch.bfloat16),
    }
    d = write_tensors(p, src)
    got = read_tensors_verified(p, d)
    for k, t in src.items():
        assert got[k].shape == t.shape and got[k].dtype == t.dtype and torch.equal(got[k], t)
    ptrs = {got[k].untyped_storage().data_ptr() for k in ("a", "s", "b")}
    assert len(ptrs) == 3  # one allocation each: keeping one does not pin a whole file buffer


def test_checksum_mismatch_and_size_mismatch_detected(tmp_path):
    p = str(tmp_path / "x.safetensors")
    d = write_tensors(p, {"a": torch.arange(16, dtype=torch.float32)})
    with open(p, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x7f")
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        read_verified(p, d)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        read_tensors_verified(p, d)
    with open(p, "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointCorruptError, match="size"):
        read_verified(p, d)
    os.remove(p)
    with pytest.raises(CheckpointCorruptError, match="missing"):
        read_verified(p, d)


def test_unsupported_dtype_is_refused(tmp_path):
    with pytest.raises(UnsupportedStateError, match="complex128"):
        write_tensors(str(tmp_path / "x"), {"c": torch.zeros(2, dtype=torch.complex128)})


def test_garbage_header_is_corrupt_not_a_crash(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(CheckpointCorruptError):
        read_tensors_verified(str(p), None)
    p.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(CheckpointCorruptError):
        read_tensors_verified(str(p), None)
    hdr = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16)
    with pytest.raises(CheckpointCorruptError):
        read_tensors_verified(str(p), None)


def test_tensor_named_metadata_keeps_file_valid(tmp_path):
    """A tensor whose name is the reserved header key ``__metadata__`` must not silently
    overwrite the metadata (making the file unreadable by safetensors and losing the tensor)."""
    p = str(tmp_path / "x.safetensors")
    t = torch.arange(4, dtype=torch.float32)
    try:
        write_tensors(p, {"__metadata__": t}, {"k": "v"})
    except (UnsupportedStateError, ValueError):
        return  # refusing the name clearly is acceptable
    got = read_tensors_verified(p, None)
    assert "__metadata__" in got and torch.equal(got["__metadata__"], t)


@pytest.mark.parametrize("n", [3 << 20, (3 << 20) + 7, 5 << 20])
def test_direct_io_writes_the_same_file_as_buffered(tmp_path, n):
    """O_DIRECT (background saves) goes through an aligned bounce buffer and truncates the
    padded tail: byte-identical file, same checksum, for sizes on and off block boundaries."""
    from resilient_callbacks import tensorfile

    g = torch.Generator().manual_seed(n)
    tensors = {
        "a": torch.randn(n // 4, generator=g),
        "b": torch.randint(0, 255, (n % 4093 + 1,), dtype=torch.uint8, generator=g),
        "c": torch.randn(3, 5, dtype=torch.float64, generator=g),
    }
    old = tensorfile.DIRECT_MIN
    tensorfile.DIRECT_MIN = 1 << 20
    try:
        d1 = tensorfile.write_tensors(str(tmp_path / "buffered.st"), tensors)
        d2 = tensorfile.write_tensors(str(tmp_path / "direct.st"), tensors, direct=True)
    finally:
        tensorfile.DIRECT_MIN = old
    assert d1 == d2
    assert (tmp_path / "buffered.st").read_bytes() == (tmp_path / "direct.st").read_bytes()
    got = tensorfile.read_tensors_verified(str(tmp_path / "direct.st"), d2)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_direct_io_falls_back_where_the_filesystem_refuses_it(tmp_path):
    from resilient_callbacks import tensorfile

    shm = "/dev/shm"
    if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    path = os.path.join(shm, f"rc-direct-{os.getpid()}.st")
    tensors = {"a": torch.arange(3 << 20, dtype=torch.float32)}
    try:
        d = tensorfile.write_tensors(path, tensors, direct=True)  # tmpfs: EINVAL -> buffered
        assert d.size == os.path.getsize(path)
        assert torch.equal(tensorfile.read_tensors_verified(path, d)["a"], tensors["a"])
    finally:
        os.unlink(path)
