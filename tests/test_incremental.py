"""Incremental checkpoints (``incremental=True``): unchanged tensors are stored once in the run's
blob store, retention and ``gc`` never delete a blob a committed checkpoint refers to, every
reference is verified, and older checkpoints still load."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.blobs import BLOB_MIN, BlobStore, content_key, live_blobs
from resilient_callbacks.catalog import Depth, Status
from resilient_callbacks.errors import ConfigError, UnsafeManifestError
from resilient_callbacks.manifest import SELF_CHECKSUM, read_manifest, self_checksum


def _model(seed: int = 0) -> nn.Module:
    """~90% of the parameters frozen: a big frozen trunk and a small trained head."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512), nn.Linear(512, 64))
    for p in [*m[0].parameters(), *m[1].parameters()]:
        p.requires_grad_(False)
    return m


def _state(m: nn.Module) -> dict:
    trained = [p for p in m.parameters() if p.requires_grad]
    return {"model": m, "opt": torch.optim.Adam(trained, lr=1e-2), "extra": {"step": 0}}


def _train_step(state: dict, step: int) -> None:
    torch.manual_seed(1000 + step)
    loss = state["model"](torch.randn(4, 512)).square().mean()
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad()
    state["extra"]["step"] = step


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, st in state["opt"].state.items():
        for k, v in st.items():
            out[f"opt.{i}.{k}"] = v.clone()
    return out


def _disk_bytes(root) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
    return total


def _ckpt_bytes(root) -> int:
    """Bytes of the checkpoints and the blob store (not the lock, history, ``latest``)."""
    return sum(
        _disk_bytes(os.path.join(root, n))
        for n in os.listdir(root)
        if n == "blobs" or n.startswith("step_")
    )


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_frozen_model_ten_saves_store_changed_bytes_and_restore_exactly(tmp_path, async_save):
    state = _state(_model())
    saved: dict[int, dict[str, torch.Tensor]] = {}
    written: list[int] = []
    changed: list[int] = []
    with Checkpointer(tmp_path / "inc", incremental=True, async_save=async_save) as ck:
        prev = None
        for step in range(1, 11):
            _train_step(state, step)
            ck.save(step, state)
            ck._saver.wait_background()
            assert ck.last_save is not None
            written.append(ck.last_save.written)
            now = _tensors(state)
            saved[step] = now
            if prev is not None:
                changed.append(
                    sum(
                        t.numel() * t.element_size()
                        for k, t in now.items()
                        if k not in prev or not torch.equal(prev[k], t)
                    )
                )
            prev = now
    # the size of one full (non-incremental) save of the same state
    with Checkpointer(tmp_path / "full", async_save=False) as full:
        full.save(10, state)
    full_bytes = _ckpt_bytes(tmp_path / "full")
    total = _ckpt_bytes(tmp_path / "inc")
    frozen_share = 1 - max(changed) / sum(t.numel() * t.element_size() for t in prev.values())
    assert frozen_share > 0.85  # the model is mostly frozen (Adam state counts as changing)
    bound = full_bytes + sum(changed[:9])
    assert total <= 1.1 * bound, (total, full_bytes, changed)
    # each later save writes only what changed: a small fraction of the first
    assert all(w < 0.35 * written[0] for w in written[1:]), written
    # every kept checkpoint restores bit-exactly
    for step in range(1, 11):
        fresh = _state(_model(seed=99))
        with Checkpointer(tmp_path / "inc", resume=step, async_save=False) as ck2:
            assert ck2.restore(fresh) == step
        got = _tensors(fresh)
        assert got.keys() == saved[step].keys()
        for k, t in saved[step].items():
            assert torch.equal(got[k], t), (step, k)
    entries = catalog.scan(str(tmp_path / "inc"), Depth.FULL)
    assert [e.status for e in entries] == [Status.VALID] * 10
    assert read_manifest(entries[-1].path).to_json()["format_version"] == 2


