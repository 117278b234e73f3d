"""Lightning (DDP on 2 and 1 CPU processes) resumed on another number of ranks, in the middle
of an epoch and at an epoch's end: every epoch trains every sample once, and the run ends at
the step count of its shardings (found by a probe: Lightning kept the length of the rest of
the resumed epoch as every later epoch's, and stopped the resumed epoch early, silently
training fewer batches). The script: tests/lightning_reshard_train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("lightning_reshard_train.py")
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _run(tmp: Path, devices: int, max_steps: int, name: str) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, str(SCRIPT), str(tmp / "ck"), str(devices), str(max_steps)]
    p = subprocess.run(
        [*argv, str(tmp / name)], capture_output=True, text=True, timeout=500, env=env, cwd=tmp
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads((tmp / f"{name}.rank{r}").read_text()) for r in range(devices)]


def _per_epoch(records: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for rec in records:
        for epoch, ids in rec["seen"].items():
            out.setdefault(int(epoch), []).extend(ids)
    return out


@pytest.mark.parametrize(
    "plan, steps, batches",
    [
        # 2 ranks to step 13 (epoch 1, 3 batches in), 1 rank to 20 (inside the re-sharded rest),
        # 2 ranks to the end: 13 + 7 on 1 rank + 4 + 10 on 2 ranks
        pytest.param([(2, 13), (1, 20), (2, -1)], 34, 10, marks=pytest.mark.slow),  # time budget
        # 2 ranks to step 10 (epoch 0's last batch), 1 rank to the end: 10 + 20 + 20
        pytest.param([(2, 10), (1, -1)], 50, 20, marks=pytest.mark.slow),
    ],
    ids=["mid-epoch-2-1-2", "epoch-end-2-1"],
)
def test_every_epoch_trains_every_sample_once_across_rank_changes(tmp_path, plan, steps, batches):
    records: list[dict] = []
    for i, (devices, max_steps) in enumerate(plan):
        records += (last := _run(tmp_path, devices, max_steps, f"run{i}"))
    for epoch, ids in sorted(_per_epoch(records).items()):
        assert sorted(ids) == list(range(120)), (epoch, len(ids), len(set(ids)))
    assert {r["global_step"] for r in last} == {steps}
    assert {r["batches"] for r in last} == {batches}  # the last epoch's length, not the rest's
