"""Waits of background saves for the previous one: counted on every rank, warned about only when
they matter, on the coordinator, rate-limited, and summed up on close."""

from __future__ import annotations

import logging

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.waits import SaveWaits


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_waits_that_do_not_matter_are_counted_but_not_warned(caplog):
    caplog.set_level(logging.DEBUG, "resilient_callbacks")
    w = SaveWaits(speak=True)
    for step in range(10, 1010, 10):
        # 5 ms of a 2 s interval: below both thresholds
        w.observe(step, 0.005, 2.0)
    # 30 ms of a 10 s interval: long enough, but a small share
    w.observe(2000, 0.03, 10.0)
    assert _warnings(caplog) == []
    assert (w.saves, w.waits, w.mattered) == (101, 101, 0)
    assert w.total_seconds == pytest.approx(0.53)
    w.log_summary()
    (summary,) = [r for r in caplog.records if "background saves waited" in r.getMessage()]
    assert summary.levelno == logging.INFO
    assert "101 of 101" in summary.getMessage()


def test_saves_due_fractions_of_a_second_apart_say_the_interval(caplog):
    """Every step a save, a few tens of ms apart: the warning read '57% of the 0.0 s since
    the previous save' (found by a kill-fuzzing probe)."""
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    SaveWaits(speak=True).observe(56, 0.03, 0.053)
    (got,) = _warnings(caplog)
    assert "57% of the 0.05 s since the previous save" in got, got


def test_a_wait_that_matters_warns_once_then_is_rate_limited(caplog):
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    w = SaveWaits(speak=True, warn_every=600.0)
    w.observe(5, 0.0, 1.0)  # no wait
    w.observe(10, 0.5, 1.5)  # a third of the interval
    w.observe(15, 0.6, 1.6)
    w.observe(20, 0.7, 1.7)
    got = _warnings(caplog)
    assert len(got) == 1
    assert "step 10 waited 0.50 s" in got[0] and "33%" in got[0]
    assert "of the 1.50 s since the previous save" in got[0], got[0]
    assert (w.saves, w.waits, w.mattered) == (4, 3, 3)
    w.log_summary()
    summary = _warnings(caplog)[-1]
    assert "3 of 4 background saves waited" in summary
    assert "longest 0.70 s" in summary and "3 of them long enough to matter" in summary


def test_rate_limit_reports_how_many_were_held_back(caplog):
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    w = SaveWaits(speak=True, warn_every=0.0)  # every wait that matters may warn
    w.observe(10, 0.5, 1.0)
    w.warn_every = 600.0
    w.observe(20, 0.5, 1.0)
    w.observe(30, 0.5, 1.0)
    w.warn_every = 0.0
    w.observe(40, 0.5, 1.0)
    got = _warnings(caplog)
    assert len(got) == 2
    assert "2 more such wait(s) since the last warning" in got[1]


def test_other_ranks_count_silently(caplog):
    caplog.set_level(logging.DEBUG, "resilient_callbacks")
    w = SaveWaits(speak=False)
    w.observe(10, 0.5, 1.0)
    w.log_summary()
    assert _warnings(caplog) == []
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert (w.waits, w.mattered) == (1, 1)


def test_no_wait_no_summary():
    w = SaveWaits()
    w.observe(1, 0.0, 1.0)
    assert w.summary() is None


def test_checkpointer_counts_every_background_save(tmp_path):
    model = torch.nn.Linear(4, 4)
    state = {"model": model}
    with Checkpointer(tmp_path / "ck", every_n_steps=1, keep_last=2) as ck:
        for step in range(1, 6):
            ck.step(step, state)
        assert ck.save_waits.saves == 5
        assert ck.waits_for_previous == ck.save_waits.waits
