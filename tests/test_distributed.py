"""Two ranks on gloo (127.0.0.1, a free port), one OS process each.

(a) tests/train_script.py --distributed: a replicated model with gradients all-reduced,
    rank-specific dropout/Python/NumPy random streams and a per-rank ResumableSampler in
    ``PerRank``. The run that restores a mid-epoch checkpoint in a new pair of processes
    continues exactly like the uninterrupted run, bit for bit, on each rank; the checkpoint holds
    one file pair per rank and the replicated tensors only in shared.safetensors.
(b) A save whose per-rank part fails on rank 1 only: both ranks raise CheckpointWriteError with
    ``failed_ranks == (1,)``, nothing is committed for that step, no staging directory remains,
    and the older checkpoint stays valid and restorable.

Every process is started with subprocess and a deadline: a rank that fails makes the test fail
with every rank's output, and a hung collective cannot outlive the timeout. This file doubles as
the worker script for (b): ``python test_distributed.py fail-worker DIR OUT``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import spawn_ranks
from resilient_callbacks import (
    Checkpointer,
    CheckpointWriteError,
    PerRank,
    ResumableDataLoader,
    catalog,
)

SCRIPT = Path(__file__).with_name("train_script.py")
WORLD = 2
DEADLINE = 120.0  # seconds for one group of ranks, start to finish


# ----------------------------------------------------------------------------- worker for (b)


class Bomb:
    """A per-rank object whose state_dict() raises on the chosen rank once armed."""

    def __init__(self, rank: int, fail_on: int) -> None:
        self.rank, self.fail_on, self.armed, self.value = rank, fail_on, False, rank * 10

    def state_dict(self) -> dict[str, Any]:
        if self.armed and self.rank == self.fail_on:
            raise RuntimeError(f"simulated failure while encoding rank {self.rank}'s state")
        return {"value": self.value, "rank": self.rank}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert sd["rank"] == self.rank, sd
        self.value = sd["value"]


def _fill(model: nn.Module, v: float) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + v + 100 * i)


def _matches(model: nn.Module, v: float) -> bool:
    return all(
        torch.equal(p, torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + v + 100 * i)
        for i, p in enumerate(model.parameters())
    )


def fail_worker(root: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    bomb = Bomb(rank, fail_on=1)
    state = {"model": model, "bomb": PerRank(bomb), "extra": {"note": "replicated"}}
    res: dict[str, Any] = {"rank": rank}

    ck = Checkpointer(root)
    res["first_restore"] = ck.restore(state)
    _fill(model, 5.0)
    bomb.value = 500 + rank
    res["save5"] = ck.save(5, state)

    _fill(model, 10.0)
    bomb.value = 1000 + rank
    bomb.armed = True
    try:
        ck.save(10, state)
        # Saves persist in the background: the failing rank raises at once, the others when
        # the background commit learns of the failure (here: flush; else the next save/close).
        ck.flush()
        res["save10"] = "no error"
    except CheckpointWriteError as e:
        res["save10"] = {
            "type": type(e).__name__,
            "failed_ranks": list(e.failed_ranks),
            "message": str(e),
            "cause": repr(e.__cause__),
        }
    except Exception as e:  # the wrong exception type: report it
        res["save10"] = {"type": type(e).__name__, "message": str(e)}
    dist.barrier()  # every rank has returned from the failed save
    res["listing_after_failure"] = sorted(os.listdir(root))
    res["checkpoints_after_failure"] = [
        (e.name, e.step, str(e.status)) for e in catalog.scan(root, catalog.Depth.FULL)
    ]
    ck.close()
    dist.barrier()

    # The older checkpoint is restorable by a fresh Checkpointer on every rank.
    torch.manual_seed(1)
    model2 = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    bomb2 = Bomb(rank, fail_on=1)
    state2 = {"model": model2, "bomb": PerRank(bomb2), "extra": {"note": ""}}
    with Checkpointer(root) as ck2:
        res["restored"] = ck2.restore(state2)
        res["restored_model_ok"] = _matches(model2, 5.0)
        res["restored_bomb_value"] = bomb2.value
        res["restored_extra"] = state2["extra"]
        # ... and the directory is not wedged: the next save commits.
        res["save12"] = ck2.save(12, state2)
        ck2.flush()
        # An evaluation beside the run: read-only, while the writer holds the directory's
        # lock, with a part of the state (no "extra"), on every rank.
        model3 = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
        bomb3 = Bomb(rank, fail_on=1)
        with Checkpointer(root, read_only=True) as ro:
            res["read_only_restored"] = ro.restore({"model": model3, "bomb": PerRank(bomb3)})
        res["read_only_ok"] = _matches(model3, 5.0) and bomb3.value == 500 + rank
    dist.barrier()
    res["final_checkpoints"] = [
        (e.name, e.step, str(e.status)) for e in catalog.scan(root, catalog.Depth.FULL)
    ]
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    spawn_ranks.leave_group()


def step_worker(root: str, out: str) -> None:
    """Rank 1 passes step 9 where rank 0 passes 10 (a counter off by one on one rank); then
    rank 1's state has a key rank 0's lacks. Plain values that differ (a rank-0-only history,
    a value None on one rank) are fine."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    plain = {"history": [1, 2, 3] if rank == 0 else [], "best": 0.5 if rank == 0 else None}
    state = {"model": nn.Linear(4, 4), "mine": PerRank({"rank": rank}), "extra": plain}
    state["loader"] = PerRank(ResumableDataLoader(range(8), 2, num_replicas=2, rank=rank, seed=0))
    state["buffers"] = PerRank({"b": torch.full((2,), float(rank))}, new_ranks="rank0")
    next(iter(state["loader"].obj))  # a position of one batch on each rank
    res: dict[str, Any] = {}

    def failing(step: int, st: dict) -> Any:
        try:
            ck.save(step, st)
            ck.flush()
            return None
        except CheckpointWriteError as e:
            return {"failed_ranks": list(e.failed_ranks), "message": str(e)}

    with Checkpointer(root) as ck:
        ck.save(5, state)
        ck.flush()
        res["error"] = failing(10 if rank == 0 else 9, state)
        extra = {**state, "ema": nn.Linear(4, 4)} if rank == 1 else state
        res["keys_error"] = failing(11, extra)
        dist.barrier()
        res["steps"] = [e.step for e in catalog.committed(catalog.scan(root, catalog.Depth.FULL))]
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    spawn_ranks.leave_group()


