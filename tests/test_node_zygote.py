"""The ranks a test forks from a pre-started zygote (tests/node_zygote.py, spawn_ranks.Zygote)
end as the fresh interpreters they stand for, and none outlives an interrupted test session."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

import spawn_ranks

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(spawn_ranks.FRESH, reason="RC_TEST_FRESH_RANKS=1: no zygote"),
]

PROGRAM = """
import atexit, sys, threading, time

def at_exit():
    print("atexit, last_value=%r" % (getattr(sys, "last_value", None),), flush=True)

atexit.register(at_exit)
threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
if sys.argv[1] == "raise":
    raise RuntimeError("boom")
sys.exit("a message for the user")
"""


@pytest.mark.parametrize("how", ["raise", "message"])
def test_a_forked_program_ends_as_a_fresh_interpreter_does(tmp_path: Path, how: str) -> None:
    """A forked rank ran the atexit functions (the library's records a failed run by the
    uncaught exception in sys.last_value) before printing the exception, without
    sys.last_value, and never printed sys.exit's text: a forked run recorded as a clean end
    what a user's run records as a failure."""
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    outputs = []
    for zygote in (None, spawn_ranks.shared_zygote()):
        work = tmp_path / ("forked" if zygote else "fresh")
        work.mkdir()
        ranks = spawn_ranks.run(
            [sys.executable, str(script), how], 1, work, "p", expect=1, zygote=zygote
        )
        outputs.append(ranks.outputs[0])
    fresh, forked = outputs
    assert forked == fresh
    assert ("RuntimeError('boom')" if how == "raise" else "a message for the user") in fresh


def test_no_rank_outlives_an_interrupted_or_ended_test_process(tmp_path: Path) -> None:
    """A Ctrl-C reaches the test's process group, the zygote too: it ended at once, and the
    test then killing its ranks waited in vain for their exit status (60 s, then a TimeoutError
    that left the next ranks unkilled). A test process that died closed the zygote's stdin: the
    zygote ended and its ranks (in sessions of their own) ran on. Now the zygote ignores the
    Ctrl-C and its ranks die with it."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(300)\n")
    argv = [sys.executable, str(sleeper)]
    env = dict(os.environ, PYTHONHASHSEED="0")  # (the zygote's: else a fresh process)
    zygote = spawn_ranks.Zygote()
    pids = []
    try:
        rank = zygote.spawn(argv, env, tmp_path / "a.log")
        assert isinstance(rank, spawn_ranks.Forked)
        pids.append(rank.pid)
        os.kill(zygote.proc.pid, signal.SIGINT)  # as a Ctrl-C in the terminal
        rank.kill()
        assert rank.wait(timeout=60) == -signal.SIGKILL

        rank = zygote.spawn(argv, env, tmp_path / "b.log")
        pids.append(rank.pid)
        assert zygote.proc.stdin is not None
        zygote.proc.stdin.close()  # as the end of a test process that was killed
        assert zygote.proc.wait(timeout=60) == 0
        assert rank.wait(timeout=60) == -signal.SIGKILL
    finally:
        for pid in pids:  # (the old zygote's ranks)
            if spawn_ranks._running(pid):
                os.kill(pid, signal.SIGKILL)
        if zygote.proc.poll() is None:
            zygote.proc.kill()


def test_forked_ranks_draw_their_own_torch_seed_in_the_callers_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch seeds its global generator at random at start-up: every rank forked from a zygote
    had the zygote's one seed (every rank, every run of a session), where fresh processes draw
    their own; a test of a script that forgot torch.manual_seed could pass forked and fail as
    a user runs it. They ran in the zygote's working directory, not the caller's, and kept the
    temporary folder cached by the zygote's imports whatever TMPDIR the rank was given."""
    script = tmp_path / "seed.py"
    script.write_text(
        "import os, tempfile, torch\n"
        "print(torch.initial_seed(), os.getcwd(), tempfile.gettempdir())\n"
    )
    monkeypatch.chdir(tmp_path)
    env = {"TMPDIR": str(tmp_path)}
    zygote = spawn_ranks.shared_zygote()
    ranks = spawn_ranks.run([sys.executable, str(script)], 2, tmp_path, "s", env=env, zygote=zygote)
    seeds, cwds, tmps = zip(*(o.split() for o in ranks.outputs), strict=True)
    assert seeds[0] != seeds[1]
    assert cwds == tmps == (str(tmp_path), str(tmp_path))


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_a_rank_whose_log_folder_was_removed_does_not_end_the_zygote(tmp_path: Path) -> None:
    """The zygote writes each rank's exit status beside its log from its SIGCHLD handler: a
    rank whose folder a test had removed meanwhile raised FileNotFoundError there, the zygote
    died, and every later test forking from the session's zygote failed ('the zygote ended')."""
    gone = tmp_path / "gone"
    gone.mkdir()
    script = tmp_path / "quick.py"
    script.write_text("import time\ntime.sleep(0.5)\n")
    argv = [sys.executable, str(script)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    zygote = spawn_ranks.Zygote()
    try:
        rank = zygote.spawn(argv, env, gone / "a.log")
        assert isinstance(rank, spawn_ranks.Forked)
        while not (gone / "a.log").exists():  # (the child opens it)
            time.sleep(0.01)
        shutil.rmtree(gone)
        for _ in range(200):  # (it ends after 0.5 s)
            if not spawn_ranks._running(rank.pid):
                break
            time.sleep(0.05)
        time.sleep(0.5)  # (the zygote's SIGCHLD handler has run)
        assert zygote.spawn(argv, env, tmp_path / "b.log").wait(timeout=60) == 0
    finally:
        zygote.close()
