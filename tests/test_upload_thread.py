"""The upload threads' retry delay: doubling up to the cap, jitter within 50-100 %, and never a
draw from the global random generator (the training loop's, which checkpoints restore)."""

from __future__ import annotations

import random

from resilient_callbacks.upload_thread import backoff_s


def test_the_delay_doubles_up_to_the_cap() -> None:
    got = [backoff_s(n, 1.0, 10.0, jitter=False) for n in range(1, 7)]
    assert got == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff_s(3, 0.5, jitter=False) == 2.0  # no cap


def test_jitter_stays_between_half_and_all_of_the_delay() -> None:
    for n in range(1, 8):
        full = backoff_s(n, 0.25, 4.0, jitter=False)
        for _ in range(20):
            assert 0.5 * full <= backoff_s(n, 0.25, 4.0) <= full


def test_the_global_generator_is_left_alone() -> None:
    random.seed(1234)
    before = random.getstate()
    for n in range(1, 20):
        backoff_s(n, 1.0, 60.0)
    assert random.getstate() == before
