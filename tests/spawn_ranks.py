"""Run a command as N ranks, one OS process each, rendezvousing over gloo on 127.0.0.1: the one
launcher of the multi-process tests (``test_distributed.run_ranks``, ``dcp_helpers.spawn``,
``test_deepspeed.run_group`` are its callers' shorthands).

Each rank gets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/
``MASTER_PORT`` (a free port, reserved: :func:`free_port`), one OpenMP/MKL thread and
``PYTHONHASHSEED=0``, its output in ``workdir``, and a deadline: a hung collective cannot
outlive it. When the port was taken all the same ("address already in use"), the group is
started again on another port. ``zygote=``: each rank forked from a process that imported torch
once (:class:`Zygote`, tests/node_zygote.py) instead of a fresh interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

LINGER_S = 2.0  # after one rank killed itself: time for the others to reach the same step

#: ``RC_TEST_FRESH_RANKS=1``: every :class:`Zygote` starts fresh interpreters instead of
#: forking (and test_multinode runs torchrun), to compare a test's outcome with and without
#: the zygotes: it should be the same, only slower
FRESH = os.environ.get("RC_TEST_FRESH_RANKS") == "1"


_RESERVED: list[socket.socket] = []  # held for the life of this process


def free_port() -> int:
    """A port on 127.0.0.1 for a child's rendezvous server (``MASTER_PORT``), reserved: the
    socket that found it stays bound (SO_REUSEADDR, not listening) as long as this process
    lives. A server that sets SO_REUSEADDR, as torch's TCPStore does, binds and listens on it;
    no other process is given it meanwhile (a ``bind(0)`` or an outgoing connection), as it
    could be when the port was closed before the child bound it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _RESERVED.append(s)
    return int(s.getsockname()[1])


@dataclass
class Ranks:
    codes: list[int]  # each rank's exit status (-9: killed)
    outputs: list[str]  # each rank's stdout and stderr


