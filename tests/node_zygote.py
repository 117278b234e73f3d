"""A pre-started "node" for the multi-process tests (a helper, not a test module).

Starting Python and importing torch and s3fs takes seconds of CPU per process; the multi-node
tests start two processes per run, many runs per test. This process pays the imports once and
then, for every JSON line ``{"env": {...}, "argv": [...], "log": path, "cwd": dir}`` read from
stdin, forks a fresh process that runs ``train_script.main(argv)`` with exactly that environment
and working directory, its stdout and stderr going to ``log`` (stderr to ``"err"``, a path, where
the line has one; stdin from ``"stdin"``, a FIFO, where it has one), in a session of its own. With
``"script": path`` the child runs that script as ``__main__`` instead, ``argv`` its arguments
(``spawn_ranks.Zygote``); the modules named on this process's command line are imported ahead
too. It answers each line with the child's pid. The child's exit status is written to
``<log>.rc`` once it ended, ``-N`` when signal N killed it, before the child is reaped.

The child ends as the interpreter would (the uncaught exception printed, threads joined,
``atexit`` functions run), and is killed when the zygote ends (stdin closed: the test is over or
its process died); a Ctrl-C does not end the zygote, only the test process, which then kills its
ranks. Nothing of the library is set up before the fork (no process group, no thread, no file
handle): each child is a fresh training process (Python's, NumPy's and torch's global random
generators seeded anew, as a fresh interpreter seeds them, not one state shared by every rank),
only its imports are shared, and with them the warning filters they add (urllib3's, sympy's).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import random
import runpy
import select
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator

import s3fs  # noqa: F401
import torch
import torch._dynamo

# the modules the library imports lazily, so that no child imports them again
import resilient_callbacks.node_restore
import resilient_callbacks.node_session
import resilient_callbacks.peers
import resilient_callbacks.remote
import resilient_callbacks.remote_commit  # noqa: F401
import train_script


def _child(req: dict) -> None:
    """Run one request in the forked child and exit; the zygote writes its exit status."""
    rc = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, _SIGINT)  # (the zygote ignores it)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        os.setsid()
        _die_with_the_zygote()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        if req.get("err"):  # stderr to a file of its own
            fd = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            os.close(fd)
        if req.get("stdin"):  # a FIFO the client writes (not the zygote's own stdin)
            fd = os.open(req["stdin"], os.O_RDONLY)
            os.dup2(fd, 0)
            os.close(fd)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115  (not the zygote's buffer)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req.get("cwd", os.getcwd()))  # the caller's, as a subprocess it starts
        tempfile.tempdir = None  # (cached by the imports: TMPDIR is read again)
        # seeded anew as a fresh interpreter seeds them, not the zygote's one state (which
        # every rank of every run would share)
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.default_generator.seed()  # (torch seeds it at random at start-up)
        rc = _as_an_interpreter(req)
    except BaseException:  # (the set-up failed)
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _as_an_interpreter(req: dict) -> int:
    """Run the request's program and end as ``python script.py`` ends: an uncaught exception
    printed by ``sys.excepthook`` with ``sys.last_value`` set (the library's exit hook records
    a failed run by it), ``sys.exit("text")``'s text printed, then the non-daemon threads
    joined and the ``atexit`` functions run, in that order. The exit status."""
    interrupted = False
    try:
        if "script" in req:
            sys.argv = [req["script"], *req["argv"]]
            sys.path[0] = os.path.dirname(os.path.realpath(req["script"]))  # (its folder)
            runpy.run_path(req["script"], run_name="__main__")
        else:  # as train_script.py's ``sys.exit(main())``
            sys.argv = ["train_script.py", *req["argv"]]
            sys.exit(train_script.main(req["argv"]))
        rc = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException as e:
        tb = e.__traceback__  # without this file's and runpy's frames
        while tb is not None and tb.tb_frame.f_code.co_filename in _OURS:
            tb = tb.tb_next
        e = e.with_traceback(tb)
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
        sys.last_exc = e  # (Python >= 3.12 reads this one)
        sys.excepthook(type(e), e, tb)
        interrupted, rc = isinstance(e, KeyboardInterrupt), 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if interrupted:  # as the interpreter: killed by SIGINT
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return rc


def _die_with_the_zygote() -> None:
    """SIGKILL this child when the zygote ends (Linux's PR_SET_PDEATHSIG): a test process that
    was killed or interrupted closes the zygote's stdin, and the zygote's end takes the ranks it
    forked with it, instead of leaving them running in sessions of their own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != _ZYGOTE_PID:  # (the zygote ended before that)
        os._exit(1)


_LOGS: dict[int, str] = {}  # each running child's log path
_ZYGOTE_PID = os.getpid()
# what a fresh interpreter started by the test process has: Python's handler, or SIG_IGN where
# the test process ignores SIGINT (as a shell's background job does)
_SIGINT = signal.getsignal(signal.SIGINT)
_OURS = (__file__, runpy.__file__, "<frozen runpy>")  # the frames a fresh interpreter lacks


def _reap(signum: int, frame: object) -> None:
    """SIGCHLD: write each ended child's exit status to ``<log>.rc`` (atomically, a signal's as
    ``-N``), then reap it: a client that sees the child gone finds its status written."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # no nested call meanwhile
    try:
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            log = _LOGS.pop(info.si_pid, None)
            if log is not None:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                # (a log's folder removed meanwhile: no one waits for it; the zygote goes on)
                with contextlib.suppress(OSError):
                    with open(f"{log}.rc.tmp", "w") as f:
                        f.write(str(code))
                    os.replace(f"{log}.rc.tmp", f"{log}.rc")
            with contextlib.suppress(ChildProcessError):
                os.waitpid(info.si_pid, 0)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def _requests() -> Iterator[str]:
    """The lines read from stdin until it closes, reaping ended children while none comes.

    Not ``for line in sys.stdin``: a child that ends while :func:`_reap` runs (SIGCHLD blocked)
    has its signal delivered as the handler unblocks it, after CPython's dispatch has passed
    SIGCHLD; the flag stays set, but the blocking read that follows is not interrupted again,
    so the handler ran only at the next child's end and the status was written minutes late (a
    test's 60 s wait for it failed; 1 run in the full suite, 2026-12-07). Waiting in ``select``
    with a timeout and reaping on each timeout bounds that delay to a second."""
    fd, buf = sys.stdin.fileno(), b""
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            _reap(signal.SIGCHLD, None)
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            if buf:
                yield buf.decode()
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


def main() -> None:
    for name in sys.argv[1:]:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # fork keeps only this thread: another one's locks could stay taken
        print(f"node_zygote: {threads} threads after the imports (set OMP_NUM_THREADS=1)")
        sys.exit(2)
    signal.signal(signal.SIGCHLD, _reap)
    # a Ctrl-C reaches the test's whole process group: the zygote stays to write the exit
    # status of the ranks the test then kills (it ends when its stdin closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("ready", flush=True)
    for line in _requests():
        if not line.strip():
            continue
        req = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # until _LOGS knows it
        pid = os.fork()
        if pid == 0:
            _child(req)
        _LOGS[pid] = req["log"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(pid, flush=True)
    # stdin closed: the test is done, or its process ended; the ranks still running die with
    # this process (PR_SET_PDEATHSIG). Exit at once (skip the interpreter's slow teardown)
    os._exit(0)


if __name__ == "__main__":
    main()
