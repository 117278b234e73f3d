"""DeepSpeed's own checkpoint tests, with our checkpoint in place of DeepSpeed's.

``tests/upstream/deepspeed`` holds DeepSpeed's ``tests/unit`` checkpoint tests (see its
ORIGIN.md). ``ds_upstream_worker.py`` runs one upstream test method's body per rank, with
``DeepSpeedEngine.save_checkpoint``/``load_checkpoint`` replaced by ``rcds.attach`` +
``save``/restore: upstream's ``checkpoint_correctness_verification`` trains, saves, builds a
fresh engine, loads, and compares module weights, the fp32 master partitions, the optimizer
state (``torch.equal`` on every moment), the scheduler's state dict and the engine's counters.
The worker also checks that no DeepSpeed file (``*.pt``) was written and that the restore
unpickled nothing. The control runs the same test with the restore skipped: upstream's
comparisons must then fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import spawn_ranks

pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("ds_upstream_worker.py")


def run_upstream(
    case: str, stage: int, world: int, tmp_path: Path, *, expect: int | None = 0, env=None
):
    ranks = spawn_ranks.run(
        [sys.executable, str(WORKER), case, str(stage), str(tmp_path / "upstream")],
        world,
        tmp_path,
        f"{case}{stage}",
        expect=expect,
        env={"DS_ACCELERATOR": "cpu", **(env or {})},
        deadline=240.0,
        tail=6000,
        zygote=spawn_ranks.shared_zygote("deepspeed", DS_ACCELERATOR="cpu"),
    )
    return ranks


def test_upstream_zero2_checkpoint_correctness_with_our_checkpoint(tmp_path: Path) -> None:
    out = run_upstream("load_optimizer_state", 2, 1, tmp_path).outputs[0]
    assert "UPSTREAM-OK load_optimizer_state 2" in out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_upstream_load_optimizer_state_one_rank(tmp_path: Path, stage: int) -> None:
    out = run_upstream("load_optimizer_state", stage, 1, tmp_path).outputs[0]
    assert f"UPSTREAM-OK load_optimizer_state {stage}" in out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ["load_optimizer_state", "not_load_optimizer_state"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_upstream_zero_checkpoint_two_ranks(tmp_path: Path, case: str, stage: int) -> None:
    if case == "not_load_optimizer_state" and stage == 0:
        pytest.skip("upstream does not parametrize this case with stage 0")
    for out in run_upstream(case, stage, 2, tmp_path).outputs:
        assert f"UPSTREAM-OK {case} {stage}" in out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ["lr_scheduler", "no_lr_scheduler"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_upstream_lr_scheduler_two_ranks(tmp_path: Path, case: str, stage: int) -> None:
    for out in run_upstream(case, stage, 2, tmp_path).outputs:
        assert f"UPSTREAM-OK {case} {stage}" in out


@pytest.mark.slow
def test_upstream_comparisons_fail_without_our_restore(tmp_path: Path) -> None:
    ranks = run_upstream(
        "load_optimizer_state", 2, 1, tmp_path, expect=None, env={"DS_UPSTREAM_NO_RESTORE": "1"}
    )
    assert ranks.codes[0] != 0
    assert "AssertionError" in ranks.outputs[0], ranks.outputs[0][-3000:]