def test_unchanged_tensors_are_neither_copied_nor_hashed(tmp_path, monkeypatch):
    """After the first save, only tensors that can have changed are hashed (a counting wrapper
    around the real content_key); an in-place change of a frozen tensor is seen."""
    import resilient_callbacks.blobs as blobs_mod

    hashed: list[tuple[int, ...]] = []
    real = blobs_mod.content_key

    def counting(t: torch.Tensor) -> str:
        hashed.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(blobs_mod, "content_key", counting)
    m = _model()
    state = _state(m)
    with Checkpointer(tmp_path, incremental=True, async_save=True) as ck:
        _train_step(state, 1)
        ck.save(1, state)
        ck._saver.wait_background()
        first = list(hashed)
        hashed.clear()
        _train_step(state, 2)
        ck.save(2, state)
        ck._saver.wait_background()
        # the frozen trunk's weights (the big ones) were not hashed again, nor copied
        assert (1024, 512) in first and (512, 1024) in first
        assert (1024, 512) not in hashed and (512, 1024) not in hashed
        assert (64, 512) in hashed  # the trained head was
        assert all(tuple(t.shape) != (1024, 512) for t in ck._saver.buffers._bufs.values())
        # an in-place change of a frozen tensor bumps its version counter: hashed, stored anew
        with torch.no_grad():
            m[0].weight.add_(1.0)
        hashed.clear()
        ck.save(3, state)
        ck._saver.wait_background()
        assert (1024, 512) in hashed
        want = m[0].weight.clone()
    fresh = _state(_model(seed=5))
    with Checkpointer(tmp_path, async_save=False) as ck2:
        assert ck2.restore(fresh) == 3
    assert torch.equal(fresh["model"][0].weight, want)


def test_hash_mode_sees_writes_through_data(tmp_path):
    """``.data`` writes bypass the version counter; incremental='hash' hashes every tensor."""
    m = _model()
    state = _state(m)
    with Checkpointer(tmp_path, incremental="hash", async_save=False) as ck:
        ck.save(1, state)
        m[0].weight.data.mul_(2.0)  # invisible to the version counter
        ck.save(2, state)
        want = m[0].weight.clone()
    fresh = _state(_model(seed=5))
    with Checkpointer(tmp_path, async_save=False) as ck2:
        assert ck2.restore(fresh) == 2
    assert torch.equal(fresh["model"][0].weight, want)


def test_retention_keeps_every_referenced_blob_and_deletes_the_rest(tmp_path):
    state = _state(_model())
    with Checkpointer(tmp_path, incremental=True, keep_last=2, async_save=True) as ck:
        for step in range(1, 8):
            _train_step(state, step)
            ck.save(step, state)
    names = set(os.listdir(tmp_path / "blobs"))
    assert names == live_blobs(str(tmp_path))  # nothing unreferenced left, nothing missing
    entries = catalog.scan(str(tmp_path), Depth.FULL)
    assert [e.manifest.step for e in entries] == [6, 7]
    assert all(e.status is Status.VALID for e in entries)
    # the frozen trunk was stored once and is shared by both
    a, b = (set(x.path for x in e.manifest.blobs) for e in entries)
    assert len(a & b) == 2


def test_the_memory_of_checked_blobs_stays_as_small_as_the_store(tmp_path):
    """Every blob written was remembered as checked for the life of the process, also once
    retention had deleted it (the long-run probe: 48,000 entries for 570 blobs on disk)."""
    state = _state(_model())
    with Checkpointer(tmp_path, incremental=True, keep_last=2, async_save=False) as ck:
        for step in range(1, 13):
            _train_step(state, step)
            ck.save(step, state)
            checked = ck._dir.blobs._checked
            assert checked <= set(os.listdir(tmp_path / "blobs")), step
        assert len(checked) <= len(live_blobs(str(tmp_path)))


def test_collect_never_deletes_a_pinned_blob(tmp_path):
    """A blob a save in flight wrote (or reuses) survives a collection until it is unpinned."""
    store = BlobStore(str(tmp_path))
    t = torch.arange(BLOB_MIN, dtype=torch.float32)
    key = content_key(t)
    with store.pinned([key]):
        entry = store.write(key, t)
        assert store.collect() == []
        assert os.path.exists(os.path.join(store.dir, entry.path))
    assert store.collect() == [entry.path]  # no manifest refers to it
    assert os.listdir(store.dir) == []


