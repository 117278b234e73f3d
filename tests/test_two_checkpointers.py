"""Two Checkpointers in one process (a model's and an EMA's, each in its own directory): both
capture the process's RNG states, and a restore of each sets them. When they resume at
different steps (a kill between their saves of one step), the second restore silently replaced
the first's random streams, and the run did not continue exactly: now a warning says so."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from resilient_callbacks import Checkpointer


def _save(path, steps) -> None:
    with Checkpointer(path, async_save=False) as ck:
        for s in steps:
            random.random()
            torch.rand(1)
            ck.save(s, {"w": torch.full((2,), float(s))})


def test_a_second_restore_of_the_rng_states_from_another_step_warns(tmp_path):
    _save(tmp_path / "model", [1, 2])
    _save(tmp_path / "ema", [1])  # killed before the EMA's save of step 2 committed
    model, ema = {"w": torch.zeros(2)}, {"w": torch.zeros(2)}
    with Checkpointer(tmp_path / "model") as a:
        assert a.restore(model) == 2
        with (
            Checkpointer(tmp_path / "ema", resume="auto") as b,
            pytest.warns(UserWarning, match="replace those restored from step 2") as got,
        ):
            assert b.restore(ema) == 1
        said = next(str(w.message) for w in got if "replace those" in str(w.message))
        assert str(tmp_path / "model") in said and "capture_rng=False" in said
        # without RNG states, or from the same step (the same states): nothing to say
        _save(tmp_path / "ema2", [1, 2])
        for d, kw in (("ema", {"capture_rng": False}), ("ema2", {})):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with Checkpointer(tmp_path / d, **kw) as b:
                    b.restore(ema)


def test_restores_in_a_sweep_of_closed_checkpointers_do_not_warn(tmp_path):
    _save(tmp_path / "t0", [1, 2])
    _save(tmp_path / "t1", [1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for d, step in (("t0", 2), ("t1", 1)):
            with Checkpointer(tmp_path / d) as ck:
                assert ck.restore({"w": torch.zeros(2)}) == step
