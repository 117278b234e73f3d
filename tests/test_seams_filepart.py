"""The FilePart seam with a toy part that owns its files (as a DeepSpeed engine owns its ZeRO
partitions): captured into reused host buffers on the training thread, written through the
core's hashing writers under ``parts/<id>/``, listed and verified like every file, restored
from verified files only; a corrupt file of the newest checkpoint makes restore fall back, loudly,
to the previous one. One rank."""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import spawn_ranks
from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.errors import (
    CheckpointMismatchError,
    ResumeFallbackWarning,
    UnsupportedStateError,
)
from resilient_callbacks.filepart import CaptureBuffers, FilePart, PartInfo, PartReader, PartWriter


class ToyShards(FilePart):
    """One tensor per rank in its own safetensors file, and a JSON file of metadata."""

    def __init__(self, n: int = 64) -> None:
        self.weight = torch.zeros(n)
        self.note = "fresh"
        self.buffer_ptrs: list[int] = []
        self.loaded: list[str] | None = None

    def capture(self, buffers: CaptureBuffers) -> dict[str, Any]:
        buf = buffers.get("weight", self.weight)
        buf.copy_(self.weight)
        self.buffer_ptrs.append(buf.data_ptr())
        return {"weight": buf, "meta": {"note": self.note, "n": self.weight.numel()}}

    def write(self, captured: dict[str, Any], writer: PartWriter) -> None:
        writer.tensors(f"shard_{writer.rank:05d}.safetensors", {"weight": captured["weight"]})
        writer.json(f"meta_{writer.rank:05d}.json", captured["meta"])

    def describe(self) -> dict[str, Any]:
        return {"n": self.weight.numel(), "layout": "one shard per rank"}

    def files_to_read(self, info: PartInfo) -> list[str]:
        if info.saved_world_size != info.world_size:
            raise CheckpointMismatchError("saved with another world size")
        if info.saved.get("n") != self.weight.numel():
            raise CheckpointMismatchError(
                f"shards of {info.saved.get('n')} elements saved, this part has "
                f"{self.weight.numel()}"
            )
        return [f"shard_{info.rank:05d}.safetensors", f"meta_{info.rank:05d}.json"]

    def load(self, reader: PartReader) -> None:
        rank = reader.info.rank
        self.weight.copy_(reader.tensors(f"shard_{rank:05d}.safetensors")["weight"])
        self.note = reader.json(f"meta_{rank:05d}.json")["note"]
        self.loaded = sorted(n for n, r in reader.info.listed.items() if r == rank)


class LiveFails(ToyShards):
    """ToyShards whose ``files_to_read`` asks a live object for its layout, which fails on the
    ranks in ``failing`` (as an engine whose partitions are not built, or an optimizer that
    cannot give its state dict): nothing of the checkpoint is read when it raises."""

    def __init__(self, failing: tuple[int, ...]) -> None:
        super().__init__()
        self.failing = failing

    def files_to_read(self, info: PartInfo) -> list[str]:
        if info.rank in self.failing:
            raise RuntimeError(f"rank {info.rank}: the live engine has no partitions yet")
        return super().files_to_read(info)


def _state(part: ToyShards) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": nn.Linear(4, 2), "engine": {"shards": part}, "step": 0}


def _save_two(root: str) -> ToyShards:
    part = ToyShards()
    state = _state(part)
    with Checkpointer(root, keep_last=5, preemption=False) as ck:
        for step in (5, 10):
            part.weight.fill_(step)
            part.note = f"step {step}"
            assert ck.save(step, state)
            part.weight.fill_(-1)  # after the capture: must not reach the checkpoint
    return part


