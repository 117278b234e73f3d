"""The CommitSession seam on its own: two gloo ranks (one OS process each) commit a checkpoint
without a Checkpointer, and a Checkpointer restores it.

(a) Each rank encodes its state and writes its part through the core's hashing writer
    (``layout.write_part``) into the staging directory that ``begin`` returned; rank 0 commits.
    A Checkpointer on both ranks then restores exactly that state (replicated model, per-rank
    object, per-rank RNG), and the manifest lists each rank's files.
(b) Both ranks write their parts and are then killed with SIGKILL before ``commit``: nothing is
    visible (the catalog shows no committed checkpoint), and the next writer to open the
    directory (a Checkpointer) sweeps the staging directory; restoring then starts fresh.
(c) A rank that fails passes its error to ``commit``: every rank raises CheckpointWriteError
    naming that rank, and nothing is committed.

This file doubles as the worker script: ``python test_seams_commit_session.py MODE DIR OUT``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import spawn_ranks
from resilient_callbacks import (
    Checkpointer,
    CheckpointWriteError,
    PerRank,
    catalog,
    layout,
    rng,
    structure,
)
from resilient_callbacks.session import CommitSession

WORLD = 2


class Counter:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["value"]


def _state(seed: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": nn.Linear(8, 4), "counter": PerRank(Counter(100 + rank)), "note": "x"}


def _write_part(session: CommitSession, state: dict[str, Any], rank: int) -> None:
    staging = session.begin()
    assert staging is not None
    shared, local = structure.encode(state, split_per_rank=True)
    rng_info, rng_tensors = rng.capture()
    session.add(
        layout.write_part(
            staging, rank, shared if rank == 0 else None, local, rng_info, rng_tensors
        )
    )


def worker(mode: str, root: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    res: dict[str, Any] = {"rank": rank}
    state = _state(0, rank)
    session = CommitSession(root, 7, run_id="seamtest00000000")
    if mode == "commit":
        os.makedirs(root, exist_ok=True)
        _write_part(session, state, rank)
        expected_rand = torch.rand(3).tolist()  # the RNG stream right after the capture
        done = session.commit(metrics={"loss": 0.5}, reason="forced")
        res["path"] = done.path
        res["seq"] = done.seq
        dist.barrier()
        fresh = _state(1, rank)
        fresh["counter"].obj.value = -1
        with Checkpointer(root, preemption=False) as ck:
            res["restored"] = ck.restore(fresh)
        res["model_ok"] = all(
            torch.equal(a, b)
            for a, b in zip(
                fresh["model"].state_dict().values(),
                state["model"].state_dict().values(),
                strict=True,
            )
        )
        res["counter"] = fresh["counter"].obj.value
        res["rng_ok"] = torch.rand(3).tolist() == expected_rand  # this rank's stream, restored
    elif mode == "kill":
        os.makedirs(root, exist_ok=True)
        _write_part(session, state, rank)
        dist.barrier()  # both parts are on disk, the manifest is not
        os.kill(os.getpid(), signal.SIGKILL)  # a real SIGKILL, before commit
    elif mode == "fail":
        os.makedirs(root, exist_ok=True)
        staging = session.begin()
        error = None
        if rank == 1:
            error = RuntimeError("simulated failure writing rank 1's part")
        else:
            assert staging is not None
            shared, local = structure.encode(state, split_per_rank=True)
            session.add(layout.write_part(staging, rank, shared, local, None, {}))
        try:
            session.commit(error)
            res["error"] = None
        except CheckpointWriteError as e:
            res["error"] = {"failed_ranks": list(e.failed_ranks), "message": str(e)}
        dist.barrier()
        res["listing"] = sorted(os.listdir(root))
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    spawn_ranks.leave_group()


def _run(mode: str, tmp: Path) -> list[dict[str, Any]]:
    """Run this file's worker as WORLD ranks to completion (the launcher of test_distributed)."""
    from test_distributed import run_ranks

    root, out = tmp / "ckpt", tmp / "out"
    run_ranks([sys.executable, __file__, mode, str(root), str(out)], tmp, mode)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD)]


