"""Lightning (DDP on 2 and 1 CPU processes) resumed on another number of ranks, in the middle
of an epoch and at an epoch's end: every epoch trains every sample once, and the run ends at
the step count of its shardings (found by a probe: Lightning kept the length of the rest of
the resumed epoch as every later epoch's, and stopped the resumed epoch early, silently
training fewer batches); and what a resume on fewer ranks says of the ranks gone's ``"data"``
part. The script: tests/lightning_reshard_train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("lightning_reshard_train.py")
ROOT = Path(__file__).resolve().parents[1]


def _run(tmp: Path, devices: int, max_steps: int, name: str, *more: str) -> tuple[list[dict], str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, str(SCRIPT), str(tmp / "ck"), str(devices), str(max_steps)]
    p = subprocess.run(
        [*argv, str(tmp / name), *more],
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
        cwd=tmp,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads((tmp / f"{name}.rank{r}").read_text()) for r in range(devices)], p.stderr


def _per_epoch(records: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for rec in records:
        for epoch, ids in rec["seen"].items():
            out.setdefault(int(epoch), []).extend(ids)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(600)
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
        last, err = _run(tmp_path, devices, max_steps, f"run{i}")
        records += last
        if i and devices < plan[i - 1][0]:
            # rank 1's "data" part (its loader position, its callbacks' states) was said to be
            # dropped, nothing in its place, though the loader resumed from rank 0's position:
            # only the RNG streams of rank 1 are lost
            assert "the RNG states of rank 1 are not loaded" in err, err[-3000:]
            assert "in 'data'" not in err, err[-3000:]
    for epoch, ids in sorted(_per_epoch(records).items()):
        assert sorted(ids) == list(range(120)), (epoch, len(ids), len(set(ids)))
    assert {r["global_step"] for r in last} == {steps}
    assert {r["batches"] for r in last} == {batches}  # the last epoch's length, not the rest's


@pytest.mark.distributed
@pytest.mark.slow  # two runs of Lightning's DDP
def test_a_stateful_dataloader_resumed_on_fewer_ranks_is_warned_about_and_loses_the_order(
    tmp_path,
):
    """torchdata's StatefulDataLoader (left as it is by the callback), 2 ranks to step 13, then
    1 rank: rank 1's position in it is dropped, and the warning says so and what it does to
    the epoch, as it happens: the resumed epoch trains some samples twice and misses others."""
    first, _ = _run(tmp_path, 2, 13, "run0", "stateful")
    last, err = _run(tmp_path, 1, -1, "run1", "stateful")
    said = [line for line in err.splitlines() if "in 'data'" in line]
    assert len(said) == 1 and "train dataloader(s) #0 is each rank's own" in said[0], err[-3000:]
    assert "samples may be trained twice or not at all" in said[0], said
    epoch_1 = _per_epoch(first + last)[1]
    assert len(set(epoch_1)) < 120 < len(epoch_1), (len(epoch_1), len(set(epoch_1)))


def _said_of_data(loaders: list) -> tuple[list[str], list[str]]:
    """What a restore on 1 rank of a 2-rank checkpoint says of the Lightning ``"data"`` part
    whose train dataloaders saved ``loaders`` (rank 0's), a callback state with them."""
    from resilient_callbacks.lightning.state import DataReceiver
    from resilient_callbacks.state_marks import gone_state

    data = DataReceiver()
    data.load_state_dict({"loaders": loaders, "callbacks": {"EarlyStopping": {"wait_count": 1}}})
    how, note = data.stand_in_for_gone_ranks()
    return gone_state(1, 2, {"data": how}, False, {"data": note})


def test_the_data_part_of_the_ranks_gone_is_dropped_only_for_loaders_not_resharded():
    """The ranks gone's ``"data"`` (loader positions, callback states) was said to be dropped
    with nothing in its place, and to mark it PerRank(new_ranks='rank0'), which a Lightning user
    cannot: a ResumableDataLoader (what a plain DataLoader is made) resumes from rank 0's
    position re-sharded, at INFO; a loader of another kind loses the ranks gone's positions, a
    warning naming it and what that does to the epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from resilient_callbacks import ResumableDataLoader

    resumable = ResumableDataLoader(range(12), 2, num_replicas=2, rank=0, seed=0)
    next(iter(resumable))
    stateful = StatefulDataLoader(range(12), batch_size=2)
    next(iter(stateful))
    warns, infos = _said_of_data([resumable.state_dict()])
    assert warns == [] and len(infos) == 1, (warns, infos)
    assert "of rank 1 in 'data' is not loaded: the train dataloaders are ResumableData" in infos[0]
    assert "sharded over this run's ranks" in infos[0] and "rank 0's states" in infos[0]
    warns, infos = _said_of_data([resumable.state_dict(), stateful.state_dict()])
    assert infos == [] and len(warns) == 1, (warns, infos)
    assert "train dataloader(s) #1 is each rank's own" in warns[0], warns
    assert "samples may be trained twice or not at all" in warns[0], warns
    assert "new_ranks" not in warns[0], warns