def worker(phase: str, root: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    res: dict[str, Any] = {"rank": rank}
    if phase == "save":
        part = ToyShards()
        state = _state(part)
        with Checkpointer(root, preemption=False) as ck:
            for step in (5, 10):
                part.weight.fill_(step * 100 + rank)
                part.note = f"rank {rank} step {step}"
                ck.save(step, state)
    else:
        import warnings

        fresh = LiveFails((1,)) if phase == "live_fails" else ToyShards()
        with warnings.catch_warnings(record=True) as caught, Checkpointer(root) as ck:
            warnings.simplefilter("always")
            try:
                res["restored"] = ck.restore(_state(fresh))
            except Exception as e:
                res["error"] = f"{type(e).__name__}: {e}"
        res["weight"] = fresh.weight[0].item()
        res["note"] = fresh.note
        res["fallback_warnings"] = [
            str(w.message) for w in caught if issubclass(w.category, ResumeFallbackWarning)
        ]
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    spawn_ranks.leave_group()


def test_a_filepart_is_written_verified_and_restored(tmp_path):
    root = str(tmp_path / "ck")
    part = _save_two(root)
    assert len(set(part.buffer_ptrs)) == 1  # the same host buffer, reused by both saves

    newest = os.path.join(root, "step_000000010")
    with open(os.path.join(newest, "manifest.json")) as f:
        manifest = json.load(f)
    listed = {f["path"]: f for f in manifest["files"]}
    for name in ("shard_00000.safetensors", "meta_00000.json"):
        entry = listed[f"parts/engine/shards/{name}"]
        assert entry["rank"] == 0 and entry["size"] == os.path.getsize(
            os.path.join(newest, "parts", "engine", "shards", name)
        )
    # what the part's describe() said is in the manifest, by part id
    assert manifest["extra"]["parts"] == {
        "engine/shards": {"n": 64, "layout": "one shard per rank"}
    }
    entries = catalog.scan(root, catalog.Depth.FULL)  # every checksum, the part's files too
    assert [(e.name, str(e.status)) for e in entries] == [
        ("step_000000005", "valid"),
        ("step_000000010", "valid"),
    ]

    fresh = ToyShards()
    with Checkpointer(root, preemption=False) as ck:
        assert ck.restore(_state(fresh)) == 10
    assert torch.equal(fresh.weight, torch.full((64,), 10.0))
    assert fresh.note == "step 10"
    assert fresh.loaded == ["meta_00000.json", "shard_00000.safetensors"]


def test_a_corrupt_filepart_file_falls_back_loudly_to_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ck")
    _save_two(root)
    shard = os.path.join(
        root, "step_000000010", "parts", "engine", "shards", "shard_00000.safetensors"
    )
    with open(shard, "r+b") as f:  # same size, other bytes: only the checksum can tell
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)

    fresh = ToyShards()
    with (
        Checkpointer(root, preemption=False) as ck,
        pytest.warns(ResumeFallbackWarning, match="shard_00000.safetensors"),
    ):
        assert ck.restore(_state(fresh)) == 5
    assert torch.equal(fresh.weight, torch.full((64,), 5.0))
    assert fresh.note == "step 5"


def test_a_part_refuses_a_checkpoint_it_cannot_load_early_without_falling_back(tmp_path):
    """files_to_read() compares what describe() recorded with the live part: a mismatch is
    raised (not a silent fallback to an older checkpoint, which would not fit either) before
    anything of the state is loaded."""
    root = str(tmp_path / "ck")
    _save_two(root)
    smaller = ToyShards(n=32)
    state = _state(smaller)
    torch.manual_seed(1)
    state["model"] = nn.Linear(4, 2)
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with (
        Checkpointer(root, preemption=False) as ck,
        warnings.catch_warnings(record=True) as caught,
        pytest.raises(
            CheckpointMismatchError, match="shards of 64 elements saved, this part has 32"
        ),
    ):
        warnings.simplefilter("always")
        ck.restore(state)
    assert not [w for w in caught if issubclass(w.category, ResumeFallbackWarning)]
    for k, v in state["model"].state_dict().items():  # nothing of the state was loaded
        assert torch.equal(v, before[k]), k
    assert smaller.loaded is None and smaller.note == "fresh"