def _two_saves(root) -> list[str]:
    state = _state(_model())
    with Checkpointer(root, incremental=True, async_save=False) as ck:
        for step in (1, 2):
            _train_step(state, step)
            ck.save(step, state)
    return [e.path for e in catalog.scan(str(root), Depth.NONE)]


def _cli(capsys, *args: str) -> tuple[int, str]:
    """Run ``resilient-ckpt ARGS`` in this process: (exit status, stdout)."""
    from resilient_callbacks.cli import main

    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().out


def test_verify_checks_every_reference_and_restore_falls_back(tmp_path, capsys):
    paths = _two_saves(tmp_path)
    newest = read_manifest(paths[1])
    older = {b.path for b in read_manifest(paths[0]).blobs}
    only_newest = [b.path for b in newest.blobs if b.path not in older]
    assert only_newest
    with open(tmp_path / "blobs" / only_newest[0], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, out = _cli(capsys, "verify", str(tmp_path), "--all")
    assert rc == 1
    assert only_newest[0] in out and "checksum mismatch" in out
    assert "ok       step          1" in out
    fresh = _state(_model(seed=3))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with Checkpointer(tmp_path, async_save=False) as ck:
            assert ck.restore(fresh) == 1  # loudly, from the older one
    assert any(only_newest[0] in str(x.message) for x in w)
    # a missing shared blob: both checkpoints refer to it, both are reported
    os.unlink(tmp_path / "blobs" / sorted(older & {b.path for b in newest.blobs})[0])
    rc, out = _cli(capsys, "verify", str(tmp_path), "--all")
    assert rc == 1 and out.count("missing") == 2


def test_gc_reclaims_what_crashes_left_and_keeps_what_is_referenced(tmp_path, capsys):
    _two_saves(tmp_path)
    live = live_blobs(str(tmp_path))
    orphan = tmp_path / "blobs" / ("ab" * 16 + ".safetensors")
    orphan.write_bytes(b"x" * 10)
    tmp = tmp_path / "blobs" / (".tmp-" + "cd" * 16 + "-1234abcd")
    tmp.write_bytes(b"y")
    # what a crash left before the newest commit; and one blob written since (a live writer's
    # save in flight, which a dry run beside it listed as deleted; gc itself never runs then)
    old = os.stat(tmp_path / "step_000000001" / "manifest.json").st_mtime - 60
    for f in (orphan, tmp):
        os.utime(f, (old, old))
    since = tmp_path / "blobs" / ("ef" * 16 + ".safetensors")
    since.write_bytes(b"z")
    rc, out = _cli(capsys, "gc", str(tmp_path), "--dry-run", "--json")
    assert rc == 0
    said = json.loads(out)
    assert sorted(said["blobs_deleted"]) == sorted([orphan.name, tmp.name])
    assert said["blobs_since_newest"] == [since.name]
    rc, out = _cli(capsys, "gc", str(tmp_path), "--dry-run")
    assert "not counted: 1 blob(s) written since the newest checkpoint" in out, out
    assert orphan.exists()
    rc, out = _cli(capsys, "gc", str(tmp_path), "--keep-last", "1")
    assert rc == 0
    assert "blob(s) no remaining checkpoint refers to" in out
    left = set(os.listdir(tmp_path / "blobs"))
    assert left == live_blobs(str(tmp_path)) and left < live
    assert [e.status for e in catalog.scan(str(tmp_path), Depth.FULL)] == [Status.VALID]


def test_a_copy_of_a_checkpoint_in_the_directory_keeps_the_blobs_it_names(tmp_path, capsys):
    """The guide: your own folders in dirpath (a copy such as ``step_000000500.bak``) are never
    counted, loaded or deleted. The blobs such a copy named were deleted by retention and
    ``gc`` once no checkpoint named them, so the copy no longer loaded (a monitoring probe)."""
    import shutil

    state = _state(_model())
    with Checkpointer(tmp_path, incremental=True, keep_last=1, async_save=False) as ck:
        for step in range(1, 4):
            _train_step(state, step)
            ck.save(step, state)
        saved = _tensors(state)
        shutil.copytree(tmp_path / "step_000000003", tmp_path / "step_000000003.bak")
        for step in range(4, 7):  # the trained head's blobs of step 3 are no checkpoint's now
            _train_step(state, step)
            ck.save(step, state)
    rc, _ = _cli(capsys, "gc", str(tmp_path))
    assert rc == 0
    assert [e.manifest.step for e in catalog.scan(str(tmp_path), Depth.NONE)] == [6]
    back = _state(_model(seed=1))
    with Checkpointer(tmp_path, read_only=True, resume=str(tmp_path / "step_000000003.bak")) as r:
        assert r.restore(back) == 3
    for k, v in _tensors(back).items():
        assert torch.equal(v, saved[k]), k


def test_non_incremental_checkpoints_stay_version_1_and_load_into_incremental_runs(tmp_path):
    state = _state(_model())
    _train_step(state, 1)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, state)
    raw = json.loads((tmp_path / "step_000000001" / "manifest.json").read_text())
    assert raw["format_version"] == 1 and "blobs" not in raw
    assert all("codec" not in f for f in raw["files"])
    want = _tensors(state)
    fresh = _state(_model(seed=4))
    with Checkpointer(tmp_path, incremental=True, async_save=False) as ck:
        assert ck.restore(fresh) == 1
        _train_step(fresh, 2)
        ck.save(2, fresh)
    got = _tensors(_restored(tmp_path, 1))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert read_manifest(str(tmp_path / "step_000000002")).blobs


