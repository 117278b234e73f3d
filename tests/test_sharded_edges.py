"""``dcp.Sharded`` at its edges (2 gloo ranks, FSDP2 on CPU): tensors that are not sharded
(BatchNorm's buffers) reach the export and inspect; a checkpoint that does not fit is refused
before anything is loaded, and ``StateDictOptions(strict=False)`` loads what fits; a damaged
chunk index (in a manifest sealed again, past the manifest's own checksum) is a corrupt
checkpoint. (Kill and
resume, resharding: tests/test_dcp_sharded.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import spawn_ranks
from resilient_callbacks.manifest import SELF_CHECKSUM, self_checksum
from torch_needs import needs_dcp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600), needs_dcp]


def _ranks(phase: str, root: Path, tmp_path: Path, name: str) -> None:
    """This file's :func:`worker` ``phase`` as 2 ranks, each a fresh process forked from the
    session's zygote that imported torch once (spawn_ranks.Zygote)."""
    argv = [sys.executable, __file__, phase, str(root)]
    spawn_ranks.run(argv, 2, tmp_path, name, zygote=spawn_ranks.shared_zygote())


@pytest.mark.slow  # suite time budget
def test_unsharded_buffers_are_exported_and_a_misfit_is_refused_before_loading(tmp_path, capsys):
    from safetensors.torch import load_file

    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    _ranks("save", root, tmp_path, "save")
    saved = json.loads((tmp_path / "saved.json").read_text())

    assert main(["export", str(root), str(tmp_path / "out")]) == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == saved["keys"]  # BatchNorm's buffers included
    assert got["1.running_mean"].tolist() == saved["running_mean"]
    assert int(got["1.num_batches_tracked"]) == 2
    capsys.readouterr()
    assert main(["inspect", str(root), "--json"]) == 0
    keys = {k["key"] for k in json.loads(capsys.readouterr().out)["keys"]}
    assert "train.model/1.running_mean" in keys, sorted(keys)

    _ranks("extra", root, tmp_path, "extra")
    for r in range(2):
        res = json.loads((tmp_path / f"extra.{r}.json").read_text())
        assert "model/3.weight: not in the checkpoint" in res["refused"]
        assert res["changed"] == []  # refused before anything was loaded
        assert res["lenient"] == 2  # strict=False: the layers that fit are loaded

    # one offset of the newest checkpoint's chunk index damaged: both ranks fall back to step 1
    # together, loudly (found 2026-11-25: the restore raised CheckpointCorruptError "the saved
    # chunks cover 0 of the 48 elements" after other tensors were loaded)
    manifest = root / "step_000000002" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["extra"]["parts"]["train"]["tensors"]["model/0.weight"]["chunks"][0][1][0] = 100
    m[SELF_CHECKSUM] = self_checksum(m)  # sealed again: the chunk index's own check is tested
    manifest.write_text(json.dumps(m))
    _ranks("damaged", root, tmp_path, "damaged")
    res = [json.loads((tmp_path / f"damaged.{r}.json").read_text()) for r in range(2)]
    assert [x["step"] for x in res] == [1, 1]
    assert any("chunk index of 'model/0.weight' is damaged" in w for w in res[0]["warnings"])


@pytest.mark.parametrize("save", ["v_save", "v_save_old"])
def test_a_module_whose_version_changed_is_loaded_by_the_saved_version(tmp_path, save):
    """A module of ``_version`` 2 whose loader converts the entries of version 1 (and of no
    version: the oldest layout): Sharded loaded its entries with no versions, so the version-2
    weight saved by the same code was converted again (doubled). The versions are recorded
    at the save (the part's JSON) and given to ``set_model_state_dict`` at the restore; a
    checkpoint written before they were (``v_save_old``) is loaded by the live module's, as
    the core restore and the export do (the same code wrote it), not as the oldest layout."""
    root = tmp_path / "vck"
    _ranks(save, root, tmp_path, "v_save")
    saved = json.loads((tmp_path / "v_saved.json").read_text())["weight"]
    _ranks("v_load", root, tmp_path, "v_load")
    for r in range(2):
        assert json.loads((tmp_path / f"v_load.{r}.json").read_text())["weight"] == saved


