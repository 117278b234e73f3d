"""``incremental=True`` with FileParts (DCP shards, ZeRO partitions): each rank's part tensors of
at least 16 KiB are blobs, so a frozen base model under FSDP (LoRA) is written once per run,
not at every save. One rank with a toy part, then FSDP2 on 2 gloo ranks (frozen first layer,
trained head): what each save writes, exact restore on 2 ranks and resharded onto 1, reuse
after a restart, collection by retention, a damaged blob."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.errors import ResumeFallbackWarning
from resilient_callbacks.filepart import CaptureBuffers, FilePart, PartInfo, PartReader, PartWriter
from torch_needs import needs_dcp

FROZEN = 64 * 1024  # elements: 256 KiB of fp32, a blob
TRAINED = 8 * 1024  # 32 KiB, a blob that changes at every save


class FrozenAndTrained(FilePart):
    """One rank's file of a frozen tensor, a trained one and a small one (stays in the file)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.frozen = torch.randn(FROZEN, generator=g)
        self.trained = torch.zeros(TRAINED)
        self.small = torch.zeros(16)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"frozen": self.frozen, "trained": self.trained, "small": self.small}

    def capture(self, buffers: CaptureBuffers) -> dict[str, torch.Tensor]:
        return buffers.copy(self.tensors())

    def write(self, captured: dict[str, torch.Tensor], writer: PartWriter) -> None:
        writer.tensors(f"rank_{writer.rank:05d}.safetensors", captured)

    def files_to_read(self, info: PartInfo) -> list[str]:
        return [f"rank_{info.rank:05d}.safetensors"]

    def load(self, reader: PartReader) -> None:
        got = reader.tensors(f"rank_{reader.info.rank:05d}.safetensors")
        for name, live in self.tensors().items():
            live.copy_(got[name])


def _train(part: FrozenAndTrained, step: int) -> None:
    part.trained.fill_(float(step))
    part.small.fill_(-float(step))


def _blobs(root: Path) -> list[str]:
    d = root / "blobs"
    return sorted(os.listdir(d)) if d.is_dir() else []


def _manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "manifest.json").read_text())


def test_a_frozen_part_tensor_is_written_once_and_every_checkpoint_restores(tmp_path):
    root = tmp_path / "ck"
    part = FrozenAndTrained()
    written = []
    with Checkpointer(root, keep_last=2, incremental=True, preemption=False) as ck:
        for step in (1, 2, 3, 4):
            _train(part, step)
            ck.save(step, {"engine": part})
            ck.flush()
            written.append(ck.last_save.written)
    # the first save writes everything; later ones all but the frozen tensor (the trained one,
    # the part's small file, the RNG states and the structure)
    assert written[0] > FROZEN * 4
    assert all(TRAINED * 4 <= w <= written[0] - FROZEN * 4 for w in written[1:]), written
    # two checkpoints kept; the trained tensors of the deleted ones were collected
    assert [e.name for e in catalog.scan(str(root), catalog.Depth.FULL)] == [
        "step_000000003",
        "step_000000004",
    ]
    assert len(_blobs(root)) == 3  # frozen + the trained tensor of steps 3 and 4
    newest = root / "step_000000004"
    m = _manifest(newest)
    assert len(m["blobs"]) == 2 and not (newest / "blobs").exists()
    part_file = newest / "parts" / "engine" / "rank_00000.safetensors"
    assert os.path.getsize(part_file) < 4096  # only the small tensor is inside
    assert not [n for n in os.listdir(root) if n.startswith(".staging")]

    for step in (3, 4):  # each kept checkpoint, restored on its own
        fresh = FrozenAndTrained()
        fresh.frozen.zero_()
        with Checkpointer(root, resume=str(root / f"step_{step:09d}"), preemption=False) as ck:
            assert ck.restore({"engine": fresh}) == step
        assert torch.equal(fresh.frozen, part.frozen)
        assert torch.equal(fresh.trained, torch.full((TRAINED,), float(step)))
        assert torch.equal(fresh.small, torch.full((16,), -float(step)))


