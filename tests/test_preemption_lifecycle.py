"""Signals at the edges of a Checkpointer's life: while it is constructed or restores, and a
close() that fails while a signal is pending, a second signal as the process exits, and
requests whose deadlines differ (docs/policy.md, "Preemption"). Most run a child process that
signals itself at a chosen point (a profile hook on a function's call: a real signal at a
known point, no timing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spawn_ranks

SRC = str(Path(__file__).resolve().parents[1] / "src")

# SIGTERM at the call of the function named by argv[2], once: inside Checkpointer() (while it
# opens its directory) or inside restore()
_SIGNAL_AT = """
import os, signal, sys, torch
from resilient_callbacks import Checkpointer

def signal_at(frame, event, arg):
    if event == "call" and frame.f_code.co_name == sys.argv[2]:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGTERM)

state = {"t": torch.zeros(2)}
sys.setprofile(signal_at)
ck = Checkpointer(sys.argv[1], every_n_steps=100)
start = ck.restore(state)
sys.setprofile(None)
print("restored", start, flush=True)
try:
    for s in range(start + 1, start + 50):
        state["t"].fill_(s)
        ck.step(s, state)
finally:
    ck.close()
print("finished", flush=True)
"""


def _run(
    tmp_path: Path, code: str, *args: str, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """``code`` run as a script with ``args``: forked from the session's zygote (torch imported
    once: ``spawn_ranks.run_python``), a process of its own that ends as the interpreter
    would; ``fresh``: a fresh interpreter, for a claim about what the interpreter's own exit
    does (the zygote's child runs the ``atexit`` functions itself, then ``os._exit``)."""
    script = tmp_path / "child.py"
    script.write_text(code)
    argv = [sys.executable, str(script), *args]
    if not fresh:
        return spawn_ranks.run_python(argv, timeout=180)
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.parametrize("where", ["open_directory", "restore"])
def test_a_signal_while_the_checkpointer_is_built_or_restores_is_acted_on(tmp_path, where):
    """SIGTERM while Checkpointer() opened its directory (its lock, sweeps, a remote: seconds
    on a large or remote directory) killed the process by the signal (-15: a crash to the
    scheduler, no requeue): the handlers were installed after. Now it is recorded like one
    during restore(), and the first step() makes the emergency save and exits 75."""
    r = _run(tmp_path, _SIGNAL_AT, str(tmp_path / "ck"), where)
    assert r.returncode == 75, (r.returncode, r.stderr[-2000:])
    assert "restored 0" in r.stdout and "finished" not in r.stdout
    assert "preemption (SIGTERM): saving step 1" in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "ck" / "step_000000001" / "manifest.json").exists()


def test_a_checkpointer_that_fails_to_open_gives_the_handlers_back(tmp_path):
    """A Checkpointer() that raises (its dirpath is a file) leaves no handler of its own
    installed: SIGTERM has its previous action again."""
    from resilient_callbacks import Checkpointer

    before = signal.getsignal(signal.SIGTERM)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(Exception):  # noqa: B017 (whatever error says the dirpath is wrong)
        Checkpointer(tmp_path / "file" / "ck")
    assert signal.getsignal(signal.SIGTERM) is before


# step 4's background save fails (a full disk), then SIGTERM after the last step(); the
# Checkpointer is closed in a finally, at a with block's end, or at the interpreter's exit
_FAILED_SAVE_THEN_SIGNAL = """
import errno, os, signal, sys, torch
from resilient_callbacks import Checkpointer, layout

def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")

def train(ck):
    for s in range(1, 5):
        state["t"].fill_(s)
        if s == 4:
            ck.flush()  # step 2 committed before the disk "fills"
            layout.write_part = full
        ck.step(s, state)
    signal.raise_signal(signal.SIGTERM)

state = {"t": torch.zeros(2)}
end = sys.argv[2]
if end == "with":
    with Checkpointer(sys.argv[1], every_n_steps=2) as ck:
        train(ck)
else:
    ck = Checkpointer(sys.argv[1], every_n_steps=2)
    if end == "finally":
        try:
            train(ck)
        finally:
            ck.close()
    else:
        train(ck)
print("survived", flush=True)
"""