def _restored(root, step: int) -> dict:
    fresh = _state(_model(seed=7))
    with Checkpointer(root, resume=step, async_save=False) as ck:
        ck.restore(fresh)
    return fresh


def test_a_blob_reference_outside_the_store_is_refused(tmp_path):
    paths = _two_saves(tmp_path)
    mpath = os.path.join(paths[1], "manifest.json")
    with open(mpath) as f:
        raw = json.load(f)
    raw["blobs"][0]["path"] = "../step_000000001/shared.safetensors"
    raw[SELF_CHECKSUM] = self_checksum(raw)  # sealed again: a tampering that knows the format
    with open(mpath, "w") as f:
        json.dump(raw, f)
    with pytest.raises(UnsafeManifestError):
        read_manifest(paths[1])


def test_options_are_validated():
    with pytest.raises(ConfigError, match="incremental"):
        Checkpointer("/tmp/x-never-created", incremental="yes")
    with pytest.raises(ConfigError, match="compression="):
        Checkpointer("/tmp/x-never-created", compression="lz4")
    with pytest.raises(ConfigError, match="compression_level"):
        Checkpointer("/tmp/x-never-created", compression="zstd", compression_level=99)


def test_the_options_are_adapter_options(tmp_path):
    """Every adapter takes the Checkpointer's keyword options (the Lightning and Transformers
    callbacks through adapter.check_options, the DeepSpeed section through the same signature;
    the slow test below constructs each)."""
    from resilient_callbacks.adapter import checkpointer_options

    opts = {"incremental": True, "compression": "none", "compression_level": 2}
    assert set(opts) | {"compression_shuffle"} <= checkpointer_options()
    with Checkpointer(tmp_path, **opts) as ck:
        assert ck.config.incremental is True and ck.config.compression_level == 2