def test_after_a_restart_the_first_save_reuses_the_restored_blobs(tmp_path):
    root = tmp_path / "ck"
    part = FrozenAndTrained()
    with Checkpointer(root, incremental=True, preemption=False) as ck:
        _train(part, 1)
        ck.save(1, {"engine": part})
    before = set(_blobs(root))

    again = FrozenAndTrained()
    with Checkpointer(root, incremental=True, preemption=False) as ck:
        assert ck.restore({"engine": again}) == 1
        _train(again, 2)
        ck.save(2, {"engine": again})
        ck.flush()
        assert ck.last_save.written < FROZEN * 4 // 2  # the frozen tensor: not again
    assert len(set(_blobs(root)) - before) == 1  # the new trained tensor only


def test_a_damaged_part_blob_makes_restore_fall_back_loudly(tmp_path):
    root = tmp_path / "ck"
    part = FrozenAndTrained()
    with Checkpointer(root, incremental=True, preemption=False) as ck:
        for step in (1, 2):
            _train(part, step)
            ck.save(step, {"engine": part})
    # the trained tensor of step 2 exists only in the newest checkpoint: flip a byte of it
    m1, m2 = _manifest(root / "step_000000001"), _manifest(root / "step_000000002")
    (only_newest,) = {b["path"] for b in m2["blobs"]} - {b["path"] for b in m1["blobs"]}
    with open(root / "blobs" / only_newest, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    fresh = FrozenAndTrained()
    with (
        warnings.catch_warnings(record=True) as caught,
        Checkpointer(root, incremental=True, preemption=False) as ck,
    ):
        warnings.simplefilter("always")
        assert ck.restore({"engine": fresh}) == 1
        _train(fresh, 3)  # and the run goes on: the next save refers to no damaged file
        ck.save(3, {"engine": fresh})
    assert any(issubclass(w.category, ResumeFallbackWarning) for w in caught)
    assert torch.equal(fresh.trained, torch.full((TRAINED,), 3.0))
    statuses = {e.name: str(e.status) for e in catalog.scan(str(root), catalog.Depth.FULL)}
    assert statuses["step_000000003"] == "valid" and statuses["step_000000001"] == "valid"


class WithOptimizer(FrozenAndTrained):
    """The same part with an optimizer on the trained tensor, which it names (stepped_by), and
    its frozen tensor vouched for (``copy(frozen=True)``): only that one may be known
    unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.trained.requires_grad_(True)
        self.opt = torch.optim.SGD([self.trained], lr=1.0)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"frozen": self.frozen, "trained": self.trained.detach(), "small": self.small}

    def stepped_by(self) -> tuple[torch.optim.Optimizer, ...]:
        return (self.opt,)

    def capture(self, buffers: CaptureBuffers) -> dict[str, torch.Tensor]:
        live = self.tensors()
        out = buffers.copy({k: v for k, v in live.items() if k != "frozen"})
        out.update(buffers.copy({k: v for k, v in live.items() if k == "frozen"}, frozen=True))
        return out

    def load(self, reader: PartReader) -> None:
        with torch.no_grad():
            super().load(reader)


def _copied_names(monkeypatch) -> list[list[str]]:
    """The names of the part's tensors each save copies (one list per save: the names its
    Snapshots copy, bar the core's own, which copy none of the part's)."""
    from resilient_callbacks import snapshot
    from resilient_callbacks.saving import Saver

    seen: list[list[str]] = []
    real, save = snapshot.Snapshot.__init__, Saver.save

    def init(self, tensors, buffers, **kw):
        names = [n for n in tensors if n in ("frozen", "trained", "small")]
        if seen and names:
            seen[-1] = sorted(seen[-1] + names)
        real(self, tensors, buffers, **kw)

    def saving(self, *a, **kw):
        seen.append([])
        return save(self, *a, **kw)

    monkeypatch.setattr(snapshot.Snapshot, "__init__", init)
    monkeypatch.setattr(Saver, "save", saving)
    return seen


def test_an_unchanged_frozen_tensor_is_not_copied_again_and_a_changed_one_is(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    part = WithOptimizer()
    copied = _copied_names(monkeypatch)
    with Checkpointer(root, incremental=True, preemption=False) as ck:
        for step in (1, 2, 3, 4):
            part.trained.grad = torch.ones(TRAINED)
            if step < 4:
                part.opt.step()  # the trained tensor changes at every step
            else:  # changed where no version counter sees it: an optimizer's tensors are
                part.trained.data.fill_(-4.0)  # copied at every save all the same
            if step == 3:
                part.frozen.add_(1.0)  # an in-place change: its version counter moves
            ck.save(step, {"engine": part})
            ck.flush()
    part_copies = [names for names in copied if "trained" in names]
    assert part_copies == [
        ["frozen", "small", "trained"],  # the first save copies everything
        ["small", "trained"],  # the frozen tensor's buffer still holds its bytes
        ["frozen", "small", "trained"],  # changed in place: copied again
        ["small", "trained"],
    ]
    for step, frozen_offset in ((2, 0.0), (4, 1.0)):  # what each checkpoint holds is exact
        fresh = WithOptimizer()
        with Checkpointer(root, resume=str(root / f"step_{step:09d}"), preemption=False) as ck:
            assert ck.restore({"engine": fresh}) == step
        assert torch.equal(fresh.frozen, FrozenAndTrained().frozen + frozen_offset)
        assert torch.equal(fresh.trained.detach(), torch.full((TRAINED,), -float(step)))

    # incremental="hash": every tensor is copied and hashed at every save
    copied.clear()
    with Checkpointer(tmp_path / "h", incremental="hash", preemption=False) as ck:
        for step in (1, 2):
            ck.save(step, {"engine": part})
    assert [n for n in copied if "trained" in n] == [["frozen", "small", "trained"]] * 2


class Optional(WithOptimizer):
    """Leaves its frozen tensor out of some saves (its host buffer is then freed)."""

    include_frozen = True

    def tensors(self) -> dict[str, torch.Tensor]:
        out = super().tensors()
        return out if self.include_frozen else {k: v for k, v in out.items() if k != "frozen"}


def test_a_frozen_tensor_whose_buffer_was_freed_is_copied_again(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    part = Optional()
    copied = _copied_names(monkeypatch)
    with Checkpointer(root, incremental=True, preemption=False) as ck:
        for step, include in ((1, True), (2, False), (3, True)):
            part.include_frozen = include
            ck.save(step, {"engine": part})
            ck.flush()
    assert [n for n in copied if "trained" in n][2] == ["frozen", "small", "trained"]
    fresh = WithOptimizer()
    fresh.frozen.zero_()
    with Checkpointer(root, preemption=False) as ck:
        assert ck.restore({"engine": fresh}) == 3
    assert torch.equal(fresh.frozen, part.frozen)


class LoadsThroughData(WithOptimizer):
    """Restores its tensors through ``.data`` (as some libraries do): no version counter moves."""

    def load(self, reader: PartReader) -> None:
        got = reader.tensors(f"rank_{reader.info.rank:05d}.safetensors")
        for name, live in self.tensors().items():
            live.data.copy_(got[name])


def test_a_restore_in_the_same_process_forgets_what_was_unchanged(tmp_path):
    """A run that restores mid-way (a rollback after a loss spike) and lands on an older
    checkpoint (the newest is damaged), then saves again: the frozen tensor the restore wrote
    is copied anew, although the restore wrote it where no version counter sees."""
    root = tmp_path / "ck"
    part = LoadsThroughData()
    original = part.frozen.clone()
    with Checkpointer(root, incremental=True, preemption=False) as ck:
        ck.save(1, {"engine": part})  # the frozen tensor as it was
        part.frozen.add_(1.0)  # changed (seen): step 2 copies and stores it
        ck.save(2, {"engine": part})
        ck.flush()
        damaged = root / "step_000000002" / "parts" / "engine" / "rank_00000.safetensors"
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 0xFF
        damaged.write_bytes(bytes(data))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResumeFallbackWarning)
            assert ck.restore({"engine": part}) == 1  # back to step 1's values
        ck.save(3, {"engine": part})
    fresh = WithOptimizer()
    fresh.frozen.zero_()
    with Checkpointer(root, preemption=False) as ck:
        assert ck.restore({"engine": fresh}) == 3
    assert torch.equal(fresh.frozen, original)


def test_part_blobs_are_compressed_with_the_save_and_restore_exactly(tmp_path):
    pytest.importorskip("zstandard")
    root = tmp_path / "ck"
    part = FrozenAndTrained()
    with Checkpointer(root, incremental=True, compression="zstd", preemption=False) as ck:
        for step in (1, 2):
            _train(part, step)
            ck.save(step, {"engine": part})
    assert _blobs(root) and all(n.endswith(".safetensors.zst") for n in _blobs(root))
    fresh = FrozenAndTrained()
    fresh.frozen.zero_()
    with Checkpointer(root, preemption=False) as ck:
        assert ck.restore({"engine": fresh}) == 2
    assert torch.equal(fresh.frozen, part.frozen) and torch.equal(fresh.trained, part.trained)


def test_part_blobs_go_to_the_remote_tier_once_and_a_run_resumes_from_it(s3_remote, tmp_path):
    """On the moto S3 server: the frozen tensor's blob is uploaded once for every checkpoint;
    with the local directory gone, the run resumes from the remote copy exactly, and
    ``verify`` of a ``pull``ed copy checks the part blobs too."""
    from resilient_callbacks.cli import main
    from resilient_callbacks.remote import RemoteStore
    from resilient_callbacks.remote_blobs import listing

    url, opts = s3_remote
    part = FrozenAndTrained()
    local = tmp_path / "local"
    options = dict(incremental=True, remote=url, remote_options=opts, async_save=False)
    with Checkpointer(local, keep_last=1, remote_keep_last=2, **options) as ck:
        for step in (1, 2, 3):
            _train(part, step)
            ck.save(step, {"engine": part})
            ck._dir.sync.wait(60)
    store = RemoteStore(url, opts)
    entries = [e for e in store.scan() if e.manifest is not None]
    assert [e.manifest.step for e in entries] == [2, 3]
    live = {b.path for e in entries for b in e.manifest.blobs}
    assert {n for n in listing(store) if not n.startswith(".")} == live  # the frozen + 2 trained
    assert len(live) == 3

    shutil.rmtree(local)
    fresh = FrozenAndTrained()
    fresh.frozen.zero_()
    with Checkpointer(local, **options) as ck:
        assert ck.restore({"engine": fresh}) == 3
        assert ck.last_restore is not None and ck.last_restore.tier == "remote"
    assert torch.equal(fresh.frozen, part.frozen) and torch.equal(fresh.trained, part.trained)

    copy = tmp_path / "copy"
    flags = [a for k, v in opts.items() for a in ("-o", f"{k}={json.dumps(v)}")]
    assert main(["pull", url, str(copy), *flags]) == 0
    assert main(["verify", str(copy), "--all"]) == 0


def test_without_incremental_a_parts_file_holds_every_tensor(tmp_path):
    root = tmp_path / "ck"
    part = FrozenAndTrained()
    with Checkpointer(root, preemption=False) as ck:
        ck.save(1, {"engine": part})
    assert not _blobs(root)
    size = os.path.getsize(root / "step_000000001" / "parts" / "engine" / "rank_00000.safetensors")
    assert size > (FROZEN + TRAINED) * 4


# ----------------------------------------------------------------------------- FSDP2, 2 ranks


def fsdp_worker(root: str, out: str, total: int) -> None:
    """One rank: an MLP whose first layer (128 x 256, fp32: 64 KiB per rank) is frozen, as a
    base model under LoRA; ``fully_shard`` on gloo; AdamW on the rest. Restore, train up to
    ``total`` saving every step, record what each save wrote, the full tensors after the
    restore and at the end."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from dcp_helpers import _device, backend, full_tensors
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group(backend(), timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()  # RC_DEVICE=cuda: this rank's GPU (NCCL)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 1)).to(device)
    model[0].requires_grad_(False)
    if os.environ.get("RC_PART_FSDP1"):  # FSDP1, the whole model one flat parameter
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=device, use_orig_params=True)
    else:
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state = {"train": Sharded(model, opt)}
    res: dict[str, Any] = {"written": [], "copied": []}
    from resilient_callbacks import snapshot

    real = snapshot.Snapshot.__init__

    def counting(self, tensors, buffers, **kw):  # elements each save copies from the part
        res["copied"].append(sum(t.numel() for t in tensors.values()))
        real(self, tensors, buffers, **kw)

    snapshot.Snapshot.__init__ = counting
    with Checkpointer(root, every_n_steps=1, keep_last=2, incremental=True) as ck:
        start = res["start"] = ck.restore(state)
        # only after a restore: DCP's full state dict gives an optimizer without state some
        restored = full_tensors(model, opt) if start else {}
        for step in range(start + 1, total + 1):
            g = torch.Generator().manual_seed(100 + step)  # a step's batch: the same after a resume
            x, y = torch.randn(4, 128, generator=g), torch.randn(4, 1, generator=g)
            x, y = x.to(device), y.to(device)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if ck.step(step, state, final=step == total):
                ck.flush()
                res["written"].append(ck.last_save.written)
    final = full_tensors(model, opt)
    if rank == 0:
        if start:
            save_file({k: v.contiguous() for k, v in restored.items()}, f"{out}.restored.{world}")
        save_file({k: v.contiguous() for k, v in final.items()}, f"{out}.final.{world}")
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(res))
    spawn_ranks.leave_group()