# ----------------------------------------------------------------------------- launching ranks


def run_ranks(argv: list[str], workdir: Path, name: str) -> list[str]:
    """Run ``argv`` as WORLD ranks; fail the test (with every rank's output) if any rank fails
    or the group misses the deadline. Returns each rank's output."""
    zygote = spawn_ranks.shared_zygote()  # (each rank a fresh child, torch imported once)
    return spawn_ranks.run(argv, WORLD, workdir, name, deadline=DEADLINE, zygote=zygote).outputs


# ----------------------------------------------------------------------------- tests

import pytest  # noqa: E402  (after the worker code, which does not need it)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

TOTAL, EVERY, RESUME_AT = 30, 10, 20


def _train_cmd(ckdir: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        str(ckdir),
        "--distributed",
        "--total-steps",
        str(TOTAL),
        "--every-n-steps",
        str(EVERY),
        "--out-jsonl",
        str(out / "losses.jsonl"),
        "--out-params",
        str(out / "params.st"),
    ]


def _losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def test_two_ranks_save_and_exact_restore(tmp_path):
    from safetensors.torch import load_file

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    full.mkdir()
    resumed.mkdir()
    outs = run_ranks(_train_cmd(full / "ckpt", full), tmp_path, "uninterrupted")
    assert all("restored step 0" in o for o in outs), outs

    # The checkpoint written mid-epoch at RESUME_AT, alone in a new directory.
    name = f"step_{RESUME_AT:09d}"
    src = full / "ckpt" / name
    shutil.copytree(src, resumed / "ckpt" / name)
    outs = run_ranks(_train_cmd(resumed / "ckpt", resumed), tmp_path, "resumed")
    assert all(f"restored step {RESUME_AT}" in o for o in outs), outs

    ref = [_losses(full / f"losses.jsonl.rank{r}") for r in range(WORLD)]
    got = [_losses(resumed / f"losses.jsonl.rank{r}") for r in range(WORLD)]
    for r in range(WORLD):
        assert sorted(ref[r]) == list(range(1, TOTAL + 1))
        assert sorted(got[r]) == list(range(RESUME_AT + 1, TOTAL + 1))
        diff = [s for s in got[r] if got[r][s] != ref[r][s]]
        assert not diff, (
            f"rank {r}: losses after restore differ from the uninterrupted run at steps {diff}: "
            f"{[(float.fromhex(ref[r][s]), float.fromhex(got[r][s])) for s in diff[:3]]}"
        )
    # The ranks really differ (own data shard, own dropout masks) ...
    assert ref[0] != ref[1]
    # ... and the model stays replicated: identical final parameters on both ranks, in both runs.
    params = {
        (run, r): load_file(str(d / f"params.st.rank{r}"))
        for run, d in (("full", full), ("resumed", resumed))
        for r in range(WORLD)
    }
    base = params[("full", 0)]
    for key, p in params.items():
        assert p.keys() == base.keys()
        for k in base:
            assert torch.equal(p[k].view(torch.uint8), base[k].view(torch.uint8)), (key, k)

    # Layout: one file pair per rank, replicated tensors only in shared.safetensors.
    files = sorted(os.listdir(src))
    assert files == [
        "manifest.json",
        "rank_00000.json",
        "rank_00000.safetensors",
        "rank_00001.json",
        "rank_00001.safetensors",
        "shared.json",
        "shared.safetensors",
    ]
    manifest = json.loads((src / "manifest.json").read_text())
    assert manifest["world_size"] == WORLD and manifest["step"] == RESUME_AT
    by_file = {f["path"]: f["rank"] for f in manifest["files"]}
    assert by_file == {
        "shared.json": 0,
        "shared.safetensors": 0,
        "rank_00000.json": 0,
        "rank_00000.safetensors": 0,
        "rank_00001.json": 1,
        "rank_00001.safetensors": 1,
    }
    shared_keys = _safetensors_keys(src / "shared.safetensors")
    model_keys = [k for k in shared_keys if k.startswith("model/")]
    assert len(model_keys) == 6  # 3 Linear layers x (weight, bias)
    assert any(k.startswith("optimizer/") for k in shared_keys)
    assert not [k for k in shared_keys if k.startswith(("@rank", "@rng"))]
    rank_states = []
    for r in range(WORLD):
        keys = _safetensors_keys(src / f"rank_{r:05d}.safetensors")
        assert keys and all(k.startswith(("@rank/", "@rng/")) for k in keys), (r, keys)
        assert "@rng/torch_cpu" in keys
        part = json.loads((src / f"rank_{r:05d}.json").read_text())
        assert part["rank"] == r
        node = part["per_rank"]["data"]  # the PerRank(ResumableSampler) at state["data"]
        assert node["__rc__"] == "stateful" and node["type"].endswith("ResumableSampler"), node
        sampler = node["state"]
        assert sampler["rank"] == r and sampler["num_replicas"] == WORLD
        assert (sampler["epoch"], sampler["position"]) == (2, 6 * 8)  # step 20 = 2 x 7 + 6
        rank_states.append((part["rng"], load_file(str(src / f"rank_{r:05d}.safetensors"))))
    # Per-rank RNG states really differ between the ranks.
    assert rank_states[0][0]["python"] != rank_states[1][0]["python"]
    assert not torch.equal(rank_states[0][1]["@rng/torch_cpu"], rank_states[1][1]["@rng/torch_cpu"])


