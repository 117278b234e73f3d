"""The core's JSON collectives (``resilient_callbacks.dist``) on 2 real gloo ranks: results,
and how many collectives each issues (one for payloads that fit the first round's frame)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import spawn_ranks
from resilient_callbacks import dist

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

LONG = "x" * (3 * dist.INLINE)


def test_json_collectives_on_two_ranks(tmp_path: Path) -> None:
    worker = str(Path(__file__).with_name("dist_json_worker.py"))
    spawn_ranks.run([sys.executable, worker, str(tmp_path / "out")], 2, tmp_path, "json")
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