@pytest.mark.parametrize("end", ["finally", "with", "at exit"])
def test_a_failed_background_save_is_not_hidden_by_a_signal_after_the_last_step(tmp_path, end):
    """A background save failed, then SIGTERM came after the last step(): close() in a
    ``finally`` (or a with block's end) raised SystemExit(75) from its release in place of the
    save's error, so the job was requeued as if all were well and no caller could see the
    error. The error now ends the process (exit 1, traceback shown) and a warning names the
    signal. At the interpreter's exit, where nothing can raise it, the error is logged and the
    process exits 75 (the newest committed checkpoint is intact)."""
    r = _run(tmp_path, _FAILED_SAVE_THEN_SIGNAL, str(tmp_path / "ck"), end, fresh=end == "at exit")
    assert ("survived" in r.stdout) == (end == "at exit")  # (the script ran to its end)
    said = r.stderr
    if end == "at exit":
        assert r.returncode == 75, (r.returncode, said[-3000:])
        assert "at exit failed" in said and "No space left" in said, said[-3000:]
    else:
        assert r.returncode == 1, (r.returncode, said[-3000:])
        assert "CheckpointWriteError: checkpoint for step 4 was not committed" in said, said[-3000:]
        assert "SIGTERM arrived after the last step()" in said, said[-3000:]
        assert "close() raises CheckpointWriteError" in said and "exiting with code" not in said
    assert sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("step_")) == [
        "step_000000002"
    ]


# a second SIGTERM at the lock's release, the last thing close() does before the process
# raises its SystemExit(75): after the emergency save (step 3), or at a close() for a signal
# no step() acted on
_SECOND_SIGNAL_AT_THE_LAST_MOMENT = """
import os, signal, sys, torch
from resilient_callbacks import Checkpointer

def at_release(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "release" and "lock" in frame.f_code.co_filename:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGTERM)

state = {"t": torch.zeros(2)}
ck = Checkpointer(sys.argv[1], every_n_steps=100, async_save=False)
ck.restore(state)
for s in range(1, 4):
    state["t"].fill_(s)
    if s == 3 and sys.argv[2] == "emergency save":
        os.kill(os.getpid(), signal.SIGTERM)
        sys.setprofile(at_release)
    ck.step(s, state, final=s == 3)
os.kill(os.getpid(), signal.SIGTERM)  # after the last step(): close() exits 75 for it
sys.setprofile(at_release)
ck.close()
print("survived", flush=True)
"""


@pytest.mark.parametrize("after", ["emergency save", "unanswered signal"])
def test_a_second_signal_as_close_ends_keeps_the_exit_code(tmp_path, after):
    """Once the process saved (or closed) for a preemption and exits with 75, a second signal
    keeps that code (torchrun passing on a group's signal, ranks signalled apart). Between the
    watcher's uninstall and the SystemExit (the lock's release: an unlink, slow on a network
    filesystem) one killed the process by the signal (-15, a crash to the scheduler): no
    SystemExit was being handled yet, so the handler took the process for one that caught
    it and went on."""
    r = _run(tmp_path, _SECOND_SIGNAL_AT_THE_LAST_MOMENT, str(tmp_path / "ck"), after)
    assert r.returncode == 75, (r.returncode, r.stderr[-2000:])
    assert "survived" not in r.stdout
    assert (tmp_path / "ck" / "step_000000003" / "manifest.json").exists()


def test_a_later_request_with_a_sooner_kill_bounds_the_grace_period():
    """A spot notice (120 s to the kill) then a node drain's SIGTERM (30 s here): the process
    has 30 s left, not the first request's 120 s. The grace period close() keeps to (its
    waits for a background save, the uploads, the sinks), the emergency save's warning and
    the DCP writer's close were all taken from the first request: they outlasted the kill
    (exit 137, not 75)."""
    from resilient_callbacks.preemption import PreemptionWatcher, pending

    w = PreemptionWatcher(grace_period_s={"SIGTERM": 30})
    with w:
        w.trigger("metadata:aws")  # the default grace period of an AWS notice: 120 s
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while w.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # (the handler runs in this thread, at its next bytecode)
        assert w.count == 2 and w.request is not None
        assert w.request.source == "metadata:aws"  # the first request stays the request
        left = w.remaining_grace_s()
        assert left is not None and left <= 30.0, left
        shared = pending.remaining_grace_s(w)
        assert shared is not None and shared <= 30.0, shared
        said = w.check_grace(60.0)
        assert said is not None and "preemption (SIGTERM)" in said, said


@pytest.mark.parametrize("notices", [{"kind": "aws", "interval_s": -1}, {"kind": "nope"}])
def test_a_checkpointer_with_a_bad_notice_option_gives_the_handlers_back(tmp_path, notices):
    """metadata_notices with a bad value raised ConfigError after the signal handlers were
    installed, and left them: SIGTERM was then recorded by a watcher no step() reads, and the
    process no longer stopped on it at all. Its previous action is back now."""
    from resilient_callbacks import Checkpointer
    from resilient_callbacks.errors import ConfigError

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ConfigError):
        Checkpointer(tmp_path / "ck", metadata_notices=notices)
    assert signal.getsignal(signal.SIGTERM) is before


