"""A roll-back (``restore()`` again in the same process, a ``restore`` record: no new life)
takes the work done past the checkpoint out of the useful time, as a restart after a failure
does: the report's useful time and goodput are the ones the Checkpointer itself had at its end,
not the largest it ever recorded before the roll-back."""

from __future__ import annotations

import json
from pathlib import Path

from resilient_callbacks import Checkpointer, report
from test_monitoring import _state, _train


def test_the_work_a_roll_back_dropped_is_not_counted_as_useful(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RESILIENT_PROGRESS_EVERY_S", "0")  # a heartbeat at every step
    state = _state()
    d = tmp_path / "ck"
    clock = [1000.0]  # the step clock: a second of compute per step, whatever the load

    def tick(_step: int) -> None:
        clock[0] += 1.0

    with Checkpointer(d, every_n_steps=10, async_save=False) as ck:
        ck._trigger.now = lambda: clock[0]
        ck.restore(state)
        _train(ck, range(1, 19), state, tick)  # 8 steps past the checkpoint of step 10
        assert ck.restore(state) == 10  # the roll-back: those 8 steps are gone
        _train(ck, range(11, 12), state, tick)
    recs = [json.loads(line) for line in (d / "history.jsonl").read_text().splitlines()]
    assert [r["event"] for r in recs].count("restore") == 1
    end = [r for r in recs if r["event"] == "end"][-1]
    before = max(r["useful_s"] for r in recs if r["event"] == "progress" and r["step"] == 18)
    assert end["useful_s"] < before  # (what the old src reported: the largest)
    s = report.analyse(str(d))["summary"]
    assert s["useful_s"] == end["useful_s"]
    assert s["goodput"] == min(1.0, end["useful_s"] / s["wall_s"])
    saves = report.analyse(str(d))["saves"]
    assert [x["step"] for x in saves] == [10]