@pytest.mark.slow  # the single-rank lost-disk test (test_exact_resume) covers it by default
def test_two_ranks_resume_from_the_remote_tier_into_an_empty_directory(tmp_path):
    """Two ranks upload through rank 0; a new run with an empty local directory restores step
    20 from the remote (rank 0 downloads, both ranks load) and continues exactly."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    full.mkdir()
    resumed.mkdir()
    remote = ["--remote", f"file://{tmp_path}/durable"]
    run_ranks([*_train_cmd(full / "ckpt", full), *remote], tmp_path, "uninterrupted+remote")
    assert sorted(os.listdir(tmp_path / "durable")) == [
        f"step_{s:09d}" for s in range(EVERY, TOTAL + 1, EVERY)
    ]
    cmd = [*_train_cmd(resumed / "ckpt", resumed), *remote, "--resume", str(RESUME_AT)]
    outs = run_ranks(cmd, tmp_path, "resumed-from-remote")
    assert all(f"restored step {RESUME_AT}" in o for o in outs), outs
    for r in range(WORLD):
        ref = _losses(full / f"losses.jsonl.rank{r}")
        got = _losses(resumed / f"losses.jsonl.rank{r}")
        assert sorted(got) == list(range(RESUME_AT + 1, TOTAL + 1))
        assert all(got[s] == ref[s] for s in got), r


def test_failure_on_one_rank_commits_nothing_and_keeps_older_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    out = tmp_path / "result"
    run_ranks([sys.executable, __file__, "fail-worker", str(root), str(out)], tmp_path, "fail")
    results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert res["first_restore"] == 0
        assert res["save5"] is True
        err = res["save10"]
        assert isinstance(err, dict) and err["type"] == "CheckpointWriteError", (r, err)
        assert err["failed_ranks"] == [1], (r, err)
        assert "rank 1" in err["message"] and "simulated failure" in err["message"], err
        # Nothing committed for step 10, no staging directory left, step 5 still valid.
        listing = res["listing_after_failure"]
        assert not [n for n in listing if n.startswith(".staging-")], listing
        assert not [n for n in listing if n.startswith("step_000000010")], listing
        assert res["checkpoints_after_failure"] == [["step_000000005", 5, "valid"]], res
        # A fresh Checkpointer restores the older checkpoint on every rank.
        assert res["restored"] == 5
        assert res["restored_model_ok"] is True
        assert res["restored_bomb_value"] == 500 + r
        assert res["restored_extra"] == {"note": "replicated"}
        assert res["save12"] is True
        assert res["read_only_restored"] == 12 and res["read_only_ok"] is True, res
        assert res["final_checkpoints"] == [
            ["step_000000005", 5, "valid"],
            ["step_000000012", 12, "valid"],
        ]
    assert not [n for n in os.listdir(root) if n.startswith(".staging-")]


def test_ranks_that_pass_different_steps_commit_nothing(tmp_path, caplog):
    """One save, step 10 on rank 0 and 9 on rank 1 (the distributed probe): it committed one
    checkpoint of step 10 holding rank 1's files of step 9, in silence; a key only rank 1 had
    was dropped, and no checkpoint could be resumed from. Now every rank gets the same
    CheckpointWriteError naming rank 1, and nothing is committed."""
    root, out = tmp_path / "ckpt", tmp_path / "result"
    run_ranks([sys.executable, __file__, "step-worker", str(root), str(out)], tmp_path, "step")
    for r in range(WORLD):
        res = json.loads(Path(f"{out}.rank{r}").read_text())
        assert res["error"] is not None, r
        assert res["error"]["failed_ranks"] == [1], res
        assert "every rank must pass the same step" in res["error"]["message"], res
        assert res["keys_error"]["failed_ranks"] == [1], res
        assert "must save the same state" in res["keys_error"]["message"], res
        assert res["steps"] == [5], res
    # resumed on one rank: rank 1's PerRank state is not loaded. Said as a warning only of
    # 'mine', which nothing replaces; the loader (re-sharded from rank 0's position) and the
    # part marked new_ranks='rank0' are said at INFO (the warning named them all as not loaded)
    mine, buffers = {"rank": None}, {"b": torch.zeros(2)}
    loader = ResumableDataLoader(range(8), 2, num_replicas=1, rank=0, seed=0)
    state = {"model": nn.Linear(4, 4), "mine": PerRank(mine), "extra": {}}
    state.update(loader=PerRank(loader), buffers=PerRank(buffers, new_ranks="rank0"))
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(root) as ck, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck.restore(state) == 5
    assert mine == {"rank": 0} and buffers["b"].tolist() == [0.0, 0.0]
    assert len(list(loader)) == 2  # the 4 samples of 8 the two ranks had not taken
    gone = [str(w.message) for w in caught if "PerRank state of rank 1" in str(w.message)]
    assert len(gone) == 1 and "in 'mine' is not loaded and nothing takes its place" in gone[0]
    assert "'loader'" not in gone[0] and "'buffers'" not in gone[0], gone
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    taken = [m for m in said if "PerRank state of rank 1" in m]
    assert len(taken) == 1 and "'buffers' is marked PerRank(new_ranks='rank0')" in taken[0], said
    assert "'loader' is a ResumableDataLoader" in taken[0], taken


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "step-worker":
    try:
        step_worker(sys.argv[2], sys.argv[3])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def grow_worker(root: str, out: str) -> None:
    """Two ranks resume a checkpoint one process wrote, then try to save a DTensor."""
    import random
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from resilient_callbacks import UnsupportedStateError

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)  # this process's own streams, before the restore
    random.seed(1000 + rank)
    state = {"model": nn.Linear(4, 4), "extra": {}}
    res: dict[str, Any] = {"rank": rank}
    with Checkpointer(root, preemption=False) as ck:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res["step"] = ck.restore(state)
        res["warnings"] = [str(w.message) for w in caught]
        res["torch"] = torch.rand(3).tolist()
        res["python"] = random.random()
        mesh = init_device_mesh("cpu", (WORLD,))
        sharded = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        try:
            ck.save(res["step"] + 1, {"model": state["model"], "w": sharded})
            res["dtensor_error"] = None
        except UnsupportedStateError as e:
            res["dtensor_error"] = str(e)
        res["listing"] = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "grow-worker":
    try:
        grow_worker(sys.argv[2], sys.argv[3])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


@pytest.mark.slow  # two ranks: ~1 s, ~10 s when it starts the session's zygote
def test_more_ranks_than_wrote_the_checkpoint_keep_their_own_streams_and_dtensors_are_refused(
    tmp_path,
):
    """docs/distributed.md, two claims no test held: resumed on more ranks than wrote it, a
    rank without a saved RNG state keeps its fresh streams, with a warning (rank 0 gets the
    saved ones); and a DTensor in the plain state is refused with an error that says to wrap
    it as Sharded(model, optimizer), on every rank, with nothing committed."""
    import random

    root, out = tmp_path / "ckpt", tmp_path / "result"
    torch.manual_seed(7)
    random.seed(7)
    with Checkpointer(root, async_save=False, preemption=False) as ck:
        ck.save(3, {"model": nn.Linear(4, 4), "extra": {}})
    saved_torch, saved_python = torch.rand(3).tolist(), random.random()
    run_ranks([sys.executable, __file__, "grow-worker", str(root), str(out)], tmp_path, "grow")
    r0, r1 = (json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD))
    assert r0["step"] == r1["step"] == 3
    assert (r0["torch"], r0["python"]) == (saved_torch, saved_python)
    torch.manual_seed(1001)  # rank 1's own streams, as its process left them
    random.seed(1001)
    nn.Linear(4, 4)  # (its initialization draws from torch's)
    assert (r1["torch"], r1["python"]) == (torch.rand(3).tolist(), random.random())
    assert not any("RNG state" in w for w in r0["warnings"]), r0["warnings"]
    assert any("rank 1 has no RNG state" in w and "start fresh" in w for w in r1["warnings"]), r1[
        "warnings"
    ]
    for r in (r0, r1):
        assert r["dtensor_error"] and "is a sharded DTensor" in r["dtensor_error"], r
        assert "Sharded(model, optimizer)" in r["dtensor_error"], r
        assert r["listing"] == ["step_000000003"], r


def peer_worker(root: str, out: str, mode: str) -> None:
    """Rank 1 dies (its process ends, as a crash ends it) after the first save; rank 0 then
    saves again, alone. Mode "step": rank 1 dies before any save; rank 0 then calls step()."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    state = {"model": nn.Linear(16, 16), "mine": PerRank({"rank": rank})}
    res: dict[str, Any] = {}
    ck = Checkpointer(root, async_save=mode == "background", preemption=False, every_n_steps=1)
    ck.restore(state)
    if mode != "step":
        ck.save(1, state)
        ck.flush()
    if rank == 1:
        os._exit(0)
    try:
        if mode == "step":  # the step's decision exchange, before any save
            ck.step(1, state)
        else:
            ck.save(2, state)
            ck.flush()
        res["error"] = None
    except Exception as e:
        res["error"] = {"type": type(e).__name__, "message": str(e), "cause": repr(e.__cause__)}
    if mode != "step":
        ck.close()
    res["listing"] = sorted(os.listdir(root))
    Path(out).write_text(json.dumps(res))
    os._exit(0)  # (no group to leave: the peer is gone)


