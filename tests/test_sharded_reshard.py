"""``dcp.Sharded`` resharded: what a restore on another number of ranks keeps, drops and
refuses.

(a) One process: a chunk index (or a drop-in ``dcp_metadata.json``) whose chunks overlap is
    refused; the sum of the overlaps counted an element twice and let a gap pass as covered.
(b) 2 gloo ranks save, 1 restores (FSDP2 on CPU; the ranks run this file's :func:`worker`):
    a model saved with ``StateDictOptions(ignore_frozen_params=True)`` restores with the same
    options (it failed in DCP's strict load, after loading the rest); restored without them it
    is refused before loading, saying what to pass. What the restore cannot load -- rank 1's RNG
    states, its copies of buffers that diverged between the ranks -- is said, naming them, and
    so is the export's choice of rank 0's copies.
(c) fp32 optimizer state of bf16 parameters keeps its dtype (FSDP2 2 -> 1, FSDP1 2 -> 2); an
    error taking the live state dict is a refusal, not a damaged checkpoint (1 rank).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import spawn_ranks
from resilient_callbacks.dcp.assemble import assemble
from resilient_callbacks.dcp.chunks import Box, check_index, first_overlap
from resilient_callbacks.errors import CheckpointCorruptError
from torch_needs import needs_dcp

pytestmark = [pytest.mark.timeout(600), needs_dcp]

# ----------------------------------------------------------------------------- (a) one process


def _overlapping_index() -> dict:
    """A 1-D tensor of 6 elements whose two saved chunks, [0, 3) of rank 0 and [1, 4) of rank 1,
    hold 3 elements each: 6 in all, as many as the tensor, but [4, 6) is in neither."""
    return {"model/w": {"dtype": "F32", "shape": [6], "chunks": [[0, [0], [3]], [1, [1], [3]]]}}


def test_overlapping_chunks_are_not_counted_as_covering_a_gap():
    index = _overlapping_index()
    files = {0: {"model/w": torch.arange(3.0)}, 1: {"model/w": torch.arange(1.0, 4.0)}}
    need = Box.of([0], [6])
    with pytest.raises(CheckpointCorruptError, match=r"model/w: the saved chunks .* overlap"):
        assemble("model/w", need, index["model/w"], files)  # (export's call: a fresh tensor)
    live = torch.full((6,), -1.0)
    with pytest.raises(CheckpointCorruptError, match="overlap"):
        assemble("model/w", need, index["model/w"], files, out=live)
    assert live.tolist() == [-1.0] * 6  # refused before anything was copied into it
    with pytest.raises(
        CheckpointCorruptError, match=r"chunk index of 'model/w' is damaged.*overlap"
    ):
        check_index(index, world_size=2)


def test_dcp_metadata_whose_chunks_overlap_is_damaged():
    """The drop-in reader's ``dcp_metadata.json`` (``dcp.save`` through our writer): DCP's
    load plans its reads from the chunks without checking them, so overlapping ones (which
    DCP's save never writes) are refused when the file is read; tiling ones load."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from resilient_callbacks.dcp.metadata_json import from_json, to_json

    def meta(*chunks: tuple[int, int]) -> dict:
        tensor = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([6]),
            [ChunkStorageMetadata(torch.Size([o]), torch.Size([n])) for o, n in chunks],
        )
        return to_json(Metadata({"model.w": tensor}), {})

    assert list(from_json(meta((0, 3), (3, 3)))[0].state_dict_metadata) == ["model.w"]
    with pytest.raises(CheckpointCorruptError, match=r"model\.w: chunks \[0\]\+\[3\] and"):
        from_json(meta((0, 3), (1, 3)))
    with pytest.raises(CheckpointCorruptError, match="outside the tensor"):
        from_json(meta((0, 3), (4, 3)))


