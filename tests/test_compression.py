"""zstd compression of tensor files (``compression="zstd"``/``"auto"``): exact round trips for
every dtype, corruption caught before decompression, the ``auto`` rule, and a clear error when
the extra is missing."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("zstandard")

from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.catalog import Depth, Status
from resilient_callbacks.compression import (
    Chooser,
    measure,
    read_tensors_compressed,
    worth_compressing,
    write_tensors_compressed,
)
from resilient_callbacks.errors import CheckpointCorruptError, ConfigError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3000, generator=g),
        "bf16": torch.randn(70, 33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(1001, generator=g).half(),
        "f64": torch.randn(17, generator=g).double(),
        "i8": torch.randint(-128, 127, (5000,), dtype=torch.int8, generator=g),
        "i64": torch.arange(300),
        "bool": torch.rand(77, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }


@pytest.mark.parametrize("shuffle", [True, False])
def test_round_trip_is_exact_for_every_dtype(tmp_path, shuffle):
    t = _tensors()
    path = str(tmp_path / "x.safetensors.zst")
    digest, codec = write_tensors_compressed(path, t, {"a": "b"}, level=3, with_shuffle=shuffle)
    assert codec == ("zstd+shuffle" if shuffle else "zstd")
    assert digest.size == os.path.getsize(path)
    got = read_tensors_compressed(path, digest, codec)
    assert got.keys() == t.keys()
    for k, v in t.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_shuffle_makes_bf16_compress_better():
    g = torch.Generator().manual_seed(1)
    x = {"w": (torch.randn(1 << 19, generator=g) * 0.02).to(torch.bfloat16)}
    plain = measure(x, 3, with_shuffle=False)
    shuffled = measure(x, 3, with_shuffle=True)
    assert shuffled.ratio < plain.ratio
    assert shuffled.ratio < 0.85


def test_a_damaged_compressed_file_is_caught(tmp_path):
    path = str(tmp_path / "x.safetensors.zst")
    digest, codec = write_tensors_compressed(path, _tensors())
    with open(path, "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        read_tensors_compressed(path, digest, codec)
    with pytest.raises(CheckpointCorruptError, match="codec"):
        read_tensors_compressed(path, digest, "lz77")


@pytest.mark.parametrize("incremental", [False, True])
def test_compressed_checkpoints_restore_exactly_and_verify(tmp_path, incremental):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.Linear(300, 10))
    model.half()
    state = {"model": model, "x": torch.arange(100_000, dtype=torch.int8)}
    with Checkpointer(
        tmp_path, compression="zstd", compression_level=1, incremental=incremental
    ) as ck:
        ck.save(1, state)
    m = json.loads((tmp_path / "step_000000001" / "manifest.json").read_text())
    assert m["format_version"] == 2
    codecs = {f["path"]: f.get("codec") for f in [*m["files"], *m.get("blobs", [])]}
    assert codecs["shared.safetensors.zst"] == "zstd+shuffle"
    if incremental:
        assert all(n.endswith(".zst") for n in os.listdir(tmp_path / "blobs"))
    assert [e.status for e in catalog.scan(str(tmp_path), Depth.FULL)] == [Status.VALID]
    torch.manual_seed(1)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.Linear(300, 10)).half()
    fresh = {"model": fresh_model, "x": torch.zeros(100_000, dtype=torch.int8)}
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(fresh) == 1
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fresh["x"], state["x"])


def test_auto_rule():
    # ratio 0.5 at 1 GB/s vs a 100 MB/s link: compressing halves the time -> on
    assert worth_compressing(0.5, 1e9, [100e6])
    # the same data on a 5 GB/s disk: compressing costs more than it saves -> off
    assert not worth_compressing(0.5, 1e9, [5e9])
    # incompressible data never pays
    assert not worth_compressing(1.0, 1e10, [1e6])
    # a slow upload after a fast disk: the sum of both sinks decides
    assert worth_compressing(0.5, 1e9, [5e9, 50e6])


def test_auto_writes_the_first_save_raw_then_decides_from_measurements():
    x = {"w": torch.zeros(1 << 20)}  # very compressible
    c = Chooser("auto", 3, True)
    assert not c.compress_now(x)  # no disk measurement yet
    c.observe_raw_write(1 << 30, 100.0)  # a ~10 MB/s disk
    assert c.compress_now(x) and c.sample is not None and c.sample.ratio < 0.01
    fast = Chooser("auto", 3, True)
    fast.observe_raw_write(1 << 40, 1.0)  # an (impossibly) fast disk: never worth it
    assert not fast.compress_now(x)


def test_missing_zstandard_is_a_clear_config_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ConfigError, match=r"resilient-callbacks\[zstd\]"):
        Checkpointer(tmp_path, compression="zstd")


def test_blob_names_carry_the_codec_and_a_new_level_reuses_stored_blobs(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    state = {"model": model}
    with Checkpointer(tmp_path, incremental=True, compression="zstd", compression_level=1) as ck:
        ck.save(1, state)
    first = sorted(os.listdir(tmp_path / "blobs"))
    assert first and all(".zs1.safetensors.zst" in n for n in first)
    with Checkpointer(
        tmp_path, incremental=True, compression="zstd", compression_level=5, async_save=False
    ) as ck:
        ck.restore({"model": torch.nn.Linear(256, 256)})
        ck.save(2, state)  # the same bytes: the level-1 blob is referenced, none written
        assert sorted(os.listdir(tmp_path / "blobs")) == first
    assert [e.status for e in catalog.scan(str(tmp_path), Depth.FULL)] == [Status.VALID] * 2