@pytest.mark.slow  # imports lightning, transformers and deepspeed
def test_the_options_pass_through_every_adapter(tmp_path):
    """The Lightning and Transformers callbacks take (and validate at construction) the options
    like any Checkpointer option; the DeepSpeed JSON section accepts them as keys."""
    pytest.importorskip("zstandard")
    opts = {"incremental": True, "compression": "zstd", "compression_level": 2}
    section = pytest.importorskip("resilient_callbacks.deepspeed.section")
    got = section.validate({"dirpath": str(tmp_path), **opts})
    assert {k: got[k] for k in opts} == opts
    lightning = pytest.importorskip("resilient_callbacks.lightning")
    cb = lightning.ResilientCheckpoint(tmp_path, **opts)
    assert {k: cb._kwargs[k] for k in opts} == opts
    with pytest.raises(ConfigError, match="incremental"):
        lightning.ResilientCheckpoint(tmp_path, incremental="sometimes")
    hf = pytest.importorskip("resilient_callbacks.transformers")
    cb2 = hf.ResilientCheckpoint(tmp_path, **opts)
    assert {k: cb2.options[k] for k in opts} == opts
    with pytest.raises(ConfigError, match="compression_level"):
        hf.ResilientCheckpoint(tmp_path, compression="zstd", compression_level=100)


def _watched(t: torch.Tensor):
    """What a FilePart's save watches of ``t`` now (as ``filepart`` calls ``watch_all``)."""
    from resilient_callbacks.unchanged import watch_all

    return watch_all({"w": t}, None).get("w")


def test_part_tracker_trusts_only_the_buffer_it_recorded():
    """A FilePart tensor is known unchanged only while the very host buffer its bytes were
    copied into at the committed save is still its buffer: a buffer made again (freed when a
    save did not capture the tensor, or remade for another shape) holds nothing of it, even
    though the tensor's place and version counter are unchanged."""
    from resilient_callbacks.unchanged import PartTracker, buffer_sig

    frozen = torch.arange(BLOB_MIN, dtype=torch.float32)
    watched = _watched(frozen)
    assert watched is not None
    buf = frozen.clone()
    tracker = PartTracker()
    tracker.record({"w": (*watched, buf)}, {buffer_sig(buf): "key-of-w"})
    assert tracker.unchanged("w", watched, buf) == "key-of-w"
    assert tracker.unchanged("w", watched, None) is None  # freed
    assert tracker.unchanged("w", watched, torch.empty_like(buf)) is None  # made again
    assert tracker.unchanged("w", _watched(frozen), buf) == "key-of-w"
    with torch.no_grad():
        frozen.add_(1)  # an in-place write bumps the version counter
    assert tracker.unchanged("w", _watched(frozen), buf) is None