def test_chunks_that_tile_a_tensor_do_not_overlap():
    rows = [Box.of([0, 0], [4, 4]), Box.of([4, 0], [3, 4])]
    assert first_overlap(rows) is None
    # FSDP1's flat pieces of a 3x4 tensor: the tail of a row, whole rows, the head of a row
    flat = [Box.of([0, 2], [1, 2]), Box.of([1, 0], [1, 4]), Box.of([2, 0], [1, 1])]
    assert first_overlap([Box.of([0, 0], [1, 2]), *flat, Box.of([2, 1], [1, 3])]) is None
    cols = [Box.of([0, 0], [5, 2]), Box.of([0, 2], [5, 2])]  # shards along dimension 1
    assert first_overlap(cols) is None
    assert first_overlap([*cols, Box.of([4, 1], [1, 2])]) == (cols[0], Box.of([4, 1], [1, 2]))
    assert first_overlap([Box((), ()), Box((), ())]) is not None  # two 0-d chunks: one element
    assert first_overlap([Box((), ())]) is None
    index = {
        "model/w": {
            "dtype": "F32",
            "shape": [7, 4],
            "chunks": [[0, [0, 0], [4, 4]], [1, [4, 0], [3, 4]]],
        }
    }
    check_index(index, world_size=2)


# ----------------------------------------------------------------------------- (b) 2 ranks -> 1