def test_a_peer_that_dies_stops_the_save_with_a_clear_error_and_no_leftovers(tmp_path):
    """A rank dying before a save: the survivor's save raised gloo's RuntimeError ("Connection
    closed by peer"), not a CheckpointWriteError, and left its staging directory behind (the
    distributed probe). Now it is a CheckpointWriteError naming the step and the rank, the raw
    error chained, and the staging directory is removed; step 1 stays the newest."""
    for mode in ("synchronous", "background"):
        root, out = tmp_path / mode, tmp_path / f"{mode}.json"
        argv = [sys.executable, __file__, "peer-worker", str(root), str(out), mode]
        spawn_ranks.run(
            argv,
            WORLD,
            tmp_path,
            f"peer-{mode}",
            deadline=DEADLINE,
            zygote=spawn_ranks.shared_zygote(),
        )
        res = json.loads(out.read_text())
        err = res["error"]
        assert err is not None and err["type"] == "CheckpointWriteError", (mode, res)
        assert "the save of step 2 stopped on rank 0 (the rank reporting it)" in err["message"]
        # the likely cause first (it led with advice about saves under `if rank == 0:` and read
        # as if rank 0 had failed; found by a 2-rank kill-fuzzing probe)
        assert "most likely another rank's process is gone" in err["message"], err
        assert "RuntimeError" in err["cause"], err
        assert not [n for n in res["listing"] if n.startswith(".staging-")], res
        assert [n for n in res["listing"] if n.startswith("step_")] == ["step_000000001"]


