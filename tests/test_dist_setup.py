"""A Checkpointer's process group: created before it, and the same at every call.

Under torchrun (``WORLD_SIZE=2`` in the environment) a Checkpointer created before
``init_process_group`` took each process for rank 0 of a world of one: rank 1 was refused by the
directory's lock with an error that named no cause, and rank 0 waited in restore() until the
process group's timeout; created without ``WORLD_SIZE`` (``mp.spawn``) and used after the group
appeared, both ranks wrote into rank 0's staging directory as coordinators. Both are refused now,
with a ConfigError that says to call ``init_process_group`` first. This file doubles as the worker
script: ``python test_dist_setup.py worker ROOT OUT MODE``. Ranks given different options (a
schedule on one rank only) are refused alike at construction too. A group destroyed while a
save is in flight commits nothing, in shared and in node-local mode (each rank its own dirpath,
a ``file://`` remote).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import spawn_ranks
from resilient_callbacks import Checkpointer, ConfigError

WORLD = 2
DEADLINE = 120.0  # seconds for one group of ranks: a hang fails the test


def _write_part(staging: Any, rank: int, shared: bool) -> Any:
    """This rank's part of a state ``{"w": zeros(2)}`` written into ``staging`` (with the
    shared values where ``shared``), as a save writes it."""
    from resilient_callbacks import layout, rng, structure

    values, local = structure.encode({"w": torch.zeros(2)}, split_per_rank=True)
    rng_info, rng_tensors = rng.capture()
    return layout.write_part(
        staging, rank, values if shared else None, local, rng_info, rng_tensors
    )


def _commit(session: Any) -> str:
    """``session.commit()``: "committed", or the CheckpointWriteError's message."""
    from resilient_callbacks import CheckpointWriteError

    try:
        session.commit()
        return "committed"
    except CheckpointWriteError as e:
        return str(e)