def _ranks(phase: str, n: int, tmp_path: Path) -> list[dict]:
    """This file's :func:`worker` ``phase`` as ``n`` ranks; each rank's result."""
    argv = [sys.executable, __file__, phase, str(tmp_path / "ck")]
    spawn_ranks.run(argv, n, tmp_path, phase, zygote=spawn_ranks.shared_zygote())
    return [json.loads((tmp_path / f"{phase}.{r}.json").read_text()) for r in range(n)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint of 2 ranks (one step, each rank its own batch) and rank 0's model then."""
    tmp_path = tmp_path_factory.mktemp("two_ranks")
    return tmp_path, _ranks("frozen_save", 2, tmp_path)[0]


def _restore(phase: str, saved: tuple[Path, dict], tmp_path: Path) -> dict:
    """``phase`` on 1 rank, from a copy of the saved checkpoint."""
    shutil.copytree(saved[0] / "ck", tmp_path / "ck")
    return _ranks(phase, 1, tmp_path)[0]


@pytest.mark.distributed
def test_a_save_without_frozen_parameters_restores_with_the_same_options(saved, tmp_path):
    res, saved = _restore("frozen_load", saved, tmp_path), saved[1]
    assert res["same_options"]["step"] == 1, res
    # everything but the frozen layer (BatchNorm's buffers: rank 0's, which this rank loads)
    assert res["same_options"]["model"] == {
        n: v for n, v in saved["model"].items() if not n.startswith("0.")
    }
    assert res["same_options"]["frozen_kept"] is True  # as the model was built: not loaded
    assert res["same_options"]["optim_steps"] == [1.0] * 4  # BatchNorm's and layer 2's
    refused = res["default_options"]["refused"]
    assert "ignore_frozen_params=True" in refused and "model/0.weight: not in" in refused
    assert res["default_options"]["changed"] == []  # refused before anything was loaded


@pytest.mark.distributed
def test_what_a_restore_on_fewer_ranks_does_not_load_is_said(saved, tmp_path):
    """Rank 1's RNG states and its copy of BatchNorm's running statistics (FSDP does not
    synchronise buffers: each rank's saw its own batch) have no process to go to on 1 rank:
    they were dropped in silence. Rank 0 now says so, naming them; tensors whose copies were
    equal (the batch count, the optimizer's step counters) are not named."""
    said = _restore("gone_load", saved, tmp_path)["warnings"]
    rngs = [w for w in said if "RNG states of rank 1 are not loaded" in w]
    assert len(rngs) == 1 and "written by 2 ranks, this run has 1" in rngs[0], said
    (buffers,) = [w for w in said if "not sharded" in w]
    assert "model/1.running_mean (rank 1), model/1.running_var (rank 1) are not" in buffers
    assert "rank 0's values are" in buffers
    assert "num_batches_tracked" not in buffers and "step" not in buffers


def test_an_export_says_which_unsharded_tensors_differed_between_ranks(saved):
    """``resilient-ckpt export`` writes rank 0's copy of a tensor that is not sharded; where
    rank 1's differed (BatchNorm's statistics under FSDP) it took rank 0's in silence."""
    from resilient_callbacks.dcp.whole import model_tensors
    from resilient_callbacks.manifest import read_manifest

    step = str(saved[0] / "ck" / "step_000000001")
    with pytest.warns(UserWarning, match="differ between the ranks' files") as got:
        out = model_tensors(step, read_manifest(step), "train")
    (said,) = [str(w.message) for w in got if "differ between" in str(w.message)]
    assert "model/1.running_mean (rank 1), model/1.running_var (rank 1)" in said
    assert "num_batches_tracked" not in said and "the export holds rank 0's" in said
    assert out["1.running_mean"].tolist() == saved[1]["model"]["1.running_mean"]


@pytest.mark.distributed
@pytest.mark.parametrize(("sharding", "ranks"), [("fsdp2", 1), ("fsdp1", 2)])
def test_fp32_optimizer_state_of_bf16_parameters_stays_fp32(tmp_path, sharding, ranks):
    """bf16 parameters, an optimizer that keeps its moments in fp32 (:class:`_Fp32Momentum`):
    saved on 2 ranks, restored on 1 (FSDP2: through ``set_optimizer_state_dict``) or on 2
    (FSDP1 read directly: through the optimizer's own ``load_state_dict``). Both end in
    ``Optimizer.load_state_dict``, which casts floating state to the parameter's dtype: the
    moments came back rounded to bf16, in silence."""
    saved = _ranks(f"bf16_save_{sharding}", 2, tmp_path)[0]
    res = _ranks(f"bf16_load_{sharding}", ranks, tmp_path)[0]
    assert res["step"] == 2
    assert res["model"] == saved["model"]
    assert {k: d for k, (d, _) in res["optim"].items()} == {
        k: "torch.float32" for k in saved["optim"]
    }
    assert res["optim"] == saved["optim"]


@pytest.mark.distributed
def test_an_optimizer_the_state_dict_cannot_init_is_refused_not_taken_for_damage(tmp_path):
    """An optimizer whose ``step()`` takes no ``closure`` saves (it has state then), but DCP's
    ``get_state_dict`` steps a fresh one as ``step(closure=None)`` at the restore. That
    TypeError was taken for a damaged checkpoint: the newest valid one was skipped with a
    ResumeFallbackWarning ("unreadable checkpoint"), and the next failed another way. Now
    the restore is refused on the first, naming the error, with nothing skipped."""
    (res,) = _ranks("closure", 1, tmp_path)
    assert "CheckpointMismatchError" in res["error"], res
    assert "step_000000002" in res["error"] and "closure" in res["error"], res
    assert "get_state_dict raised TypeError" in res["error"], res
    assert res["fallbacks"] == [], res


class _NoClosure(torch.optim.SGD):
    def step(self) -> None:  # type: ignore[override]  # (as hand-written optimizers often are)
        super().step()


class _Fp32Momentum(torch.optim.Optimizer):
    """Momentum kept in fp32 whatever the parameters' dtype (as low-precision optimizers do)."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p, dtype=torch.float32)
                    state["step"] = torch.tensor(0.0)
                state["m"].mul_(0.9).add_(p.grad.float())
                state["step"] += 1
                p.add_(state["m"].to(p.dtype), alpha=-group["lr"])


def _bf16(phase: str, root: str, rank: int) -> dict:
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    torch.manual_seed(0 if phase.startswith("bf16_save") else 5)
    m = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 1)).to(torch.bfloat16)
    if phase.endswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({nn.Linear})
        cpu = torch.device("cpu")
        m = FullyShardedDataParallel(
            m, auto_wrap_policy=policy, use_orig_params=True, device_id=cpu
        )
    else:
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
    opt = _Fp32Momentum(m.parameters())
    with Checkpointer(root, every_n_steps=1) as ck:
        if phase.startswith("bf16_save"):
            for step in (1, 2):
                torch.manual_seed(step)
                m(torch.randn(8, 6, dtype=torch.bfloat16)).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                ck.step(step, {"train": Sharded(m, opt)})
            res: dict = {}
        else:
            res = {"step": ck.restore({"train": Sharded(m, opt)})}
    msd, osd = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    res["model"] = {k: v.float().tolist() for k, v in msd.items()}
    res["optim"] = {
        f"{k}/{s}": [str(v.dtype), v.float().tolist()]
        for k, st in osd["state"].items()
        for s, v in st.items()
        if s != "step"
    }
    return res


def _model(rank: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    m[0].requires_grad_(False)  # a frozen base, as PEFT/LoRA leaves one
    for layer in (m[0], m[2]):
        fully_shard(layer)
    fully_shard(m)
    return m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)


def _full(m: torch.nn.Module) -> dict[str, list]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    return {k: v.tolist() for k, v in sd.items()}


def worker(phase: str, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    frozen = StateDictOptions(ignore_frozen_params=True)
    res: dict = {}
    if phase == "closure":
        import warnings

        from resilient_callbacks.errors import ResumeFallbackWarning

        m, _ = _model(rank, 0)
        opt = _NoClosure(m.parameters(), lr=0.1, momentum=0.9)
        with Checkpointer(root, every_n_steps=1) as ck:
            for step in (1, 2):
                m(torch.randn(8, 6)).pow(2).mean().backward()
                opt.step()
                ck.step(step, {"train": Sharded(m, opt)})
        m, _ = _model(rank, 1)
        opt = _NoClosure(m.parameters(), lr=0.1, momentum=0.9)
        with warnings.catch_warnings(record=True) as caught, Checkpointer(root) as ck:
            warnings.simplefilter("always")
            try:
                ck.restore({"train": Sharded(m, opt)})
            except Exception as e:
                res["error"] = f"{type(e).__name__}: {e}"
        res["fallbacks"] = [str(w.message) for w in caught if w.category is ResumeFallbackWarning]
    elif phase.startswith("bf16_"):
        res = _bf16(phase, root, rank)
    elif phase == "frozen_save":
        m, opt = _model(rank, 0)
        with Checkpointer(root, every_n_steps=1) as ck:
            torch.manual_seed(10 + rank)
            m(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
            ck.step(1, {"train": Sharded(m, opt, options=frozen)})
        res["model"] = _full(m)
    elif phase == "frozen_load":
        m, opt = _model(rank, 123)  # other values than were saved
        built = _full(m)
        with Checkpointer(root) as ck:
            try:
                ck.restore({"train": Sharded(m, opt)})
            except Exception as e:
                res["default_options"] = {"refused": str(e)}
        res["default_options"]["changed"] = [k for k, v in _full(m).items() if v != built[k]]
        with Checkpointer(root) as ck:
            step = ck.restore({"train": Sharded(m, opt, options=frozen)})
        now = _full(m)
        res["same_options"] = {
            "step": step,
            "model": {k: v for k, v in now.items() if not k.startswith("0.")},
            "frozen_kept": all(now[k] == built[k] for k in ("0.bias", "0.weight")),
            "optim_steps": sorted(float(s["step"]) for s in opt.state.values()),
        }
    elif phase == "gone_load":
        import warnings

        m, opt = _model(rank, 123)
        with warnings.catch_warnings(record=True) as caught, Checkpointer(root) as ck:
            warnings.simplefilter("always")
            res["step"] = ck.restore({"train": Sharded(m, opt, options=frozen)})
        res["warnings"] = [str(w.message) for w in caught]
    (Path(root).parent / f"{phase}.{rank}.json").write_text(json.dumps(res))
    spawn_ranks.leave_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
