"""The LR scheduler settings warning of a resume on 2 ranks (gloo, one process each): every
rank loads the same settings, so it is said once, by rank 0, as the other restore notices;
it was printed by every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import spawn_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("sched_settings_worker.py")
SAID = "UserWarning: restore: the checkpoint's LR scheduler settings replace"


def _ranks(tmp_path: Path, name: str, t_max: int, *more: str) -> list[str]:
    argv = [sys.executable, str(WORKER), str(tmp_path / "ck"), str(t_max), *more]
    zygote = spawn_ranks.shared_zygote()
    return spawn_ranks.run(argv, 2, tmp_path, name, zygote=zygote).outputs


@pytest.mark.parametrize(
    "how",
    ["checkpointer", pytest.param("lightning", marks=pytest.mark.slow)],  # (Lightning: ~4 s)
)
def test_a_changed_setting_is_said_once_on_rank_0(tmp_path: Path, how: str) -> None:
    more = ("--lightning",) if how == "lightning" else ()
    if more:
        pytest.importorskip("lightning.pytorch")
    said = SAID.replace("restore", "ResilientCheckpoint") if more else SAID
    first = _ranks(tmp_path, "first", 10, *more)
    assert all("restored 0 T_max=10" in out for out in first), first
    then = _ranks(tmp_path, "then", 100, *more)
    assert all("restored 3 T_max=10" in out for out in then), then  # (as torch loads it)
    assert then[0].count(said) == 1, then[0]
    assert "T_max=10 from the checkpoint (100 here)" in then[0]
    assert "LR scheduler settings" not in then[1], then[1]
