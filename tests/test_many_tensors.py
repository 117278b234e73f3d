"""States of many tensors (an LLM has thousands, an MoE more): what a save costs per tensor is
counted in calls here, never timed (benchmarks/bench_many_tensors.py times it).

- the tensor writers gather small tensors into one ``write`` and one hasher call (they made one
  of each per tensor), with the same bytes and checksum;
- large JSON documents (a structure of thousands of tensors) are encoded by the C encoder,
  small ones exactly as before;
- ``keep_last=None`` (the default) keeps every checkpoint, so retention reads no manifest
  (each save read every manifest and checked every listed file's size: a cost growing with the
  run's number of checkpoints); with a retention policy, each kept manifest is parsed once,
  not again at every save;
- a tensor's key path is formatted only when a refusal names it (it was formatted for every
  tensor of every save, on the training thread: as costly as the checks themselves).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import xxhash

from resilient_callbacks import (
    Checkpointer,
    catalog,
    filewrite,
    structure,
    tensorfile,
    verification,
)
from resilient_callbacks.checksum import FileHasher
from resilient_callbacks.errors import UnsupportedStateError
from resilient_callbacks.known import KnownCheckpoints

ROOT = Path(__file__).resolve().parents[1]


def _many(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layer{i:05d}.w": torch.randn(3 + i % 7, generator=g) for i in range(n)}
    out["big"] = torch.randn(40_000, generator=g)  # 160 kB: written on its own
    out["bf16"] = torch.randn(5, generator=g).to(torch.bfloat16)
    return out


class _CountingFile:
    def __init__(self, f: Any, counts: dict[str, int]) -> None:
        self.f, self.counts = f, counts

    def write(self, data: Any) -> Any:
        self.counts["write"] += 1
        return self.f.write(data)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of ``write`` on the files the tensor writer opens, and of the hasher's update."""
    counts = {"write": 0, "hash": 0}

    def counting_open(*a: Any, **kw: Any) -> _CountingFile:
        return _CountingFile(open(*a, **kw), counts)

    real_update = FileHasher.update

    def update(self: FileHasher, data: Any) -> None:
        counts["hash"] += 1
        real_update(self, data)

    monkeypatch.setattr(tensorfile, "open", counting_open, raising=False)
    monkeypatch.setattr(FileHasher, "update", update)
    return counts


def test_small_tensors_are_written_and_hashed_together(tmp_path: Path, counts: dict) -> None:
    tensors = _many(3000)
    path = str(tmp_path / "many.safetensors")
    d = tensorfile.write_tensors(path, tensors)
    # 3000 tensors of 12-36 bytes, one of 160 kB: a few writes, not one per tensor
    assert counts["write"] <= 4, counts
    assert counts["hash"] <= 4, counts
    data = Path(path).read_bytes()
    assert d.size == len(data) and d.xxh3_64 == xxhash.xxh3_64_hexdigest(data)
    got = safetensors.torch.load_file(path)  # a standard file
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert tensorfile.read_tensors_verified(path, d).keys() == tensors.keys()


def test_direct_writes_hash_each_buffer_once(tmp_path: Path, counts: dict) -> None:
    """O_DIRECT (background saves of large files): one hasher call per bounce buffer, not per
    tensor; the file and its checksum are the buffered writer's."""
    tensors = _many(3000, seed=1)
    buffered = tensorfile.write_tensors(str(tmp_path / "b.st"), tensors)
    old = tensorfile.DIRECT_MIN
    tensorfile.DIRECT_MIN = 1 << 10
    try:
        counts["hash"] = 0
        direct = tensorfile.write_tensors(str(tmp_path / "d.st"), tensors, direct=True)
    finally:
        tensorfile.DIRECT_MIN = old
    assert counts["hash"] <= 2, counts
    assert direct == buffered
    assert (tmp_path / "b.st").read_bytes() == (tmp_path / "d.st").read_bytes()


def test_large_json_is_encoded_in_c_and_small_json_is_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = {"step": 3, "files": [{"path": "a", "size": 1}], "x": 0.5}
    assert filewrite.encode_json(small) == json.dumps(small, indent=1).encode()
    big = {f"model/p{i}": {"__rc__": "tensor", "key": f"model/p{i}"} for i in range(5000)}

    def python_encoder(*a: Any, **kw: Any) -> Any:
        raise AssertionError("the pure-Python JSON encoder ran")

    monkeypatch.setattr(json.encoder, "_make_iterencode", python_encoder)
    data = filewrite.encode_json(big)
    assert json.loads(data) == big
    with pytest.raises(ValueError):  # NaN is refused either way (the writers never emit it)
        filewrite.encode_json({**big, "nan": float("nan")})