@pytest.mark.slow  # suite time budget
@needs_dcp
def test_fsdp2_with_a_frozen_layer_writes_it_once_and_restores_exactly_on_2_and_1_ranks(
    tmp_path,
):
    from safetensors.torch import load_file

    root, out = tmp_path / "ck", tmp_path / "out"

    def run(total: int, nprocs: int, name: str) -> list[dict[str, Any]]:
        argv = [sys.executable, __file__, str(root), str(out), str(total)]
        spawn_ranks.run(argv, nprocs, tmp_path, name, zygote=spawn_ranks.shared_zygote())
        return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nprocs)]

    first = run(3, 2, "first")
    frozen_shard = 128 * 256 * 4 // 2
    for r in range(2):
        w = first[r]["written"]
        assert len(w) == 3 and w[0] > frozen_shard, w
        assert all(x <= w[0] - frozen_shard for x in w[1:]), w  # the frozen shard: not again
        # the part's copies: of the trained pieces, then of the frozen ones (the core's own
        # copies nothing); the frozen shard is not copied again (nor hashed): it is
        # unchanged, and its host buffer still holds it
        c = [x for x in first[r]["copied"] if x]
        assert len(c) == 6, c
        c = [a + b for a, b in zip(c[::2], c[1::2], strict=True)]
        assert all(x <= c[0] - frozen_shard // 4 for x in c[1:]), c
    blobs = _blobs(root)
    newest = root / "step_000000003"
    m = _manifest(newest)
    assert {b["rank"] for b in m["blobs"]} == {0, 1}  # each rank's frozen shard
    assert not (newest / "blobs").exists()
    final3 = load_file(f"{out}.final.2")

    # a restart on 2 ranks: exact, and its first save reuses the frozen shards
    second = run(5, 2, "second")
    assert [s["start"] for s in second] == [3, 3]
    assert load_file(f"{out}.restored.2").keys() == final3.keys()
    for k, v in load_file(f"{out}.restored.2").items():
        assert torch.equal(v, final3[k]), k
    for r in range(2):
        w0 = first[r]["written"][0]
        assert all(x <= w0 - frozen_shard for x in second[r]["written"]), second[r]["written"]
    assert set(blobs) & set(_blobs(root))  # the frozen shards are still the same blobs
    final5 = load_file(f"{out}.final.2")

    # resharded onto one rank: every full tensor equal to what was saved
    one = run(5, 1, "one")
    assert one[0]["start"] == 5
    for k, v in load_file(f"{out}.restored.1").items():
        assert torch.equal(v, final5[k]), k
    for e in catalog.scan(str(root), catalog.Depth.FULL):
        assert str(e.status) == "valid", (e.name, e.problem)


@pytest.mark.slow  # suite time budget
@needs_dcp
def test_fsdp1_one_flat_parameter_whose_first_rank_holds_only_frozen_weights(tmp_path):
    """FSDP1 (``use_orig_params=True``) with the whole model one flat parameter: rank 0's even
    slice holds only the frozen layer, so its optimizer has no state while rank 1's has. The
    ranks agree that the optimizer's state is saved (each deciding alone, they took different
    collectives and hung until the timeout); the frozen ranges are written by the first save
    only; a restart on 2 ranks restores every full tensor as saved and ends where a run that
    was not stopped ends; a restart on 1 rank restores every full tensor as saved."""
    from safetensors.torch import load_file

    root, out = tmp_path / "ck", tmp_path / "out"
    env = {"RC_PART_FSDP1": "1"}

    def run(total: int, nprocs: int, name: str, where: Path = root) -> list[dict[str, Any]]:
        argv = [sys.executable, __file__, str(where), str(out), str(total)]
        spawn_ranks.run(argv, nprocs, tmp_path, name, env=env, zygote=spawn_ranks.shared_zygote())
        return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nprocs)]

    run(5, 2, "uninterrupted", tmp_path / "other")
    uninterrupted = load_file(f"{out}.final.2")
    first = run(3, 2, "first")
    frozen_range = 64000  # bytes of frozen weight each rank holds in one box, at least
    for r in range(2):
        w = first[r]["written"]
        assert len(w) == 3 and w[0] > frozen_range, w
        assert all(x <= w[0] - frozen_range for x in w[1:]), w
    final3 = load_file(f"{out}.final.2")
    assert any(k.startswith("optim/") for k in final3)

    second = run(5, 2, "second")
    assert [s["start"] for s in second] == [3, 3]
    restored = load_file(f"{out}.restored.2")
    assert restored.keys() == final3.keys()
    for k, v in restored.items():
        assert torch.equal(v, final3[k]), k
    final5 = load_file(f"{out}.final.2")
    assert final5.keys() == uninterrupted.keys()
    for k, v in final5.items():  # killed or not, the same run
        assert torch.equal(v, uninterrupted[k]), k

    one = run(5, 1, "one")
    assert one[0]["start"] == 5
    restored = load_file(f"{out}.restored.1")
    assert restored.keys() == final5.keys()
    for k, v in restored.items():
        assert torch.equal(v, final5[k]), k


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_dcp
def test_fsdp2_frozen_layer_on_cuda_is_neither_copied_nor_written_again(tmp_path):
    """The same on this machine's GPU (one rank, NCCL): the frozen shard is copied to the host
    and written by the first save only, and a restart restores every tensor exactly."""
    from safetensors.torch import load_file

    root, out = tmp_path / "ck", tmp_path / "out"
    env = {"RC_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

    def run(total: int) -> dict[str, Any]:
        argv = [sys.executable, __file__, str(root), str(out), str(total)]
        spawn_ranks.run(argv, 1, tmp_path, f"cuda{total}", env=env)
        return json.loads(Path(f"{out}.rank0.json").read_text())

    first = run(3)
    frozen = 128 * 256 * 4
    w, c = first["written"], [x for x in first["copied"] if x]
    assert len(w) == 3 and all(x <= w[0] - frozen for x in w[1:]), w
    assert len(c) == 6, c  # the trained pieces, then the frozen ones, at each save
    c = [a + b for a, b in zip(c[::2], c[1::2], strict=True)]
    assert all(x <= c[0] - frozen // 4 for x in c[1:]), c
    final = load_file(f"{out}.final.1")
    second = run(4)
    assert second["start"] == 3
    for k, v in load_file(f"{out}.restored.1").items():
        assert torch.equal(v, final[k]), k


def batchnorm_worker(root: str, out: str) -> None:
    """One rank: FSDP2 over a model with a BatchNorm1d(4096), whose running statistics (16 KiB
    each, blob-sized) the batch_norm kernel updates in place without bumping their version
    counters; three incremental saves, then the restored statistics against the live ones."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 4096), nn.BatchNorm1d(4096), nn.Linear(4096, 1))
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    model, opt = build()
    with Checkpointer(root, incremental=True) as ck:
        for step in (1, 2, 3):
            model(torch.randn(32, 16) + step).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, {"train": Sharded(model, opt)})
    fresh, fresh_opt = build()
    with Checkpointer(root) as ck:
        assert ck.restore({"train": Sharded(fresh, fresh_opt)}) == 3

    def stats(m: nn.Module) -> dict[str, torch.Tensor]:
        bn = m[1]
        return {
            k: getattr(v, "full_tensor", lambda v=v: v)().clone()
            for k, v in (("mean", bn.running_mean), ("var", bn.running_var))
        }

    save_file({f"live.{k}": v for k, v in stats(model).items()}, f"{out}.live")
    save_file({f"restored.{k}": v for k, v in stats(fresh).items()}, f"{out}.restored")
    dist.destroy_process_group()


@needs_dcp
def test_fsdp2_batchnorm_statistics_are_saved_at_every_incremental_save(tmp_path):
    """A buffer is never known unchanged (only frozen parameters are): BatchNorm's update of
    its running statistics does not move their version counters."""
    from safetensors.torch import load_file

    root, out = tmp_path / "ck", tmp_path / "out"
    argv = [sys.executable, __file__, "batchnorm", str(root), str(out)]
    spawn_ranks.run(argv, 1, tmp_path, "bn", zygote=spawn_ranks.shared_zygote())
    live, restored = load_file(f"{out}.live"), load_file(f"{out}.restored")
    for k in ("mean", "var"):
        assert torch.equal(restored[f"restored.{k}"], live[f"live.{k}"]), k


if __name__ == "__main__":
    if sys.argv[1] == "batchnorm":
        batchnorm_worker(sys.argv[2], sys.argv[3])
    else:
        fsdp_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))


@pytest.mark.benchmark
@needs_dcp
def test_bench_incremental_sharded_quick(tmp_path):
    """benchmarks/bench_incremental.py --sharded runs end to end at a toy size: a later
    incremental save writes about the trained tenth of what a full one writes."""
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_incremental.py"
    cmd = [sys.executable, str(bench), "--mb", "16", "--saves", "3", "--sharded"]
    subprocess.run([*cmd, "--out", str(tmp_path)], check=True, capture_output=True, timeout=300)
    report = json.loads((tmp_path / "bench_incremental_sharded.json").read_text())
    full, inc = report["full_sync"]["written"], report["incremental_sync"]["written"]
    assert report["sharded"] and inc[1] < 0.2 * full[1], (full, inc)


def test_a_frozen_part_tensor_written_through_data_is_stored_not_referred_stale(tmp_path):
    """A part's frozen tensor written through ``.data`` (an EMA shard under FSDP updated the
    common way): its version counter does not move, so incremental=True used to refer every
    later save to its first blob. The sampled elements differ: the save stores it, warns."""
    root = tmp_path / "ck"
    part = WithOptimizer()
    want = {}
    with (
        Checkpointer(root, incremental=True, preemption=False) as ck,
        pytest.warns(UserWarning, match="version counter"),
    ):
        for step in (1, 2, 3):
            part.frozen.data.mul_(0.5)
            ck.save(step, {"engine": part})
            ck.flush()
            want[step] = part.frozen.clone()
    for step, frozen in want.items():
        fresh = WithOptimizer()
        with Checkpointer(root, resume=step, read_only=True) as ck:
            assert ck.restore({"engine": fresh}) == step
        assert torch.equal(fresh.frozen, frozen), step