# ----------------------------------------------------------------------------- tests

import pytest  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_two_ranks_commit_without_a_checkpointer_and_a_checkpointer_restores(tmp_path):
    res = _run("commit", tmp_path)
    assert res[0]["path"] == res[1]["path"] == str(tmp_path / "ckpt" / "step_000000007")
    assert res[0]["seq"] == 1
    for r in range(WORLD):
        assert res[r]["restored"] == 7
        assert res[r]["model_ok"]
        assert res[r]["counter"] == 100 + r  # each rank's own part
        assert res[r]["rng_ok"]
    manifest = json.loads((tmp_path / "ckpt" / "step_000000007" / "manifest.json").read_text())
    assert manifest["world_size"] == WORLD and manifest["run_id"] == "seamtest00000000"
    assert manifest["metrics"] == {"loss": 0.5}
    per_rank = {
        name: r for r in range(WORLD) for name in (layout.rank_structure(r), layout.rank_tensors(r))
    }
    expected = {layout.SHARED_STRUCTURE: 0, layout.SHARED_TENSORS: 0, **per_rank}
    assert {f["path"]: f["rank"] for f in manifest["files"]} == expected
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000000007"
    entries = catalog.scan(str(tmp_path / "ckpt"), catalog.Depth.FULL)
    assert [(e.name, str(e.status)) for e in entries] == [("step_000000007", "valid")]


def test_sigkill_before_commit_leaves_nothing_visible_and_the_next_open_sweeps(tmp_path):
    with pytest.raises(AssertionError, match="a rank failed") as failed:
        _run("kill", tmp_path)
    assert str(failed.value).count("(rc=-9)") == WORLD, failed.value  # both killed by SIGKILL
    root = tmp_path / "ckpt"

    entries = catalog.scan(str(root), catalog.Depth.FULL)
    assert catalog.committed(entries) == []  # nothing visible
    staged = [e for e in entries if e.name.startswith(".staging-")]
    files = sorted(os.listdir(staged[0].path)) if len(staged) == 1 else []
    assert len(files) == 6 and "manifest.json" not in files  # both parts, no manifest

    state = _state(5, 0)
    with Checkpointer(root, preemption=False) as ck:  # the next open sweeps the leftover
        assert not [n for n in os.listdir(root) if n.startswith(".staging-")]
        assert ck.restore(state) == 0  # nothing to resume from: a fresh start
    assert catalog.scan(str(root), catalog.Depth.FULL) == []


def test_a_failed_rank_means_no_commit_on_every_rank(tmp_path):
    res = _run("fail", tmp_path)
    for r in range(WORLD):
        assert res[r]["error"] is not None, res[r]
        assert res[r]["error"]["failed_ranks"] == [1]
        assert "simulated failure" in res[r]["error"]["message"]
        assert not [n for n in res[r]["listing"] if n.startswith((".staging-", "step_"))]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3])


def test_a_subclass_of_rename_commit_with_its_own_commit_still_gets_latest(tmp_path):
    """A strategy subclassing RenameCommit whose ``commit`` has the protocol's three
    arguments (written before ``latest=`` existed) commits, and ``latest`` names the commit."""
    from resilient_callbacks.commit import RenameCommit

    calls = []

    class Logged(RenameCommit):
        def commit(self, staging: str, step: int, manifest: bytes) -> str:  # type: ignore[override]
            calls.append(step)
            return super().commit(staging, step, manifest)

    os.makedirs(tmp_path / "ck")
    session = CommitSession(tmp_path / "ck", 3, run_id="seamtest00000000")
    session.strategy = Logged(session.dirpath)
    _write_part(session, _state(0, 0), 0)
    done = session.commit()
    assert calls == [3]
    assert (tmp_path / "ck" / "latest").read_text().strip() == os.path.basename(done.path)