def test_keep_all_retention_reads_no_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default keep_last=None deletes nothing, so a save scans nothing; with keep_last
    retention still scans (lists the directory: :mod:`resilient_callbacks.known`) and deletes."""
    scans: list[str] = []
    real_scan, real_entries = catalog.scan, KnownCheckpoints.entries

    def scan(root: str, *a: Any, **kw: Any) -> Any:
        scans.append(root)
        return real_scan(root, *a, **kw)

    def entries(self: KnownCheckpoints, root: str) -> Any:
        scans.append(root)
        return real_entries(self, root)

    state = {"model": torch.nn.Linear(3, 2)}
    with Checkpointer(tmp_path / "all", async_save=False, preemption=False) as ck:
        ck.save(1, state)
        monkeypatch.setattr(catalog, "scan", scan)
        monkeypatch.setattr(KnownCheckpoints, "entries", entries)
        for step in range(2, 7):
            ck.save(step, state)
        assert scans == []
        assert [e.step for e in ck.checkpoints()] == [1, 2, 3, 4, 5, 6]
    with Checkpointer(tmp_path / "two", keep_last=2, async_save=False, preemption=False) as ck:
        ck.save(1, state)
        before = len(scans)
        for step in range(2, 5):
            ck.save(step, state)
        assert len(scans) == before + 3  # one per save
        assert [e.step for e in ck.checkpoints()] == [3, 4]


def test_retention_parses_each_kept_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Archives (kept forever) are not parsed again at every save: one new manifest a save."""
    reads: list[str] = []
    real_read = catalog.read_manifest

    def read_manifest(path: str) -> Any:
        reads.append(path)
        return real_read(path)

    state = {"model": torch.nn.Linear(3, 2)}
    opts = {"keep_last": 1, "keep_every_n_steps": 2, "async_save": False, "preemption": False}
    with Checkpointer(tmp_path, **opts) as ck:
        for step in range(1, 5):
            ck.save(step, state)
        monkeypatch.setattr(catalog, "read_manifest", read_manifest)
        for step in range(5, 11):
            ck.save(step, state)
        assert len(reads) == 6, reads  # the manifest each save committed, no other
        assert [e.step for e in ck.checkpoints()] == [2, 4, 6, 8, 10]


def test_retention_checks_a_blob_many_checkpoints_name_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """incremental=True: every archive names the same unchanged blobs; a save's retention
    checks each blob's size once, not once per checkpoint naming it."""
    checked: list[str] = []
    real_problem = verification._problem

    def problem(full: str, f: Any, depth: Any) -> Any:
        if f.kind == "blob":
            checked.append(f.path)
        return real_problem(full, f, depth)

    state = {f"w{i}": torch.randn(4096) for i in range(3)}  # 16 KiB each: stored as blobs
    opts = {"keep_last": 1, "keep_every_n_steps": 1, "incremental": True}
    with Checkpointer(tmp_path, async_save=False, preemption=False, **opts) as ck:
        for step in range(1, 7):
            ck.save(step, state)
        monkeypatch.setattr(verification, "_problem", problem)
        ck.save(7, state)
    assert sorted(checked) == sorted(set(checked)) and len(checked) == 3, checked


def test_the_manifest_cache_sees_a_changed_or_removed_checkpoint(tmp_path: Path) -> None:
    state = {"model": torch.nn.Linear(3, 2)}
    with Checkpointer(tmp_path, async_save=False, preemption=False) as ck:
        ck.save(1, state, metrics={"loss": 1.0})
        ck.save(2, state)
    cache = catalog.ManifestCache()
    first = catalog.scan(str(tmp_path), catalog.Depth.SIZE, cache)
    assert [e.manifest.metrics for e in first if e.manifest] == [{"loss": 1.0}, {}]
    path = tmp_path / "step_000000001" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc["metrics"] = {"loss": 0.25}
    del doc["manifest_xxh3_64"]  # (its own checksum: would call the edit damage)
    path.write_text(json.dumps(doc, indent=1))  # rewritten in place: another size and mtime
    again = catalog.scan(str(tmp_path), catalog.Depth.SIZE, cache)
    assert [e.manifest.metrics for e in again if e.manifest] == [{"loss": 0.25}, {}]
    assert cache.parsed == 3
    import shutil

    shutil.rmtree(tmp_path / "step_000000002")
    assert [e.step for e in catalog.scan(str(tmp_path), catalog.Depth.SIZE, cache)] == [1]
    assert list(cache._seen) == [str(tmp_path / "step_000000001")]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_of_many_tensors_round_trips(tmp_path: Path, async_save: bool) -> None:
    model = torch.nn.Module()
    for name, t in _many(2500).items():
        model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t.clone()))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path, async_save=async_save, preemption=False) as ck:
        ck.save(5, {"model": model, "n": 2500})
    structure = json.loads((tmp_path / "step_000000005" / "shared.json").read_bytes())
    assert structure["structure"]["n"] == 2500
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state: dict[str, Any] = {"model": model, "n": 0}
    assert Checkpointer(tmp_path, preemption=False, read_only=True).restore(state) == 5
    assert state["n"] == 2500
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_saved_tensor_key_path_is_formatted_only_to_refuse_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    formatted: list[tuple[Any, ...]] = []
    path_str = structure.path_str

    def counting(path: tuple[Any, ...]) -> str:
        formatted.append(path)
        return path_str(path)

    monkeypatch.setattr(structure, "path_str", counting)
    shared, _ = structure.encode({"model": _many(200), "opt": {"state": {0: torch.ones(2)}}})
    assert len(shared.tensors) == 203
    assert formatted == []
    with pytest.raises(UnsupportedStateError, match=r"state\['opt'\]\[3\]\['m'\] is on the meta"):
        structure.encode({"opt": [1, 2, 3, {"m": torch.empty(2, device="meta")}]})
    assert formatted == [("opt", 3, "m")]


@pytest.mark.benchmark
def test_bench_many_tensors_quick(tmp_path: Path) -> None:
    """benchmarks/bench_many_tensors.py --quick runs (about 5 s: imports DCP) and reports
    every ratio."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]),
    }
    args = [sys.executable, str(ROOT / "benchmarks" / "bench_many_tensors.py"), "--quick"]
    args += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench_many_tensors.json").read_text())
    assert [r["tensors"] for r in report["rows"]] == [51, 201]
    assert all(len(r["ratios"]) == 6 for r in report["rows"])