def worker(root: str, out: str, mode: str) -> None:
    import torch.distributed as td

    res: dict[str, Any] = {}
    rank = int(os.environ["RANK"])
    if mode == "options":  # each rank its own schedule and retention
        td.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        opts = {"adaptive": True} if rank == 0 else {"every_n_steps": 2, "keep_last": 2}
        try:
            with Checkpointer(root, preemption=False, **opts) as ck:
                res["created"] = [ck.step(s, {"w": torch.zeros(2)}) for s in (1, 2)]
        except ConfigError as e:
            res["created"] = str(e)
        td.barrier()
        res["listing"] = sorted(str(p.relative_to(root)) for p in Path(root).rglob("step_*"))
        Path(f"{out}.rank{rank}").write_text(json.dumps(res))
        spawn_ranks.leave_group()
    if mode == "destroyed":  # the group destroyed between a save's begin and its commit
        from resilient_callbacks.session import CommitSession

        td.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        os.makedirs(root, exist_ok=True)
        session = CommitSession(root, 3, run_id="setup00000000000")
        staging = session.begin()
        assert staging is not None
        session.add(_write_part(staging, rank, shared=rank == 0))
        td.barrier()
        td.destroy_process_group()
        res["commit"] = _commit(session)
        Path(f"{out}.rank{rank}").write_text(json.dumps(res))
        sys.exit(0)
    if mode == "inflight_nodelocal":  # a background save held in its write while destroyed
        import threading

        from resilient_callbacks import layout

        td.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        ck = Checkpointer(f"{root}/node{rank}", preemption=False, remote=f"file://{root}/remote")
        ck.restore({"w": torch.zeros(2)})
        go, inside = threading.Event(), threading.Event()
        real = layout.write_part

        def held(*a, **k):
            inside.set()
            assert go.wait(60)
            return real(*a, **k)

        layout.write_part = held
        ck.save(3, {"w": torch.zeros(2)})
        assert inside.wait(60)
        td.barrier()
        td.destroy_process_group()
        go.set()
        try:
            ck.close()
            res["close"] = "closed"
        except Exception as e:
            res["close"] = f"{type(e).__name__}: {e}"
        mine = Path(root, f"node{rank}")
        res["listing"] = sorted(p.name for p in mine.rglob("*") if "step_" in p.name)
        Path(f"{out}.rank{rank}").write_text(json.dumps(res))
        os._exit(0)
    if mode.startswith("destroyed_nodelocal"):  # the same, each rank a node with its own disk
        from resilient_callbacks.node_session import NodeLocalSession

        td.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        ck = Checkpointer(f"{root}/node{rank}", preemption=False, remote=f"file://{root}/remote")
        ck.restore({"w": torch.zeros(2)})  # (a fresh start: names the run)
        assert ck._dir.run_id is not None
        session = NodeLocalSession(ck._dir, 3, run_id=ck._dir.run_id)
        if mode.endswith("_before_begin"):  # (the save's thread had not begun yet)
            td.barrier()
            td.destroy_process_group()
        staging = session.begin()
        if staging is not None:
            session.add(_write_part(staging, rank, shared=True))
        if td.is_initialized():
            td.barrier()
            td.destroy_process_group()
        res["commit"] = _commit(session)
        mine = Path(root, f"node{rank}")  # (its own node's: the other may not be done)
        res["listing"] = sorted(p.name for p in mine.rglob("*") if "step_" in p.name)
        Path(f"{out}.rank{rank}").write_text(json.dumps(res))
        os._exit(0)  # (close() refuses a destroyed group)
    if mode == "perrank":  # a path per rank, as torch.save users write one file per rank
        td.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        try:
            Checkpointer(f"{root}/{rank}", preemption=False).close()
            res["created"] = True
        except ConfigError as e:
            res["created"] = str(e)
        Path(f"{out}.rank{rank}").write_text(json.dumps(res))
        spawn_ranks.leave_group()
    if mode == "after_destroy":  # a save called once the group is gone
        td.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        ck = Checkpointer(root, preemption=False, async_save=False)
        td.barrier()
        td.destroy_process_group()
        try:
            ck.save(1, {"w": torch.zeros(2)})
            res["save"] = "saved"
        except ConfigError as e:
            res["save"] = str(e)
        res["listing"] = sorted(str(p.relative_to(root)) for p in Path(root).rglob("step_*"))
        Path(f"{out}.rank{rank}").write_text(json.dumps(res))
        sys.exit(0)
    if mode == "rank0_only":  # created under `if rank == 0:`; rank 1 goes its own way
        from resilient_callbacks import CollectiveError

        td.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        if rank == 0:
            try:
                Checkpointer(root, preemption=False)
                res["created"] = True
            except CollectiveError as e:
                res["created"] = str(e)
            except Exception as e:  # the backend's raw error
                res["created"] = f"raw {type(e).__name__}: {e}"
            Path(f"{out}.rank{rank}").write_text(json.dumps(res))
        os._exit(0)  # rank 1 at once: its peer sees it gone
    if mode == "late":  # as mp.spawn users do: no WORLD_SIZE, the group's size passed in
        del os.environ["RANK"]
        n = int(os.environ.pop("WORLD_SIZE"))
    ck = None
    try:
        ck = Checkpointer(f"{root}/{rank}", preemption=False)
        res["created"] = True
    except ConfigError as e:
        res["created"] = str(e)
    if mode == "late":
        td.init_process_group("gloo", rank=rank, world_size=n)
    else:
        td.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = td.get_rank()
    if ck is not None:
        state = {"w": torch.arange(4.0) + rank}
        try:
            ck.restore(state)
            ck.save(1, state)
            res["used"] = True
        except ConfigError as e:
            res["used"] = str(e)
        ck.close()
    td.barrier()  # both ranks are done with the directory
    res["listing"] = sorted(str(p.relative_to(root)) for p in Path(root).rglob("step_*"))
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    spawn_ranks.leave_group()


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "worker":
    worker(sys.argv[2], sys.argv[3], sys.argv[4])
    sys.exit(0)

import pytest  # noqa: E402  (after the worker code, which does not need it)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _ranks(tmp_path: Path, mode: str) -> list[dict[str, Any]]:
    root, out = tmp_path / mode, tmp_path / f"{mode}.out"
    argv = [sys.executable, __file__, "worker", str(root), str(out), mode]
    zygote = spawn_ranks.shared_zygote()
    spawn_ranks.run(argv, WORLD, tmp_path, mode, deadline=DEADLINE, zygote=zygote)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD)]