def test_batchnorm_statistics_and_a_fused_optimizers_weights_are_never_taken_as_unchanged(
    tmp_path,
):
    """Only frozen parameters are ever known unchanged: BatchNorm's running statistics and a
    fused optimizer's step (``model.state_dict()`` in the state, where nothing says which
    tensors train) change tensors in place without moving their version counters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4096), nn.BatchNorm1d(4096), nn.Linear(4096, 1))
    fused = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    for background in (False, True):
        root = tmp_path / f"bg{background}"
        with Checkpointer(root, incremental=True, async_save=background) as ck:
            for step in (1, 2, 3):
                model(torch.randn(32, 16) + step).square().mean().backward()
                fused.step()
                fused.zero_grad()
                ck.save(step, {"plain": model.state_dict(), "module": model})
        live = {k: v.clone() for k, v in model.state_dict().items()}
        got = {"plain": {k: torch.zeros_like(v) for k, v in live.items()}, "module": None}
        with Checkpointer(root) as ck:
            assert ck.restore(got) == 3
        for k, v in live.items():
            assert torch.equal(got["plain"][k], v), k
            assert torch.equal(got["module"][k], v), k


def test_distinct_tensors_of_equal_bytes_are_restored_as_distinct_tensors(tmp_path):
    """Equal bytes share a blob; restored, each tensor is its own (an optimizer keeps the
    tensors it is given: Adam's two zero moments of a parameter no gradient reached yet must
    not become one)."""
    zeros = {"exp_avg": torch.zeros(8192), "exp_avg_sq": torch.zeros(8192)}
    with Checkpointer(tmp_path, incremental=True) as ck:
        ck.save(1, {"moments": zeros, "arrays": {"a": np.zeros(8192), "b": np.zeros(8192)}})
    got = {"moments": {"exp_avg": None, "exp_avg_sq": None}, "arrays": {"a": None, "b": None}}
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(got) == 1
    m, a = got["moments"], got["arrays"]
    assert m["exp_avg"].data_ptr() != m["exp_avg_sq"].data_ptr()
    m["exp_avg"].add_(1)
    assert torch.equal(m["exp_avg_sq"], torch.zeros(8192))
    a["a"] += 1
    assert not a["b"].any()


@pytest.mark.parametrize("async_save", [False, True])
def test_an_ema_updated_through_data_is_never_restored_stale(tmp_path, async_save):
    """An EMA copy with frozen parameters updated through ``.data`` (a common pattern): the
    version counter does not see those writes, so ``incremental=True`` used to refer every
    save to the EMA's first blob and restore the first EMA silently. Each save compares a
    sample of every tensor it would skip; a change it finds is hashed and stored, and the
    run is told, once, to use ``incremental="hash"``."""
    import copy

    m = _model()
    state = _state(m)
    ema = copy.deepcopy(m).requires_grad_(False)
    state["ema"] = ema
    want: dict[int, dict[str, torch.Tensor]] = {}
    with (
        Checkpointer(tmp_path, incremental=True, async_save=async_save) as ck,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            _train_step(state, step)
            for pe, p in zip(ema.parameters(), m.parameters(), strict=True):
                pe.data.mul_(0.9).add_(p.data + 1.0, alpha=0.1)
            ck.save(step, state)
            want[step] = {k: v.clone() for k, v in ema.state_dict().items()}
    for step, tensors in want.items():
        fresh = _state(_model(seed=5))
        fresh["ema"] = copy.deepcopy(fresh["model"]).requires_grad_(False)
        with Checkpointer(tmp_path, resume=step, read_only=True) as ck2:
            assert ck2.restore(fresh) == step
        for k, v in tensors.items():
            assert torch.equal(fresh["ema"].state_dict()[k], v), (step, k)
    said = [str(w.message) for w in caught if "version counter" in str(w.message)]
    assert len(said) == 1 and "incremental='hash'" in said[0], said


def test_part_tracker_sees_a_write_through_data():
    """A FilePart's frozen tensor written through ``.data`` (its version counter does not
    move) is not taken as unchanged: the sample of its elements differs."""
    from resilient_callbacks.unchanged import PartTracker, buffer_sig

    frozen = torch.arange(4 * BLOB_MIN, dtype=torch.float32)
    watched = _watched(frozen)
    assert watched is not None
    buf = frozen.clone()
    tracker = PartTracker()
    tracker.record({"w": (*watched, buf)}, {buffer_sig(buf): "key-of-w"})
    assert tracker.unchanged("w", _watched(frozen), buf) == "key-of-w"
    frozen.data.mul_(0.5)
    again = _watched(frozen)
    assert again is not None and again[2] == watched[2]  # the counter did not move
    with pytest.warns(UserWarning, match="version counter"):
        assert tracker.unchanged("w", again, buf) is None


def test_a_transposed_frozen_tensor_is_still_known_unchanged_and_checked():
    """The sample of a tensor without a flat view (a transposed weight) is gathered by index:
    it is still known unchanged while nothing writes it, and a write through ``.data`` shows."""
    from resilient_callbacks.unchanged import UnchangedTracker

    frozen = nn.Parameter(torch.randn(64, 512).t(), requires_grad=False)
    module = nn.Module()
    module.w = frozen
    assert not frozen.is_contiguous()
    tracker = UnchangedTracker()
    hints, watch = tracker.observe({"m.w": frozen}, {"m": module})
    assert not hints and "m.w" in watch
    tracker.record(watch, {"m.w": "key-of-w"})
    assert tracker.observe({"m.w": frozen}, {"m": module})[0] == {"m.w": "key-of-w"}
    frozen.data[-1, -1] += 1.0  # the last element is always in the sample
    with pytest.warns(UserWarning, match="version counter"):
        assert tracker.observe({"m.w": frozen}, {"m": module}) == ({}, {})


def test_a_transposed_tensors_sample_is_gathered_with_indices_made_on_its_device():
    """The sample of a transposed frozen tensor was gathered with indices made on the host
    (``torch.tensor``, and ``unravel_index``'s shape tensors) and copied to the tensor's
    device: on a GPU each such copy waits for every queued kernel, three more waits of the
    training thread per tensor and save. No tensor is made from host data now, nor copied
    (``tests/test_gpu_since_h200.py`` counts the waits on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from resilient_callbacks.unchanged import _picks

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    t = torch.randn(64, 512).t()
    with Ops() as ops:
        picked = _picks(t)
    made_on_the_host = [n for n in ops.names if n.split(".")[0] in ("lift_fresh", "_to_copy")]
    assert made_on_the_host == [], ops.names
    step = (t.numel() // 256) | 1
    want = torch.cat([t.contiguous().view(-1)[::step], t.contiguous().view(-1)[-1:]])
    assert torch.equal(picked, want.view(torch.uint8))


def test_one_command_reads_a_blob_that_checkpoints_share_once(tmp_path, capsys, monkeypatch):
    """``ls``, ``verify --all``, ``gc`` and ``verify URL --all`` check every checkpoint's
    checksums; the frozen trunk's blobs, which every checkpoint names, are read once per
    command, not once per checkpoint (a LoRA run with keep_last=5 on a 28 GB base read 140 GB
    for one ``ls``). A shared blob found damaged still makes every checkpoint naming it
    corrupt."""
    from resilient_callbacks import remote_verify, verification

    url = f"file://{tmp_path}/durable"
    state = _state(_model())
    root = tmp_path / "run"
    with Checkpointer(root, incremental=True, async_save=False, remote=url) as ck:
        for step in (1, 2, 3):
            _train_step(state, step)
            ck.save(step, state)
    shared = set.intersection(
        *({b.path for b in read_manifest(e.path).blobs} for e in catalog.scan(str(root)))
    )
    assert len(shared) == 2  # the trunk's two weights
    reads: list[str] = []
    real_digest, real_check = verification.digest_file, remote_verify._check
    monkeypatch.setattr(
        verification, "digest_file", lambda p, **kw: reads.append(p) or real_digest(p, **kw)
    )
    monkeypatch.setattr(
        remote_verify, "_check", lambda st, p, *a: reads.append(p) or real_check(st, p, *a)
    )

    def shared_reads() -> dict[str, int]:
        got = {n: sum(os.path.basename(p) == n for p in reads) for n in shared}
        reads.clear()
        return got

    for cmd in (["ls", str(root)], ["verify", str(root), "--all"], ["gc", str(root)]):
        assert _cli(capsys, *cmd)[0] == 0, cmd
        assert set(shared_reads().values()) == {1}, cmd
    assert _cli(capsys, "verify", url, "--all")[0] == 0
    assert set(shared_reads().values()) == {1}
    victim = tmp_path / "run" / "blobs" / sorted(shared)[0]
    data = bytearray(victim.read_bytes())
    data[-4] ^= 0xFF
    victim.write_bytes(bytes(data))
    rc, out = _cli(capsys, "verify", str(root), "--all")
    assert rc == 1 and out.count("checksum mismatch") == 3, out


def test_verify_of_a_newest_checkpoint_whose_shared_blob_is_missing_says_what_it_shares(
    tmp_path, capsys
):
    """``verify DIR`` (the newest only) of a checkpoint whose blob, named by every checkpoint,
    is missing: the hint says every checkpoint naming that blob is corrupt too and how to find
    a whole one, instead of only "`inspect` shows the newest valid one" (there is none)."""
    paths = _two_saves(tmp_path)
    shared = {b.path for b in read_manifest(paths[0]).blobs} & {
        b.path for b in read_manifest(paths[1]).blobs
    }
    os.unlink(tmp_path / "blobs" / sorted(shared)[0])
    from resilient_callbacks.cli import main

    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert sorted(shared)[0] in err and "every checkpoint that names it" in err, err
    assert "--all" in err and "pull" in err, err