def test_a_live_objects_error_in_files_to_read_is_a_refusal_not_a_damaged_checkpoint(tmp_path):
    """files_to_read() asks the live objects the part holds (an engine, a model, an optimizer)
    before any file of the checkpoint is read. Their error was taken for damage: step 10 was
    skipped with a ResumeFallbackWarning ("unreadable checkpoint"), then step 5, and the
    restore ended in NoValidCheckpointError over two valid checkpoints (or loaded an older one
    where that one got through). Now it is refused on the newest, naming the error, nothing
    skipped or loaded."""
    root = str(tmp_path / "ck")
    _save_two(root)
    part = LiveFails((0,))
    state = _state(part)
    torch.manual_seed(1)
    state["model"] = nn.Linear(4, 2)
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with (
        Checkpointer(root, preemption=False) as ck,
        warnings.catch_warnings(record=True) as caught,
        pytest.raises(CheckpointMismatchError) as raised,
    ):
        warnings.simplefilter("always")
        ck.restore(state)
    msg = str(raised.value)
    assert "step_000000010" in msg and "engine/shards" in msg, msg
    assert "RuntimeError: rank 0: the live engine has no partitions yet" in msg, msg
    assert not [w for w in caught if issubclass(w.category, ResumeFallbackWarning)]
    assert ck.restored_from is None
    for k, v in state["model"].state_dict().items():  # nothing of the state was loaded
        assert torch.equal(v, before[k]), k
    assert part.loaded is None and part.note == "fresh"
    # both checkpoints are still valid ones (none was marked, moved or counted as damaged)
    entries = catalog.scan(root, catalog.Depth.FULL)
    assert [(e.name, str(e.status)) for e in entries] == [
        ("step_000000005", "valid"),
        ("step_000000010", "valid"),
    ]


def test_a_part_that_describes_itself_with_non_json_values_fails_the_save_clearly(tmp_path):
    class Odd(ToyShards):
        def describe(self) -> dict[str, Any]:
            return {"dtype": torch.float32}

    with (
        Checkpointer(str(tmp_path / "ck"), preemption=False, async_save=False) as ck,
        pytest.raises(UnsupportedStateError, match=r"describe\(\) must return JSON-able values"),
    ):
        ck.save(1, _state(Odd()))
    assert not any(n.startswith("step_") for n in os.listdir(tmp_path / "ck"))


def test_a_checkpoint_without_the_part_does_not_fit_a_state_with_it(tmp_path):
    root = str(tmp_path / "ck")
    with Checkpointer(root, preemption=False) as ck:
        ck.save(3, {"model": nn.Linear(4, 2), "engine": {"shards": 0}, "step": 0})
    with (
        Checkpointer(root, preemption=False) as ck,
        pytest.raises(CheckpointMismatchError, match="not a part"),
    ):
        ck.restore(_state(ToyShards()))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_each_write_and_verify_their_own_files_and_fall_back_together(tmp_path):
    from test_distributed import run_ranks

    root, out = tmp_path / "ck", tmp_path / "out"

    def run(phase: str) -> list[dict[str, Any]]:
        run_ranks([sys.executable, __file__, phase, str(root), str(out)], tmp_path, phase)
        return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]

    run("save")
    folder = root / "step_000000010" / "parts" / "engine" / "shards"
    assert sorted(os.listdir(folder)) == [
        "meta_00000.json",
        "meta_00001.json",
        "shard_00000.safetensors",
        "shard_00001.safetensors",
    ]
    with open(root / "step_000000010" / "manifest.json") as f:
        ranks = {e["path"]: e["rank"] for e in json.load(f)["files"] if "/" in e["path"]}
    assert ranks["parts/engine/shards/shard_00001.safetensors"] == 1

    # Corrupt only rank 1's shard: rank 0 could load step 10, but the ranks agree to fall back.
    with open(folder / "shard_00001.safetensors", "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    res = run("restore")
    for r in range(2):
        assert res[r]["restored"] == 5
        assert res[r]["weight"] == 500 + r and res[r]["note"] == f"rank {r} step 5"
    assert any("rank 1" in w and "shard_00001" in w for w in res[0]["fallback_warnings"])

    # Rank 1's live object fails in files_to_read(): both ranks refuse the newest checkpoint
    # together, naming it; nothing is skipped (it was taken for damage: both fell back)
    res = run("live_fails")
    for r in range(2):
        assert "restored" not in res[r], res[r]
        error = res[r]["error"]
        assert error.startswith("CheckpointMismatchError: "), error
        assert "step_000000010" in error and "rank 1: part 'engine/shards'" in error, error
        assert "RuntimeError: rank 1: the live engine has no partitions yet" in error, error
        assert res[r]["fallback_warnings"] == [], res[r]
        assert res[r]["weight"] == 0 and res[r]["note"] == "fresh", res[r]

    # The same checkpoints on one rank: the part refuses them (saved by 2 ranks), agreed and
    # early, and restore raises instead of falling back through every older checkpoint.
    with (
        Checkpointer(str(root), preemption=False) as ck,
        pytest.raises(CheckpointMismatchError, match="saved with another world size"),
    ):
        ck.restore(_state(ToyShards()))


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3])