def test_created_before_init_process_group_under_torchrun_is_refused_on_every_rank(tmp_path):
    """Every rank (each given ROOT/<RANK>, so that the old lock error cannot hide the rest) is
    refused at construction, saying what to do; nothing is written."""
    for r, res in enumerate(_ranks(tmp_path, "early")):
        msg = res["created"]
        assert msg is not True, (r, res)
        assert "created before torch.distributed.init_process_group" in msg, msg
        assert f"rank {r} of WORLD_SIZE=2" in msg, msg
        assert "init_process_group(...) first, then create the Checkpointer" in msg, msg
        assert res["listing"] == [], res


def test_used_after_a_group_it_did_not_see_is_refused_before_writing(tmp_path):
    """Created without WORLD_SIZE and without a group (each rank its own dirpath), then used
    once a group of 2 exists: refused at restore(), on both ranks; no checkpoint written (it
    wrote step 1 into rank 0's directory from both ranks)."""
    for res in _ranks(tmp_path, "late"):
        assert res["created"] is True, res
        assert "created without a process group" in res["used"], res
        assert "now has 2 ranks" in res["used"], res
        assert res["listing"] == [], res


@pytest.mark.parametrize("world", [None, "1"])
def test_one_process_without_a_launched_world_is_untouched(tmp_path, monkeypatch, world):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    state = {"w": torch.arange(3.0)}
    with Checkpointer(tmp_path / "ck", preemption=False, async_save=False) as ck:
        assert ck.restore(state) == 0
        assert ck.save(1, state)
    assert [e.step for e in ck.checkpoints()] == [1]


def test_one_process_launched_as_one_of_two_without_a_group_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"rank 1 of WORLD_SIZE=2 but has no process group"):
        Checkpointer(tmp_path / "ck", preemption=False)
    assert not (tmp_path / "ck").exists()


def test_ranks_given_different_options_are_refused_alike_at_construction(tmp_path):
    """Rank 0 adaptive, rank 1 every 2 steps and keep_last=2: rank 1 waited in the save of
    step 2 that rank 0 never reached, until the process group's timeout. Now every rank raises
    the same ConfigError at construction, naming each option and each rank's value."""
    outs = _ranks(tmp_path, "options")
    assert outs[0]["created"] == outs[1]["created"], outs
    msg = outs[0]["created"]
    assert isinstance(msg, str) and "created their Checkpointer with different options" in msg
    assert "every_n_steps: rank 0 None, rank 1 2" in msg, msg
    assert "keep_last: rank 0 None, rank 1 2" in msg and "adaptive: rank 0 True" in msg, msg
    assert "every rank must pass the same arguments" in msg, msg
    assert outs[0]["listing"] == [], outs


def test_a_commit_whose_process_group_was_destroyed_commits_nothing(tmp_path):
    """destroy_process_group() between a save's begin and its commit (a background save still
    in flight when the script tears the group down, then close()): the collectives became
    no-ops, and rank 0 committed a checkpoint of 2 ranks holding its own files only, while
    rank 1 raised a failure of "rank 0 (commit): None". Now both raise, saying that only one
    of the 2 ranks reported and why; nothing is committed and no staging directory is left."""
    outs = _ranks(tmp_path, "destroyed")
    for res in outs:
        msg = res["commit"]
        assert msg != "committed", outs
        assert "only 1 of its 2 ranks reported" in msg, msg
        assert "destroy_process_group" in msg, msg
    assert os.listdir(tmp_path / "destroyed") == [], os.listdir(tmp_path / "destroyed")