def test_a_peer_gone_before_a_step_is_a_collective_error_saying_what_every_rank_must_do(tmp_path):
    """A rank gone (or not calling step() where the others do: a save under `if rank == 0:`)
    made the survivor's step() raise gloo's raw RuntimeError from the decision's all_reduce
    (the rank-0-only-save probe); now a CollectiveError names the call and the rank, says what
    every rank must do, and chains the raw error. No checkpoint is written."""
    root, out = tmp_path / "step", tmp_path / "step.json"
    argv = [sys.executable, __file__, "peer-worker", str(root), str(out), "step"]
    spawn_ranks.run(
        argv, WORLD, tmp_path, "peer-step", deadline=DEADLINE, zygote=spawn_ranks.shared_zygote()
    )
    res = json.loads(out.read_text())
    err = res["error"]
    assert err is not None and err["type"] == "CollectiveError", res
    assert err["message"].startswith(
        "step(1) stopped on rank 0 (the rank reporting it): exchanging with the other ranks"
    ), err
    assert "most likely another rank's process is gone" in err["message"], err
    assert "if rank == 0:" in err["message"] and "RuntimeError" in err["cause"], err
    assert not [n for n in res["listing"] if n.startswith(("step_", ".staging-"))], res


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "peer-worker":
    peer_worker(sys.argv[2], sys.argv[3], sys.argv[4])

if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "fail-worker":
    try:
        fail_worker(sys.argv[2], sys.argv[3])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def test_the_background_group_times_out_as_the_world_does(tmp_path):
    """The background saves' gloo group took the backend's 30-minute default: a rank whose
    peer hung during a background save waited in close() for 30 minutes after its own
    collectives had timed out (the distributed probe). It now has the world's timeout."""
    script = (
        "import datetime, os, torch, torch.distributed as td\n"
        "from resilient_callbacks import dist\n"
        "td.init_process_group('gloo', rank=0, world_size=1,"
        " timeout=datetime.timedelta(seconds=42))\n"
        "g = dist.new_cpu_group()\n"
        "print(g._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
        "td.destroy_process_group()\n"
    )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spawn_ranks.free_port()))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "42.0", out.stdout