# SIGTERM at step 2: the emergency save commits, then close() raises (the lock's release fails:
# a stale handle on a network filesystem); the caller catches the error and goes on (a notebook)
# and a later signal comes (argv[2]), or a new Checkpointer trains on and is signalled
_CLOSE_FAILS_AFTER_THE_EMERGENCY_SAVE = """
import errno, os, signal, sys, torch
from resilient_callbacks import Checkpointer

def stale():
    raise OSError(errno.ESTALE, "Stale file handle")

# a notebook's actions, not this process's inherited ones (a test run started in the
# background by a non-interactive shell ignores SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
state = {"t": torch.zeros(2)}
ck = Checkpointer(sys.argv[1], every_n_steps=100, async_save=False, handle_sigint=True)
release, ck._dir.lock.release = ck._dir.lock.release, stale
try:
    for s in range(1, 4):
        state["t"].fill_(s)
        if s == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        ck.step(s, state)
except OSError as e:
    print("caught:", e, flush=True)
release()
if sys.argv[2] == "SIGINT":
    try:
        os.kill(os.getpid(), signal.SIGINT)
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
elif sys.argv[2] == "SIGTERM":
    os.kill(os.getpid(), signal.SIGTERM)
else:
    ck = Checkpointer(sys.argv[1] + "2", every_n_steps=100, async_save=False)
    for s in range(1, 4):
        state["t"].fill_(s)
        if s == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        ck.step(s, state)
print("survived", flush=True)
"""


@pytest.mark.parametrize("then", ["SIGINT", "SIGTERM", "new Checkpointer"])
def test_a_close_that_raises_after_the_emergency_save_leaves_the_process_fresh(tmp_path, then):
    """The emergency save committed, then close() raised (the lock's release failed): the
    process never raised its SystemExit(75), yet stayed marked as on its way out. A caller that
    caught the error and went on (a notebook) then had a later SIGINT end the process with 75
    (the kernel gone, not a KeyboardInterrupt) and a SIGTERM exit 75 (not its default action).
    Now such a process behaves as one that never saved for a preemption."""
    r = _run(tmp_path, _CLOSE_FAILS_AFTER_THE_EMERGENCY_SAVE, str(tmp_path / "ck"), then)
    said = r.stderr[-3000:]
    assert "caught: [Errno 116] Stale file handle" in r.stdout, (r.returncode, r.stdout, said)
    assert (tmp_path / "ck" / "step_000000002" / "manifest.json").exists()
    if then == "SIGINT":
        assert r.returncode == 0, (r.returncode, said)
        assert r.stdout.splitlines()[1:] == ["interrupted", "survived"], r.stdout
    elif then == "SIGTERM":
        assert r.returncode == -signal.SIGTERM, (r.returncode, said)
    else:  # the new Checkpointer's emergency save, and exit 75
        assert r.returncode == 75, (r.returncode, said)
        assert (tmp_path / "ck2" / "step_000000002" / "manifest.json").exists(), said
        assert "survived" not in r.stdout


# two Checkpointers (a model's and its EMA's); SIGTERM at step 2: a's emergency save commits,
# then a's close() raises (its lock's release fails); the caller catches it and closes b
_ONE_OF_TWO_CLOSES_FAIL = """
import errno, os, signal, sys, torch
from resilient_callbacks import Checkpointer

def stale():
    raise OSError(errno.ESTALE, "Stale file handle")

sa, sb = {"t": torch.zeros(2)}, {"u": torch.zeros(2)}
a = Checkpointer(os.path.join(sys.argv[1], "a"), every_n_steps=100, async_save=False)
b = Checkpointer(os.path.join(sys.argv[1], "b"), every_n_steps=100, async_save=False)
a._dir.lock.release = stale
try:
    for s in range(1, 4):
        sa["t"].fill_(s); sb["u"].fill_(s)
        if s == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        a.step(s, sa)
        b.step(s, sb)
except OSError as e:
    print("caught:", e, flush=True)
b.close()
print("survived", flush=True)
"""


def test_a_failed_close_after_the_emergency_save_leaves_the_other_checkpointers_unanswered(
    tmp_path,
):
    """The emergency save of a committed, then a's close() raised: the process does not exit
    with 75 (a's error goes to the caller), yet the other Checkpointer b stayed marked as
    answered by a's save. b's close then said 'another Checkpointer of this process saved and
    is exiting', passed the SIGTERM on to no one and returned: the process trained on or ended
    with 0, the preemption lost. Now b is as if a never answered: its close exits 75."""
    r = _run(tmp_path, _ONE_OF_TWO_CLOSES_FAIL, str(tmp_path))
    said = r.stderr[-3000:]
    assert "caught: [Errno 116] Stale file handle" in r.stdout, (r.returncode, r.stdout, said)
    assert (tmp_path / "a" / "step_000000002" / "manifest.json").exists()
    assert "another Checkpointer of this process saved" not in said, said
    assert r.returncode == 75, (r.returncode, r.stdout, said)
    assert "survived" not in r.stdout
    assert "after the last step() that could act on it" in said, said