class ToyAhead(ToyShards):
    """ToyShards that says ahead what it copies, and one buffer more that it never uses."""

    def host_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "unused": torch.zeros(1000)}


def test_a_parts_host_buffers_are_made_ahead_and_the_unused_freed(tmp_path):
    """The first step() that does not save starts the part's host buffers from host_tensors()
    in a helper thread; the first save copies into them, and the one it did not use is freed
    after it. A part without host_tensors() gets its buffers at the first save, as before."""
    part = ToyAhead()
    state = _state(part)
    with Checkpointer(tmp_path / "ck", every_n_steps=2, preemption=False) as ck:
        assert ck.step(1, state) is False
        ahead = ck._saver.part_buffers._by_id["engine/shards"]
        ahead.wait_allocated()
        made = {k: b.data_ptr() for k, b in ahead._bufs.items()}
        assert sorted(made) == ["unused", "weight"]
        part.weight.fill_(2.0)
        assert ck.step(2, state) is True
        ck.flush()
        assert part.buffer_ptrs == [made["weight"]]  # the save copied into the one made ahead
        assert sorted(ahead._bufs) == ["weight"]  # the unused one is gone
    part2 = ToyShards()
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(_state(part2)) == 2
    assert torch.equal(part2.weight, torch.full((64,), 2.0))

    plain = ToyShards()
    with Checkpointer(tmp_path / "ck2", every_n_steps=2, preemption=False) as ck:
        ck.step(1, _state(plain))
        assert "engine/shards" not in ck._saver.part_buffers._by_id


class _QuietRefuses:
    """A state object whose read for the allocation ahead refuses (as Lightning's dictionary
    does where ``on_save_checkpoint`` hooks decide what a save holds)."""

    def state_dict(self) -> dict[str, Any]:
        from resilient_callbacks import statetree

        if statetree.is_probe():
            raise RuntimeError("hooks decide what a save holds")
        return {"n": 1}

    def load_state_dict(self, sd: Any) -> None:
        pass


def test_a_parts_host_buffers_are_made_ahead_where_the_rest_of_the_state_cannot_be_read(
    tmp_path,
):
    """The rest of the state unreadable ahead of the first save (a Lightning module with an
    on_save_checkpoint hook under FSDP) cost the part's buffers too: the first save allocated
    the sharded model's and optimizer's host copies on the training thread."""
    part = ToyAhead()
    state = {**_state(part), "lightning": _QuietRefuses()}
    with Checkpointer(tmp_path / "ck", every_n_steps=2, preemption=False) as ck:
        assert ck.step(1, state) is False
        assert not ck._saver.buffers.nbytes  # (nothing of the rest read, nothing made)
        ahead = ck._saver.part_buffers._by_id["engine/shards"]
        ahead.wait_allocated()
        assert sorted(ahead._bufs) == ["unused", "weight"]
        assert ck.step(2, state) is True


