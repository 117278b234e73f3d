"""A close() with a preemption pending that no step() acted on (it came after the last step,
or during the close): every wait of the close ends with the grace period, less the margin to
exit (docs/policy.md, "Preemption"), so the process exits with 75 before the scheduler's kill."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
import torch

from resilient_callbacks import Checkpointer


class Hanging:
    """A metrics sink whose endpoint accepted the connection and never answers."""

    name = "hanging"
    per_rank = False
    close_timeout_s = 600.0  # as the MLflow sink's when it logs a checkpoint

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def start(self, telemetry) -> None:  # type: ignore[no-untyped-def]
        pass

    def emit(self, flat, samples, events, step) -> None:  # type: ignore[no-untyped-def]
        if step >= 2:
            self.release.wait()

    def close(self) -> None:
        self.release.wait()


@pytest.mark.parametrize("when", ["before close", "during close"])
def test_a_close_with_an_unanswered_signal_ends_within_the_grace_period(tmp_path, caplog, when):
    """Step 1 committed; step 2's background save held (a slow disk) and a metrics sink that
    never answers; SIGTERM after the last step (or while close() waits for the save). The
    close bounded only the upload waits by the grace period: it waited for the save and the
    sink's 600 s as at a normal end, and the scheduler's SIGKILL came before the exit code 75
    (no requeue). Now both are abandoned once the grace period, less the exit margin, is
    spent (grace_period=2: at once), said in a warning; step 1 stays the newest committed."""
    release = threading.Event()
    timer = threading.Timer(120.0, release.set)  # the old src waits for it (no hang forever)
    timer.start()
    state = {"m": torch.nn.Linear(2, 2)}
    ck = Checkpointer(tmp_path / "ck", grace_period=2, telemetry=Hanging(release))
    real_commit, writing = ck._dir.commit.commit, threading.Event()

    def held(staging, step, manifest, **kw):  # type: ignore[no-untyped-def]
        if step == 2:
            writing.set()
            if when == "during close":
                os.kill(os.getpid(), signal.SIGTERM)
            release.wait()
        return real_commit(staging, step, manifest, **kw)

    ck._dir.commit.commit = held
    try:
        ck.save(1, state)
        ck.flush()
        ck.save(2, state)  # (written in the background)
        assert writing.wait(120)
        if when == "before close":
            os.kill(os.getpid(), signal.SIGTERM)  # after the last step: no step() acts on it
        with (
            caplog.at_level(logging.WARNING, "resilient_callbacks"),
            pytest.raises(SystemExit) as e,
        ):
            ck.close()
        assert not release.is_set(), "close() waited for the save and the sink (120 s guard)"
        assert e.value.code == 75
        said = [r.getMessage() for r in caplog.records]
        abandoned = [m for m in said if "still being written" in m]
        assert len(abandoned) == 1 and "grace period" in abandoned[0], said
        assert str(tmp_path / "ck" / "step_000000001") in abandoned[0], abandoned
        late = [m for m in said if "did not finish sending" in m]
        assert len(late) == 1 and "hanging" in late[0] and "600 s" not in late[0], said
    finally:
        timer.cancel()
        release.set()
    assert (tmp_path / "ck" / "step_000000001" / "manifest.json").exists()
