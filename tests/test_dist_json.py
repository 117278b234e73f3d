"""The core's collectives on 2 real gloo ranks: the JSON collectives (``resilient_callbacks.dist``),
their results and how many collectives each issues (one for payloads that fit the first round's
frame); and when a Checkpointer makes the process group of its background saves."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

import spawn_ranks
from resilient_callbacks import dist
from resilient_callbacks._version import release

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

LONG = "x" * (3 * dist.INLINE)


def test_json_collectives_on_two_ranks(tmp_path: Path) -> None:
    worker = str(Path(__file__).with_name("dist_json_worker.py"))
    argv = [sys.executable, worker, str(tmp_path / "out")]
    spawn_ranks.run(argv, 2, tmp_path, "json", zygote=spawn_ranks.shared_zygote())
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        values = [g["value"] for g in got]
        collectives = [g["collectives"] for g in got]
        assert values == [
            [{"rank": 0, "ok": True}, {"rank": 1, "ok": True}],
            [{"rank": 0, "pad": ""}, {"rank": 1, "pad": LONG}],
            [[0, LONG], [1, LONG * 2]],
            [None, None],
            {"from": 1, "key": [1, 2]},
            {"from": 0, "pad": LONG},
            {"1": "int keys arrive as strings"},
            [{"rank": 0, "pad": LONG}, {"rank": 1, "pad": ""}] if rank == 0 else None,
        ]
        # a payload that fits: one collective; one that does not (on any rank): two
        assert collectives == [1, 2, 2, 1, 1, 2, 1, 2]


def test_the_background_group_is_made_at_the_first_background_save(tmp_path: Path) -> None:
    """A Checkpointer that only restores makes no process group (nor tears one down at close);
    background saves make one, once, at the first of them. Every group the library makes (node-
    local mode's too) times out with the world, not after gloo's default 30 minutes: a world set
    to wait 2 hours for slow saves had node-local exchanges fail after 30 minutes, one set to 60 s
    hung there for 30 minutes."""
    worker = str(Path(__file__).with_name("group_worker.py"))
    spawn_ranks.run(
        [sys.executable, worker, str(tmp_path / "ck"), str(tmp_path / "out")],
        2,
        tmp_path,
        "g",
        zygote=spawn_ranks.shared_zygote(),
    )
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        # [what the use returned, groups made in all]: restore 0 -> 0 groups; saves 1-3 -> 1
        # group, made by the first save (1 already when it returned); restore 3 -> 0; sync -> 0
        assert counts[:4] == [[0, 0], [1, 1], [3, 0], [0, 0]]
        assert counts[4][0] is True and counts[4][1] >= 3  # node-local: node, leaders, all
        timeouts = json.loads((tmp_path / f"out.timeouts.rank{rank}.json").read_text())
        assert len(timeouts) >= 1 + 3 and set(timeouts) == {60.0}


@pytest.mark.parametrize(
    ("version", "destroys"),
    [("2.4.1+cu121", False), ("2.7.1", False), ("2.8.0a0+5228986.nv25.06", True), ("2.13.0", True)],
)
def test_the_background_group_is_destroyed_only_where_torch_can_do_it_safely(
    monkeypatch: pytest.MonkeyPatch, version: str, destroys: bool
) -> None:
    """Before torch 2.8, destroying a gloo group could deadlock on the GIL (close() hung about
    once in 25 two-rank runs on torch 2.4.1): there the group is left to the process's exit."""
    import torch

    destroyed: list[object] = []
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", destroyed.append)
    group = object()
    assert dist.destroy_cpu_group(group) is destroys
    assert destroyed == ([group] if destroys else [])
    assert release(version)[0] == 2 and release("nightly") == (0, 0)


GLOO_STALE = (
    "Gloo connectFullMesh failed with [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
    "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:3500$0"
)


@pytest.mark.parametrize("attempt", ["0", "2"])
def test_a_group_that_dials_a_restarts_stale_address_is_told_as_torchruns_store(
    monkeypatch: pytest.MonkeyPatch, attempt: str
) -> None:
    """Under `torchrun --max-restarts` (torch >= 2.5: the workers share the agent's store,
    which outlives a restart) a restarted worker's first background save made its gloo group
    from the previous attempt's addresses: gloo's "connectFullMesh ... Connection refused"
    (seen 2026-12-06 in a plain DDP loop, torch 2.13). The error said "most likely another
    rank's process is gone", and every further restart failed alike; it now names the store
    and the variable that avoids it. A first attempt keeps the old reading."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
    said = dist.failed_exchange(RuntimeError(GLOO_STALE))
    assert "connectFullMesh" in said
    if attempt == "0":
        assert "another rank's process is gone" in said
    else:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said and "attempt 2" in said
        assert "process is gone" not in said


def _store_warnings(monkeypatch: pytest.MonkeyPatch, times: int) -> list[str]:
    """The warnings of ``times`` calls of ``dist.warn_if_restarts_share_a_store`` on rank 0 of
    2, in a process that has not warned yet."""
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "rank", lambda: 0)
    monkeypatch.setattr(dist, "_store_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            dist.warn_if_restarts_share_a_store()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "env, warned",
    [
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"}, True),
        ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "2"}, False),
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),
    ],
    ids=["shared-store-restarts", "own-store", "no-restarts"],
)
def test_workers_torchrun_restarts_over_a_shared_store_are_warned_once(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], warned: bool
) -> None:
    """torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch >= 2.5):
    a probe of a plain DDP loop (torch 2.13, 2 gloo workers, one SIGKILLed) saw the restarted
    workers fail in init_process_group or in the checkpointer's first save, or hang, in 4 of
    6 runs, with nothing in the first attempt's log pointing at the cause. A Checkpointer made
    there now says it once, on rank 0, before anything fails."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    caught = _store_warnings(monkeypatch, times=2)
    said = [m for m in caught if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in m]
    assert len(said) == (1 if warned else 0), said


def test_a_set_variable_with_a_shared_store_is_told_as_torchruns_static_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 acts on the c10d rendezvous only: torchrun's
    default static one (plain `torchrun --max-restarts`, integrations/torchrun/run.sh on
    several nodes) shares its store all the same (TORCHELASTIC_USE_AGENT_STORE=True), and its
    restarted workers failed with the stale addresses with the variable set (probed 2026-12-06,
    torch 2.13, 2 of 2 runs). The warning and the error told such a run to set the variable it
    had set; they now name the c10d rendezvous."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    said = [m for m in _store_warnings(monkeypatch, times=1) if "rendezvous" in m]
    said.append(dist.failed_exchange(RuntimeError(GLOO_STALE)))
    assert len(said) == 2
    for message in said:
        assert "is set, but torchrun's static rendezvous" in message
        assert "--rdzv-backend=c10d" in message
        assert "Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" not in message