@pytest.mark.parametrize(
    "key",
    ["k" * 300, "ü" * 150, "..", ".", "", "a\nb", "..hidden", "x/y.z", "sp ace %20 #?=+"],
    ids=[
        "300-bytes",
        "300-bytes-unicode",
        "dotdot",
        "dot",
        "empty",
        "newline",
        "dotdot-start",
        "slash",
        "odd",
    ],
)
def test_a_filepart_under_any_key_keeps_its_files_in_the_checkpoint(tmp_path, key):
    """A FilePart's folder is its keys' path under parts/: a key of 300 bytes failed the save
    (File name too long), ``..`` put the part's files beside the manifest (``"../.."``
    outside the checkpoint), an empty key or ``.`` in parts/ itself. Such an id gets a
    folder named by its hash; a plain one stays as it was (``x/y.z``: two folders)."""
    root = tmp_path / "ck"
    part = ToyShards()
    part.weight.fill_(7)
    with Checkpointer(root, preemption=False, async_save=False) as ck:
        assert ck.save(1, {"outer": {key: part}})
    newest = root / "step_000000001"
    with open(newest / "manifest.json") as f:
        paths = [x["path"] for x in json.load(f)["files"]]
    shards = [p for p in paths if p.endswith("shard_00000.safetensors")]
    assert len(shards) == 1 and shards[0].startswith("parts/")
    folder = (newest / shards[0]).parent.resolve()
    assert folder.is_relative_to((newest / "parts").resolve()) and folder != newest / "parts"
    assert all(len(n.encode()) <= 255 for p in paths for n in p.split("/"))
    if key in ("x/y.z", "sp ace %20 #?=+"):
        assert shards[0] == f"parts/outer/{key}/shard_00000.safetensors"
    fresh = ToyShards()
    with Checkpointer(root, preemption=False) as ck:
        assert ck.restore({"outer": {key: fresh}}) == 1
    assert torch.equal(fresh.weight, torch.full((64,), 7.0))


@pytest.mark.parametrize(
    "key", ["k" * 220, "..hidden", "nb\xa0sp"], ids=["220-bytes", "dotdot-start", "nbsp"]
)
def test_a_part_saved_in_its_plain_folder_before_hashed_folders_is_restored(
    tmp_path, monkeypatch, key
):
    """Before d5fd484 every part's folder was ``parts/<id>``: a key of 201 to 255 bytes, one
    starting with ``..`` or with a character that is not printable saved and
    restored there. Such an id now gets a hashed folder for new saves; the readers looked
    for the old checkpoint's files there and refused it as naming no files of the part."""
    from resilient_callbacks import filepart

    root = tmp_path / "ck"
    part = ToyShards()
    part.weight.fill_(3)
    with monkeypatch.context() as m:  # the writer as it was: parts/<id> for any id
        m.setattr(filepart, "part_dir", lambda part_id: f"parts/{part_id}")
        with Checkpointer(root, preemption=False, async_save=False) as ck:
            assert ck.save(1, {"outer": {key: part}})
    with open(root / "step_000000001" / "manifest.json") as f:
        paths = [x["path"] for x in json.load(f)["files"]]
    assert f"parts/outer/{key}/shard_00000.safetensors" in paths
    fresh = ToyShards()
    with Checkpointer(root, preemption=False, async_save=False) as ck:
        assert ck.restore({"outer": {key: fresh}}) == 1
        assert torch.equal(fresh.weight, torch.full((64,), 3.0))
        part.weight.fill_(4)
        assert ck.save(2, {"outer": {key: part}})  # a new save: the hashed folder
    with open(root / "step_000000002" / "manifest.json") as f:
        paths = [x["path"] for x in json.load(f)["files"]]
    assert any(p.startswith("parts/..") for p in paths), paths
    with Checkpointer(root, preemption=False, read_only=True) as ck:
        assert ck.restore({"outer": {key: fresh}}) == 2
    assert torch.equal(fresh.weight, torch.full((64,), 4.0))