def world_of_one() -> None:
    """The environment of rank 0 of a world of one (a free port on 127.0.0.1), where the
    caller has not set it: for frameworks that take a distributed setup from it."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())


def run(
    argv: list[str],
    nprocs: int,
    workdir: Path,
    name: str,
    *,
    expect: int | None = 0,
    env: dict[str, str] | None = None,
    deadline: float = 150.0,
    log_name: str = "{name}.attempt{attempt}.rank{rank}.log",
    tail: int | None = None,
    zygote: Zygote | None = None,
) -> Ranks:
    """Run ``argv`` as ``nprocs`` ranks (``env`` added to each one's environment).

    ``expect``: the exit status every rank must end with, else the test fails with every rank's
    output (the last ``tail`` characters of each). A rank that ends otherwise makes the others be
    killed at once. ``-9``: the ranks kill themselves; once one is gone the others get
    :data:`LINGER_S` to do so, then are killed, as a failed node takes its job down. ``None``:
    any status is accepted; a rank that fails makes the others be killed (as a launcher would)
    and ``codes`` holds the status each had when that happened. Missing the ``deadline``
    (seconds for the whole group) always fails. Logs: ``log_name`` in ``workdir``. ``zygote``:
    ``argv`` is ``[sys.executable, script, *args]``, each rank forked from it (see Zygote)."""
    ok_code = 0 if expect is None else expect
    for attempt in range(3):
        port = free_port()
        procs, logs = [], []
        failed = None
        try:  # (an interrupt while starting them kills those started)
            for rank in range(nprocs):
                e = dict(
                    os.environ,
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nprocs),
                    LOCAL_WORLD_SIZE=str(nprocs),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    GLOO_SOCKET_IFNAME="lo",
                    OMP_NUM_THREADS="1",
                    MKL_NUM_THREADS="1",
                    PYTHONHASHSEED="0",
                    **(env or {}),
                )
                path = workdir / log_name.format(name=name, attempt=attempt, rank=rank)
                log = open(path, "w+")  # noqa: SIM115
                logs.append(log)
                if zygote is not None:
                    procs.append(zygote.spawn(argv, e, path))
                else:
                    procs.append(
                        subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=e)
                    )
            failed = _watch(procs, ok_code, deadline)
        finally:
            codes = [p.poll() for p in procs]  # before the survivors are killed
            for p in procs:  # all of them, then wait: a wait that fails leaves none running
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
        if failed is None and expect is not None and any(p.returncode != expect for p in procs):
            failed = "a rank failed"
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        text = "\n".join(
            f"--- rank {r} (rc={p.returncode})\n{o[-tail:] if tail else o}"
            for r, (p, o) in enumerate(zip(procs, outputs, strict=True))
        )
        if failed is not None and "address already in use" in text.lower() and attempt < 2:
            continue  # the free port was taken in between: try another one
        if failed is not None and (expect is not None or "within" in failed):
            finals = [p.returncode for p in procs]
            raise AssertionError(
                f"{name}: {failed} (exit codes {finals}, expected {expect})\n{text}"
            )
        return Ranks(
            [c if c is not None else p.returncode for c, p in zip(codes, procs, strict=True)],
            outputs,
        )
    raise AssertionError("unreachable")


def _watch(procs: list, ok_code: int, deadline: float) -> str | None:
    """Wait for the ranks; say why the group failed, or None."""
    until = time.monotonic() + deadline
    linger_until = None
    while any(p.poll() is None for p in procs):
        ended = [p.returncode for p in procs if p.returncode is not None]
        if any(c != ok_code for c in ended):
            return "a rank failed"
        if ok_code == -9 and ended:  # the others reach the same step and kill themselves
            if linger_until is None:
                linger_until = time.monotonic() + LINGER_S
            elif time.monotonic() > linger_until:
                return None  # (the caller kills those still running)
        if time.monotonic() > until:
            return f"the ranks did not finish within {deadline:.0f} s"
        time.sleep(0.05)
    return None


class Zygote:
    """A pre-started tests/node_zygote.py that forks each rank of :func:`run`: a fresh process
    with exactly its environment and output file, running the script as ``__main__``, only its
    imports (torch, the library and the ``preload`` modules, paid once) shared. Several seconds
    of CPU saved per rank started. What Python reads at start-up is the zygote's
    (``PYTHONHASHSEED=0``, tests/ and src/ on ``sys.path``): :meth:`spawn` starts a program
    given another ``PYTHONHASHSEED`` (or none: a random one) as a fresh interpreter."""

    def __init__(self, *preload: str, env: dict[str, str] | None = None) -> None:
        self.proc: subprocess.Popen | None = None
        self.ready = False
        if FRESH:
            return
        tests = Path(__file__).resolve().parent
        path = os.pathsep.join(
            [str(tests.parent / "src"), str(tests), os.environ.get("PYTHONPATH", "")]
        )
        env = dict(
            os.environ,
            PYTHONPATH=path,
            PYTHONHASHSEED="0",
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            **(env or {}),
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(tests / "node_zygote.py"), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        err: Path | None = None,
        cwd: Path | None = None,
        stdin: Path | None = None,
    ) -> Forked | subprocess.Popen:
        """Start ``argv`` (``python script.py ...``) in ``cwd`` (else this process's), its
        stdout and stderr to ``log`` (stderr to ``err``, if given), its stdin from the FIFO
        ``stdin`` if given (forked only: :class:`Piped`)."""
        assert argv[0] == sys.executable and argv[1].endswith(".py"), argv
        # (PYTHONHASHSEED is read at start-up: another one than the zygote's, a fresh process;
        # in a session of its own, as a forked one)
        if self.proc is None or env.get("PYTHONHASHSEED") != "0":  # (or FRESH)
            with open(log, "w") as out, open(err or os.devnull, "w") as errs:
                return subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=errs if err else subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        assert self.proc.poll() is None, f"the zygote ended (rc={self.proc.returncode})"
        if not self.ready:
            line = self.proc.stdout.readline().strip()
            assert line == "ready", f"the zygote did not start: {line!r}"
            self.ready = True
        Path(f"{log}.rc").unlink(missing_ok=True)  # an earlier run's of the same name
        req = {
            "env": env,
            "script": argv[1],
            "argv": argv[2:],
            "log": str(log),
            "cwd": str(cwd or os.getcwd()),
        }
        if err is not None:
            req["err"] = str(err)
        if stdin is not None:
            req["stdin"] = str(stdin)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return Forked(int(self.proc.stdout.readline()), log, self.proc)

    def close(self) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):  # (it may have ended: a broken pipe)
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:  # (else a ResourceWarning at the session's end)
            self.proc.stdout.close()


_SHARED: dict[tuple[str, ...], Zygote] = {}


def shared_zygote(*preload: str, **env: str) -> Zygote:
    """The test session's :class:`Zygote` for workers whose own imports are torch,
    torch.distributed, the library, pytest and ``preload`` (a framework: ``"deepspeed"``, with
    ``env`` the variables it reads at import, e.g. ``DS_ACCELERATOR="cpu"``). Started at the
    first call, ended with the session."""
    key = (*preload, *sorted(f"{k}={v}" for k, v in env.items()))
    if key not in _SHARED:
        _SHARED[key] = Zygote("pytest", "torch.distributed", *preload, env=env)
        atexit.register(_SHARED[key].close)
    return _SHARED[key]


class Forked:
    """A rank forked by a :class:`Zygote`, as much of ``subprocess.Popen`` as :func:`run` uses:
    ended once the zygote wrote its exit status to ``<log>.rc`` (``-N``: killed by signal N).
    A zygote that ended took its ranks with it (tests/node_zygote.py): then a rank gone, or a
    zombie no one reaps, ended killed (-9)."""

    def __init__(self, pid: int, log: Path, zygote: subprocess.Popen | None = None) -> None:
        self.pid, self.rc_file, self.zygote = pid, Path(f"{log}.rc"), zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            orphan = self.zygote is not None and self.zygote.poll() is not None
            if self.rc_file.exists():  # (written whole: os.replace)
                self.returncode = int(self.rc_file.read_text())
            elif orphan and not _running(self.pid):
                self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 60.0) -> int:
        until = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > until:
                raise TimeoutError(f"pid {self.pid}: no exit status in {self.rc_file}")
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def leave_group() -> None:
    """The end of a rank's work (the last call of the worker scripts): meet the other ranks,
    destroy the process group, and exit at once (status 0).

    Without the barrier a rank that finished first tore gloo down while a peer was still in the
    last collective. Without the immediate exit, about 1 run in 25 of 2 FSDP2 ranks on this
    2-core machine under load aborted in interpreter teardown, after the process group was
    destroyed ("terminate called without an active exception", SIGABRT): torch's own, measured
    2026-11-24 with a worker that only trains FSDP2 and gathers its tensors (1 of 25 aborted;
    the same 25 times with a Checkpointer saving: 0)."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_python(
    argv: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 120,
    zygote: Zygote | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)`` for
    ``argv`` = ``[sys.executable, "-c", code, *args]`` or ``[sys.executable, script, *args]``,
    forked from :func:`shared_zygote` (torch and the library imported once a session, not
    seconds of CPU per run): a fresh process that ends as the interpreter would, its stdout
    and stderr captured apart. ``code`` runs as a script file (``sys.argv[0]`` its path,
    tracebacks naming it, not ``<string>``). Not for a claim about what a fresh interpreter
    imports or does at start-up or in its finalization (the zygote child ends with
    ``os._exit`` after the ``atexit`` functions): start one with ``subprocess`` there.
    ``zygote``: another than ``shared_zygote()`` (one that imported DeepSpeed, say); ``cwd``:
    the working directory (else this process's)."""
    env = dict(os.environ if env is None else env, PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory(prefix="run_python") as tmp:
        if argv[1] == "-c":
            script = Path(tmp, "code.py")
            script.write_text(argv[2])
            argv = [argv[0], str(script), *argv[3:]]
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = (zygote or shared_zygote()).spawn(argv, env, out, err, cwd)
        try:
            rc = proc.wait(timeout=timeout)
        except (TimeoutError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(
                argv, timeout, out.read_text(), err.read_text()
            ) from None
        return subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())


class Piped:
    """``subprocess.Popen(argv, stdin=PIPE, stdout=PIPE, stderr=<err or none>, text=True,
    env=env)`` for ``argv`` = ``[sys.executable, "-c", code, *args]`` or ``[sys.executable,
    script, *args]`` (as much of it as the tests use: ``stdin``, ``stdout``, ``communicate``,
    ``wait``, ``poll``, ``kill``, ``send_signal``, ``pid``; stderr to the file ``err``), forked from :func:`shared_zygote` through two FIFOs (torch and the
    library imported once a session). The same claims as :func:`run_python` only."""

    def __init__(
        self, argv: list[str], env: dict[str, str] | None = None, err: Path | None = None
    ) -> None:
        env = dict(os.environ if env is None else env, PYTHONHASHSEED="0")
        self._tmp = tempfile.TemporaryDirectory(prefix="piped")
        tmp = Path(self._tmp.name)
        if argv[1] == "-c":
            Path(tmp, "code.py").write_text(argv[2])
            argv = [argv[0], str(tmp / "code.py"), *argv[3:]]
        zygote = shared_zygote()
        if zygote.proc is None:  # (FRESH: a fresh interpreter, plain pipes)
            with open(err or os.devnull, "w") as errs:
                self.proc: Forked | subprocess.Popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errs,
                    text=True,
                    env=env,
                )
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
            return
        inp, out = tmp / "stdin", tmp / "stdout"
        os.mkfifo(inp)
        os.mkfifo(out)
        rfd = os.open(out, os.O_RDONLY | os.O_NONBLOCK)  # (the child's open does not wait)
        self.proc = zygote.spawn(argv, env, out, err or tmp / "stderr", stdin=inp)
        deadline = time.monotonic() + 120  # (only bounds a hang: the child opens it at once)
        while True:
            try:  # ENXIO until the child opened its end for reading
                wfd = os.open(inp, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert self.proc.poll() is None, f"the child ended: {self.proc.returncode}"
                assert time.monotonic() < deadline, "the child did not open its stdin"
                time.sleep(0.01)
        for fd in (rfd, wfd):
            os.set_blocking(fd, True)
        self.stdin, self.stdout = os.fdopen(wfd, "w"), os.fdopen(rfd, "r")

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def communicate(self, input: str | None = None, timeout: float = 120) -> tuple[str, None]:
        """Write ``input``, close stdin, read stdout to its end, wait: (stdout, None)."""
        if input:
            self.stdin.write(input)
        self.stdin.close()
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.stdout.read()), daemon=True)
        reader.start()  # (a thread: the wrapper may hold what a readline() read ahead)
        reader.join(timeout)
        if reader.is_alive():  # as Popen's timeout (the kill ends the read)
            self.kill()
            reader.join()
            raise subprocess.TimeoutExpired("piped child", timeout)
        self.stdout.close()
        self.proc.wait(timeout=timeout)
        self._tmp.cleanup()
        return got[0], None

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()