def test_ranks_given_per_rank_dirpaths_are_told_so(tmp_path):
    """ckpt/0 on rank 0, ckpt/1 on rank 1 (one host): refused, as before, but the error spoke
    of '2 nodes each seeing their own directory' and asked for a remote tier; it now says the
    ranks were given different dirpaths, names them, and asks for one shared dirpath."""
    root = tmp_path / "perrank"
    for res in _ranks(tmp_path, "perrank"):
        msg = res["created"]
        assert isinstance(msg, str) and "the ranks were given different dirpaths" in msg, res
        assert f"rank 0 {str(root / '0')!r}, rank 1 {str(root / '1')!r}" in msg, msg
        assert "every rank must pass the same dirpath" in msg, msg


def test_a_save_after_destroy_process_group_is_refused(tmp_path):
    """save() once the process group is destroyed ran the save as if each rank were alone
    (collectives without a group are no-ops); it is refused now, saying to close() first."""
    for res in _ranks(tmp_path, "after_destroy"):
        assert "created on 2 ranks, and the process group was destroyed" in res["save"], res
        assert "close() it before destroy_process_group" in res["save"], res
        assert res["listing"] == [], res


def test_a_checkpointer_created_on_rank_0_only_is_a_collective_error(tmp_path):
    """Created under `if rank == 0:` (rank 1 gone meanwhile, or waiting elsewhere until the
    group's timeout): the constructor raised gloo's raw RuntimeError; now a CollectiveError
    that names the call and says every rank creates it at the same point."""
    root, out = tmp_path / "rank0_only", tmp_path / "rank0_only.out"
    argv = [sys.executable, __file__, "worker", str(root), str(out), "rank0_only"]
    zygote = spawn_ranks.shared_zygote()
    spawn_ranks.run(argv, WORLD, tmp_path, "rank0_only", deadline=DEADLINE, zygote=zygote)
    msg = json.loads(Path(f"{out}.rank0").read_text())["created"]
    assert isinstance(msg, str) and msg.startswith(
        "creating the Checkpointer (every rank creates"
    ), msg
    assert "stopped on rank 0" in msg, msg


def test_a_read_only_reader_launched_as_one_of_two_without_a_group_restores(tmp_path, monkeypatch):
    """An evaluation script under torchrun, or a Lightning child process of devices=2 (its
    launcher sets WORLD_SIZE before the script runs from the top), that restores with a
    read-only Checkpointer before the group exists (docs/lightning.md's inference example):
    nothing is written, so each process reads alone; it was refused as a writer is."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with Checkpointer(tmp_path / "ck", preemption=False, async_save=False) as ck:
        ck.save(3, {"w": torch.arange(3.0)})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    state = {"w": torch.zeros(3)}
    with Checkpointer(tmp_path / "ck", read_only=True) as reader:
        assert reader.restore(state) == 3
    assert torch.equal(state["w"], torch.arange(3.0))


@pytest.mark.parametrize("when", ["", "_before_begin"])
def test_a_node_local_commit_whose_process_group_was_destroyed_commits_nothing(tmp_path, when):
    """The same in node-local mode (each rank a node with its own dirpath, a remote tier): the
    gathers returned each rank's own report, so each node committed its part without hearing
    the other, and rank 1 acted as the coordinator too; both ranks said committed. Now both
    raise, saying why; no node holds the checkpoint. Destroyed before the save's begin(), rank 1
    failed on rank 0's broadcast (TypeError: 'NoneType' object is not subscriptable)."""
    outs = _ranks(tmp_path, f"destroyed_nodelocal{when}")
    for res in outs:
        msg = res["commit"]
        assert msg != "committed", outs
        assert "only this one of its 2 ranks could report" in msg, msg
        assert "destroy_process_group" in msg, msg
        assert res["listing"] == [], outs


def test_a_node_local_save_in_flight_when_the_group_is_destroyed_commits_nothing(tmp_path):
    """As users hit it: a background save in flight, destroy_process_group(), then close().
    Rank 1 closed as if all was well while rank 0 raised UploadIncompleteError blaming the
    store ("stopped answering for more than 300 s"), and both nodes kept step 3. Now close()
    raises on both ranks saying the group was destroyed first; no node keeps step 3."""
    for res in _ranks(tmp_path, "inflight_nodelocal"):
        assert res["close"].startswith("CheckpointWriteError: "), res
        assert "process group was destroyed before the save finished" in res["close"], res
        assert res["listing"] == [], res
