"""The drop-in ``ResilientStorageWriter`` / ``ResilientStorageReader`` against DCP options and
arguments that do not fit them: each is refused clearly, before anything is written or read,
never saved somewhere else or half-way.

One process (DCP runs without collectives); the planner is DCP's own.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from resilient_callbacks import catalog
from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter


class _CachingPlanner(DefaultSavePlanner):
    """DCP's plan caching (as Megatron-Core and others turn on), under a cache key of its own:
    DCP keeps the cached plans in class-level dicts keyed by the planner's class name."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def _steps(root) -> list[int]:
    return [e.step for e in catalog.committed(catalog.scan(str(root)))]


def test_a_planner_with_plan_caching_is_refused_at_the_first_save(tmp_path):
    """With ``enable_plan_caching=True`` DCP hands each rank, from the second save on, the plan
    of the save that filled its cache -- with that save's staging directory in it: the ranks
    wrote into the first save's (renamed) staging path, recreated, and the commit failed with
    "files listed in the manifest are not in the staging directory ... dirpath must be on a
    filesystem all ranks share". Refused at the first save, naming the option; nothing is
    committed or left behind, and a save without it goes on."""
    root = tmp_path / "ck"
    with ResilientStorageWriter(root) as w:
        for step in (1, 2):
            with pytest.raises(BaseException, match="enable_plan_caching") as caught:
                sd = {"t": torch.full((4,), float(step)), "epoch": step}
                dcp.save(sd, storage_writer=w, planner=_CachingPlanner(), checkpoint_id=step)
            assert "UnsupportedStateError" in str(caught.value)
        assert _steps(root) == []
        dcp.save({"t": torch.full((4,), 3.0), "epoch": 3}, storage_writer=w, checkpoint_id=3)
    assert _steps(root) == [3]
    assert not [n for n in os.listdir(root) if n.startswith(".staging-")]
    got = {"t": torch.zeros(4), "epoch": 0}
    dcp.load(got, storage_reader=ResilientStorageReader(root))
    assert torch.equal(got["t"], torch.full((4,), 3.0)) and got["epoch"] == 3
