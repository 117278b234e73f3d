"""The safetensors writer/reader: standard files, checksums, zero-copy reads."""

from __future__ import annotations

import json
import os
import struct

import pytest
import safetensors.torch
import torch
import xxhash

from resilient_callbacks import CheckpointCorruptError, UnsupportedStateError
from resilient_callbacks.tensorfile import (
    FileDigest,
    digest_file,
    read_verified,
    tensor_meta,
    tensors_from_buffer,
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
    buf = read_verified(p, digest_file(p))
    got = tensors_from_buffer(buf, p)
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    meta = tensor_meta(p)
    assert meta["t_bfloat16"] == ("bfloat16", [3, 5])


def test_round_trip_is_zero_copy_view_of_buffer(tmp_path):
    p = str(tmp_path / "x.safetensors")
    d = write_tensors(p, {"a": torch.arange(16, dtype=torch.float32)})
    buf = read_verified(p, d)
    t = tensors_from_buffer(buf, p)["a"]
    buf[-4:] = struct.pack("<f", 99.0)
    assert t[-1].item() == 99.0


def test_checksum_mismatch_and_size_mismatch_detected(tmp_path):
    p = str(tmp_path / "x.safetensors")
    d = write_tensors(p, {"a": torch.arange(16, dtype=torch.float32)})
    with open(p, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x7f")
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        read_verified(p, d)
    with open(p, "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointCorruptError, match="size"):
        read_verified(p, d)
    os.remove(p)
    with pytest.raises(CheckpointCorruptError, match="missing"):
        read_verified(p, d)


def test_unsupported_dtype_is_refused(tmp_path):
    with pytest.raises(UnsupportedStateError, match="complex"):
        write_tensors(str(tmp_path / "x"), {"c": torch.zeros(2, dtype=torch.complex64)})


def test_garbage_header_is_corrupt_not_a_crash(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(CheckpointCorruptError):
        tensors_from_buffer(bytearray(p.read_bytes()), str(p))
    p.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(CheckpointCorruptError):
        tensors_from_buffer(bytearray(p.read_bytes()), str(p))
    hdr = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16)
    with pytest.raises(CheckpointCorruptError):
        tensors_from_buffer(bytearray(p.read_bytes()), str(p))


def test_tensor_named_metadata_keeps_file_valid(tmp_path):
    """A tensor whose name is the reserved header key ``__metadata__`` must not silently
    overwrite the metadata (making the file unreadable by safetensors and losing the tensor)."""
    p = str(tmp_path / "x.safetensors")
    t = torch.arange(4, dtype=torch.float32)
    try:
        write_tensors(p, {"__metadata__": t}, {"k": "v"})
    except (UnsupportedStateError, ValueError):
        return  # refusing the name clearly is acceptable
    with open(p, "rb") as f:
        got = tensors_from_buffer(bytearray(f.read()), p)
    assert "__metadata__" in got and torch.equal(got["__metadata__"], t)