@pytest.mark.parametrize(
    ("save", "load"),
    [
        ("v_save_compiled", "v_load"),
        pytest.param("v_save", "v_load_compiled", marks=pytest.mark.slow),
    ],
    ids=["compiled-then-not", "then-compiled"],
)
def test_a_submodule_compiled_in_one_run_only_is_loaded_by_its_own_version(tmp_path, save, load):
    """The versions Sharded records are named as ``state_dict()``'s ``_metadata`` names the
    submodules: a submodule compiled on its own is ``0._orig_mod`` (and ``0`` is torch.compile's
    wrapper, version 1), where DCP's keys leave ``_orig_mod`` out. Compiled in one run only,
    the saved versions were given under names the live model does not have, so the module took
    its entries for the oldest layout (or the wrapper's version 1) and converted its own
    version-2 weight again (doubled), silently. They are matched by the live model's names."""
    root = tmp_path / "vck"
    _ranks(save, root, tmp_path, "v_save")
    saved = json.loads((tmp_path / "v_saved.json").read_text())["weight"]
    _ranks(load, root, tmp_path, "v_load")
    for r in range(2):
        assert json.loads((tmp_path / f"v_load.{r}.json").read_text())["weight"] == saved


class _Doubled(torch.nn.Linear):
    """Version 2 keeps twice the weight version 1 kept."""

    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        if (local_metadata.get("version") or 1) < 2:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)


def _versioned(phase: str, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")
    if phase == "v_save_old":  # a checkpoint of a version that recorded no versions
        from resilient_callbacks import module_versions

        module_versions.recorded = lambda sd: None
        phase = "v_save"
    compiled = phase.endswith("_compiled")  # the first layer compiled on its own
    phase = phase.removesuffix("_compiled")
    torch.manual_seed(0 if phase == "v_save" else 123)
    m = torch.nn.Sequential(_Doubled(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    if compiled:
        m[0] = torch.compile(m[0], backend="eager")
    fully_shard(m)
    with Checkpointer(root, every_n_steps=1) as ck:
        if phase == "v_save":
            ck.step(1, {"train": Sharded(m)})
        else:
            assert ck.restore({"train": Sharded(m)}) == 1
    full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    name = "v_saved.json" if phase == "v_save" else f"v_load.{dist.get_rank()}.json"
    (Path(root).parent / name).write_text(json.dumps({"weight": full["0.weight"].tolist()}))
    spawn_ranks.leave_group()


def worker(phase: str, root: str) -> None:
    if phase.startswith("v_"):
        return _versioned(phase, root)
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0 if phase == "save" else 123)
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    if phase == "extra":
        m.append(nn.Linear(1, 1))  # a layer the checkpoint lacks
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = Path(root).parent
    if phase == "save":
        with Checkpointer(root, every_n_steps=1) as ck:
            for step in (1, 2):
                torch.manual_seed(step)
                m(torch.randn(8, 6)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                ck.step(step, {"train": Sharded(m, opt)})
        full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
        if rank == 0:
            (out / "saved.json").write_text(
                json.dumps({"keys": sorted(full), "running_mean": full["1.running_mean"].tolist()})
            )
    elif phase == "damaged":
        import warnings

        with warnings.catch_warnings(record=True) as caught, Checkpointer(root) as ck:
            warnings.simplefilter("always")
            step = ck.restore({"train": Sharded(m, opt)})
        said = [str(w.message) for w in caught]
        (out / f"damaged.{rank}.json").write_text(json.dumps({"step": step, "warnings": said}))
    else:
        before = {n: p.full_tensor().clone() for n, p in m.named_parameters()}
        res: dict = {}
        with Checkpointer(root) as ck:
            try:
                ck.restore({"train": Sharded(m, opt)})
            except Exception as e:
                res["refused"] = str(e)
        res["changed"] = [
            n for n, p in m.named_parameters() if not p.full_tensor().equal(before[n])
        ]
        lenient = Sharded(m, opt, options=StateDictOptions(strict=False))
        with Checkpointer(root) as ck:
            res["lenient"] = ck.restore({"train": lenient})
        (out / f"extra.{rank}.json").write_text(json.dumps(res))
    spawn_ranks.leave_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
