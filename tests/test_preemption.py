"""Preemption detection: real signals to real processes, and a real HTTP metadata server.

Signals: ``preempt_child.py`` runs a step loop with a watcher; the tests send it SIGTERM,
SIGUSR1 or SIGINT with os.kill and read what the loop saw at its step boundary. Forked children
(like DataLoader workers) are checked to still die on SIGTERM. In-process tests use SIGUSR1 on
the pytest process itself and restore every handler they touch.

Metadata: an ``http.server`` on 127.0.0.1 (random free port) plays the AWS, GCP, Azure and
custom endpoints; tests switch what it answers and wait, with deadlines, for the poller.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import spawn_ranks
from resilient_callbacks.errors import ConfigError
from resilient_callbacks.preemption import (
    DEFAULT_GRACE_S,
    MetadataPoller,
    PreemptionWatcher,
)

# 300 s: a dozen tests here run a child that imports torch and saves (16 s with the machine
# busy, their own subprocess timeouts 120-180 s); 60 s cut them off first under load
pytestmark = pytest.mark.timeout(300)

CHILD = Path(__file__).with_name("preempt_child.py")
ROOT = Path(__file__).resolve().parents[1]
PREEMPTED_EXIT = 42
LOGGER = "resilient_callbacks.preemption"

# Calls that must never happen inside the signal handler (compared with the last dotted part).
FORBIDDEN_IN_HANDLER = {
    "print",
    "write",
    "writelines",
    "flush",
    "open",
    "acquire",
    "release",
    "emit",
    "sleep",
    "save",
    "fsync",
    "kill",
    "signal",
    "set",
    "send",
    "sendall",
    "connect",
}


# ----------------------------------------------------------------------------- helpers


def wait_for(pred: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


@contextlib.contextmanager
def saved_handlers(*signums: int) -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in signums}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def start_child(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120.0)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith('{"event": "ready"'):
        proc.kill()
        raise AssertionError(f"child not ready: {line!r} {proc.communicate()[1]}")
    return proc


def finish_child(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any] | None, str]:
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return code, (json.loads(lines[-1]) if lines else None), err


# ----------------------------------------------------------------------------- real signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_is_noticed_at_a_step_boundary(sig: signal.Signals) -> None:
    proc = start_child()
    os.kill(proc.pid, sig)
    code, msg, err = finish_child(proc)
    assert code == PREEMPTED_EXIT, (code, msg, err)
    assert msg is not None and msg["event"] == "preempted"
    assert msg["source"] == sig.name and msg["signum"] == sig.value
    assert msg["grace_s"] == DEFAULT_GRACE_S[sig.name]
    assert msg["count"] == 1
    assert not msg["torch_imported"]  # the module works without torch
    assert err == "", err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_handler_does_no_io(sig: signal.Signals) -> None:
    for _attempt in range(3):  # see preempt_child.py: a signal can rarely slip past the trace
        proc = start_child("--trace-handler")
        os.kill(proc.pid, sig)
        code, msg, err = finish_child(proc)
        assert code == PREEMPTED_EXIT and msg is not None, (code, msg, err)
        assert msg["source"] == sig.name
        calls = msg["handler_calls"]
        if calls:
            break
    assert calls and calls[0].endswith("_on_signal"), calls
    # The handler only recorded: no I/O, logging, locks, saving or sleeping inside it.
    bad = [c for c in calls if c.rsplit(".", 1)[-1] in FORBIDDEN_IN_HANDLER]
    assert not bad, f"the signal handler called {bad}; all calls: {calls}"


def test_signal_not_in_the_list_keeps_its_default_action() -> None:
    proc = start_child("--signals", "SIGTERM")
    os.kill(proc.pid, signal.SIGUSR1)
    code, msg, _ = finish_child(proc)
    assert code == -signal.SIGUSR1, (code, msg)


def test_sigint_is_not_handled_by_default() -> None:
    proc = start_child()
    os.kill(proc.pid, signal.SIGINT)
    code, msg, err = finish_child(proc)
    assert code == 130, (code, msg, err)
    assert msg == {"event": "keyboardinterrupt", "requested": False}


def test_sigint_is_handled_when_enabled() -> None:
    proc = start_child("--handle-sigint")
    os.kill(proc.pid, signal.SIGINT)
    code, msg, err = finish_child(proc)
    assert code == PREEMPTED_EXIT, (code, msg, err)
    assert msg is not None and msg["source"] == "SIGINT"


def test_in_process_signal_second_one_is_counted_not_retriggered() -> None:
    with saved_handlers(signal.SIGTERM, signal.SIGUSR1), PreemptionWatcher() as w:
        assert w.installed_signals == ("SIGTERM", "SIGUSR1")
        assert not w.requested and w.request is None and w.count == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert w.wait(60.0)
        first = w.request
        assert first is not None and first.source == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: w.count == 2, what="second signal counted")
        assert w.request is first  # the first request stays; nothing re-triggered
        assert w.trigger("manual", "again") is False
        assert w.count == 3 and w.request is first
        w.clear()
        assert not w.requested and w.count == 0 and w.remaining_grace_s() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert w.wait(60.0) and w.request is not None and w.request.source == "SIGTERM"
    assert w.installed_signals == ()


def test_uninstall_restores_previous_handlers_and_is_idempotent() -> None:
    hits: list[int] = []

    def previous(signum: int, frame: object) -> None:
        hits.append(signum)

    with saved_handlers(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signal.SIGUSR1, previous)
        term_before = signal.getsignal(signal.SIGTERM)
        int_before = signal.getsignal(signal.SIGINT)
        w = PreemptionWatcher(handle_sigint=True)
        assert w.install() and w.install()  # a second install is a no-op
        assert signal.getsignal(signal.SIGUSR1) is not previous
        assert signal.getsignal(signal.SIGINT) is not int_before
        w.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is previous
        assert signal.getsignal(signal.SIGTERM) is term_before
        assert signal.getsignal(signal.SIGINT) is int_before
        w.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is previous
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: hits == [signal.SIGUSR1], what="the previous handler to run")
        assert not w.requested


def test_out_of_order_uninstall_restores_the_original() -> None:
    with saved_handlers(signal.SIGTERM, signal.SIGUSR1):
        original = signal.getsignal(signal.SIGUSR1)
        a, b = PreemptionWatcher(), PreemptionWatcher()
        a.install()
        b.install()
        a.uninstall()  # b's handler is current: left in place
        os.kill(os.getpid(), signal.SIGUSR1)
        assert b.wait(60.0) and not a.requested
        b.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is original


def test_install_outside_main_thread_warns_and_installs_nothing() -> None:
    w = PreemptionWatcher()
    result: dict[str, Any] = {}

    def run() -> None:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            result["ok"] = w.install()
            result["warnings"] = [str(r.message) for r in rec]

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert result["ok"] is False
    assert any("main thread" in m for m in result["warnings"]), result
    assert signal.getsignal(signal.SIGTERM) is before and w.installed_signals == ()
    assert w.trigger("manual", "still works") and w.requested


def _sleep_forever() -> None:
    time.sleep(30)


def test_forked_worker_dies_on_sigterm_and_leaves_the_parent_alone() -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with saved_handlers(signal.SIGTERM, signal.SIGUSR1), PreemptionWatcher() as w:
        p = ctx.Process(target=_sleep_forever, daemon=True)
        p.start()
        try:
            os.kill(p.pid, signal.SIGTERM)
            p.join(60)
            assert p.exitcode == -signal.SIGTERM, p.exitcode
        finally:
            if p.is_alive():
                p.kill()
                p.join()
        assert not w.requested


class _Pids:
    """A dataset whose every item is the pid of the process that made it."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> int:
        return os.getpid()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_dataloader_worker_survives_the_first_signal_and_dies_of_the_second(sig) -> None:
    """A signal to the whole process group reaches the workers too: the first one must not
    stop the loader before the trainer's emergency save (SIGTERM goes through the C handler
    torch sets in each worker, which the worker replaces right after). A second one (the
    loader's own ``terminate()`` of a worker that does not stop) kills it; the watcher of the
    trainer sees neither."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    with saved_handlers(signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD), PreemptionWatcher() as w:
        it = iter(DataLoader(_Pids(), batch_size=1, num_workers=1, prefetch_factor=1))
        pid = int(next(it))
        os.kill(pid, sig)
        time.sleep(0.5)  # (a worker killed by it would be gone by now: torch then raises here)
        assert _alive(pid)
        assert [int(next(it)) for _ in range(5)] == [pid] * 5  # and it still serves batches
        _until_dead(pid, lambda: os.kill(pid, sig), "the worker survived its second signal")
        assert not w.requested
        del it


def _until_dead(pid: int, act: Callable[[], object], why: str) -> None:
    """``act()``, then wait (60 s at most) for the DataLoader worker ``pid`` to die; torch's
    SIGCHLD handler may raise in this process at any point of it once it has."""
    acted, deadline = False, None
    while True:
        try:
            if not acted:
                acted = True
                act()
            if deadline is None:  # (from after act: the loader's own joins take seconds)
                deadline = time.monotonic() + 60
            if not _alive(pid):
                time.sleep(0.1)  # (torch's SIGCHLD handler raises here, or above)
                break
            assert time.monotonic() < deadline, why
            time.sleep(0.01)
        except RuntimeError as e:  # torch's SIGCHLD handler: a worker died
            assert "DataLoader worker" in str(e), e


class _Stuck(_Pids):
    """Item 0 at once, then stuck (a worker waiting on a dead mount)."""

    def __getitem__(self, i: int) -> int:
        if i:
            time.sleep(120)
        return os.getpid()


PERSISTENT_AT_EXIT = """
import os, sys, torch
from torch.utils.data import DataLoader
from resilient_callbacks.preemption import PreemptionWatcher

class Pids:
    def __len__(self): return 1000
    def __getitem__(self, i): return os.getpid()

LOADERS = []

def train():
    PreemptionWatcher().install()
    it = iter(DataLoader(Pids(), batch_size=1, num_workers=2, persistent_workers=True))
    LOADERS.append(it)  # alive at exit: multiprocessing terminates and joins its workers
    print(int(next(it)), flush=True)

if sys.argv[1] == "here":
    train()
else:  # a trainer in a forked multiprocessing child (its finalizers are cleared at its start)
    import multiprocessing as mp
    p = mp.get_context("fork").Process(target=train)
    p.start()
    p.join(90)
    assert p.exitcode == 0, p.exitcode
"""


@pytest.mark.parametrize("where", ["here", "child"])
def test_a_script_with_persistent_workers_exits(where) -> None:
    """A loader with ``persistent_workers=True`` still alive at the end of the script: at exit
    multiprocessing terminates its daemonic workers (SIGTERM from the trainer), then joins
    them. The sparing handler let them live, so the process never exited (a Trainer run with
    ``dataloader_persistent_workers=True`` hung after its last step)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    p = subprocess.run(
        [sys.executable, "-c", PERSISTENT_AT_EXIT, where],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().isdigit()
    # its workers exit as torch's handler made them: no "killed by signal" from the SIGCHLD
    # handler inside multiprocessing's exit function
    assert "Exception ignored" not in p.stderr and "killed by signal" not in p.stderr, p.stderr


def test_a_stuck_worker_dies_of_its_loaders_terminate(monkeypatch) -> None:
    """A worker the loader stops (its ``done_event`` set) is not spared: the loader's own
    ``terminate()`` of a worker that did not stop in time kills it, as torch's handler did
    (spared, it outlived the loader by its whole stuck call)."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader, _utils

    # how long the loader's shutdown joins a worker before its terminate(): torch's 5 s were
    # spent in full (the worker is stuck by design); 0.5 s leads to the same terminate()
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    with saved_handlers(signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD), PreemptionWatcher():
        it = iter(DataLoader(_Stuck(), batch_size=1, num_workers=1, prefetch_factor=1))
        pid = int(next(it))
        # joins the worker for a while, then terminate() (one SIGTERM), then gives up
        _until_dead(pid, it._shutdown_workers, "the worker outlived its loader's terminate()")  # type: ignore[attr-defined]


def test_a_worker_is_spared_when_a_python_sigterm_handler_came_first() -> None:
    """A Python SIGTERM handler installed before the watcher (a framework's): the worker's
    set-up replaces it with torch's C handler, so a group signal killed the worker; it is
    spared as with the default handler."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    with saved_handlers(signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(signal.SIGTERM, lambda s, f: None)
        with PreemptionWatcher():
            it = iter(DataLoader(_Pids(), batch_size=1, num_workers=1, prefetch_factor=1))
            pid = int(next(it))
            os.kill(pid, signal.SIGTERM)
            time.sleep(0.5)  # (a worker killed by it would be gone by now: torch then raises)
            assert _alive(pid)
            assert [int(next(it)) for _ in range(3)] == [pid] * 3
            del it


class _SignalItself:
    """Kept alive while registered: ``multiprocessing`` runs its after-fork callbacks in each
    child it starts, before the child's target (the DataLoader worker loop)."""

    def __call__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_worker_signalled_before_its_set_up_is_spared_too() -> None:
    """A group SIGTERM reaching a DataLoader worker between its fork and the worker loop's
    signal set-up (the loader starting its workers, as a non-persistent loader does at every
    epoch) killed it: the fork gave SIGTERM its default action back at once, and the trainer's
    loader raised "DataLoader worker ... killed by signal" before the emergency save. Such a
    child keeps the signal blocked until it is spared."""
    pytest.importorskip("torch")
    import multiprocessing.util

    from torch.utils.data import DataLoader

    kick = _SignalItself()
    with saved_handlers(signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD), PreemptionWatcher() as w:
        multiprocessing.util.register_after_fork(kick, lambda k: k())
        try:
            it = iter(DataLoader(_Pids(), batch_size=1, num_workers=1, prefetch_factor=1))
            pid = int(next(it))
        finally:
            del kick  # (the registry holds it weakly: no later child signals itself)
        assert [int(next(it)) for _ in range(5)] == [pid] * 5
        _until_dead(pid, lambda: os.kill(pid, signal.SIGTERM), "not spared once only")
        assert not w.requested
        del it


@pytest.mark.parametrize("previous", ["default", "callable"])
def test_inherited_handler_in_a_foreign_process_acts_like_the_previous_one(previous: str) -> None:
    """A child forked without Python's at-fork hooks keeps our handler: it must forward."""
    with saved_handlers(signal.SIGTERM, signal.SIGUSR1):
        if previous == "callable":
            signal.signal(signal.SIGTERM, lambda s, f: os._exit(7))
        w = PreemptionWatcher()
        w.install()
        handler = signal.getsignal(signal.SIGTERM)
        r, wr = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: never return into pytest
            try:
                os.close(r)
                signal.signal(signal.SIGTERM, handler)  # as if the at-fork hook had not run
                os.write(wr, b"r")
                time.sleep(30)
            finally:
                os._exit(3)
        os.close(wr)
        try:
            assert select.select([r], [], [], 60)[0] and os.read(r, 1) == b"r"
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while (st := os.waitpid(pid, os.WNOHANG))[0] == 0:
                assert time.monotonic() < deadline, "forked child survived SIGTERM"
                time.sleep(0.005)
            status = st[1]
        finally:
            os.close(r)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        if previous == "default":
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        else:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7
        assert not w.requested
        w.uninstall()


def test_trigger_is_thread_safe_and_first_wins() -> None:
    w = PreemptionWatcher()  # not installed: trigger() alone
    firsts: list[bool] = []
    barrier = threading.Barrier(8)

    def hammer(i: int) -> None:
        barrier.wait()
        firsts.extend(w.trigger("manual", f"t{i}") for _ in range(50))

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert w.wait(60.0)
    for t in threads:
        t.join()
    assert w.count == 400 and firsts.count(True) == 1
    assert w.request is not None and w.request.source == "manual"


# ----------------------------------------------------------------------------- grace


def test_grace_defaults_overrides_and_check() -> None:
    w = PreemptionWatcher()
    assert w.remaining_grace_s() is None and w.check_grace(1e6) is None
    w.trigger("SIGTERM", "by hand")
    req = w.request
    assert req is not None and req.grace_s == 30.0
    assert req.remaining_s(now=req.monotonic + 10) == pytest.approx(20.0)
    assert req.remaining_s(now=req.monotonic + 99) == 0.0
    assert w.check_grace(5.0) is None
    msg = w.check_grace(45.0)
    assert msg is not None and "SIGTERM" in msg and "45.0 s" in msg and "grace" in msg.lower()

    w = PreemptionWatcher(grace_period_s={"SIGUSR1": 300, "manual": 10})
    w.trigger("SIGUSR1")
    assert w.request is not None and w.request.grace_s == 300
    assert w.check_grace(250) is None
    w.clear()
    w.trigger()  # "manual"
    assert w.request is not None and w.request.grace_s == 10
    w.clear()
    w.trigger("metadata:aws", "notice", grace_s=1.0)  # a notice's own deadline wins
    assert w.check_grace(2.0) is not None

    w = PreemptionWatcher(grace_period_s=5)
    w.trigger("metadata:gcp")
    assert w.request is not None and w.request.grace_s == 5

    w = PreemptionWatcher()
    w.trigger()  # manual: no known deadline
    assert w.remaining_grace_s() is None and w.check_grace(1e6) is None


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"signals": ["SIGKILL"]}, "cannot be caught"),
        ({"signals": ["SIGNOPE"]}, "not a signal"),
        ({"signals": "SIGTERM"}, "must be a list"),
        ({"signals": [99999]}, "not a signal number"),
        ({"handle_sigint": "yes"}, "True or False"),
        ({"grace_period_s": -1}, "grace_period_s=-1"),
        ({"grace_period_s": {"SIGTREM": 5}}, "unknown source 'SIGTREM'"),
        ({"grace_period_s": {"SIGTERM": 0}}, "> 0"),
        ({"grace_period_s": {"metadata:oracle": 5}}, "unknown source"),
    ],
)
def test_watcher_config_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PreemptionWatcher(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "oracle"}, "'aws', 'gcp', 'azure', 'custom'"),
        ({"kind": "custom"}, "needs url="),
        ({"kind": "aws", "url": "ftp://127.0.0.1/x"}, "http:// or https://"),
        ({"kind": "aws", "interval_s": 0}, "interval_s=0"),
        ({"kind": "aws", "timeout_s": float("nan")}, "timeout_s=nan"),
        ({"kind": "aws", "warn_after_failures": 0}, "warn_after_failures=0"),
        ({"kind": "azure", "azure_event_types": ["Nope"]}, "Preempt, Terminate"),
        ({"kind": "azure", "azure_event_types": "Preempt"}, "must be a list"),
        ({"kind": "gcp", "gcp_maintenance": 1}, "True or False"),
        ({"kind": "azure", "azure_vm_name": ""}, "VM name or None"),
    ],
)
def test_poller_config_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MetadataPoller(PreemptionWatcher(), **kwargs)


def test_other_invalid_arguments() -> None:
    with pytest.raises(ConfigError, match="must be a PreemptionWatcher"):
        MetadataPoller(None, kind="aws")  # type: ignore[arg-type]
    w = PreemptionWatcher()
    with pytest.raises(ConfigError, match="non-empty string"):
        w.trigger("")
    with pytest.raises(ConfigError, match="grace_s=-1"):
        w.trigger("manual", grace_s=-1)
    with pytest.raises(ConfigError, match="estimated_save_s"):
        w.check_grace(-3)


# ----------------------------------------------------------------------------- metadata server

Response = tuple[int, bytes]


class FakeMetadata:
    """A metadata endpoint on 127.0.0.1: ``routes[(method, path)]`` is a response or a function
    of the request headers (names lower-cased) returning one; anything else is a 404.
    ``down=True``: its port is bound (no other process can take it) but refuses connections
    until :meth:`come_up`."""

    def __init__(self, down: bool = False) -> None:
        self.routes: dict[tuple[str, str], Response | Callable[[dict[str, str]], Response]] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _serve(self) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                fake.requests.append((self.command, self.path, headers))
                route = fake.routes.get((self.command, self.path), (404, b""))
                status, body = route(headers) if callable(route) else route
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), Handler, bind_and_activate=False
        )
        self.httpd.server_bind()  # bound, not listening: a connection is refused
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        if not down:
            self.come_up()

    def come_up(self) -> None:
        self.httpd.server_activate()
        self._thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def count(self, method: str = "GET") -> int:
        return sum(1 for m, _, _ in self.requests if m == method)

    def close(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeMetadata]:
    s = FakeMetadata()
    yield s
    s.close()


AWS_PATH = "/latest/meta-data/spot/instance-action"
GCP_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
TOKEN = "tok-123"


def need_header(name: str, value: str, resp: Response) -> Callable[..., Response]:
    return lambda h: (
        resp if h.get(name.lower()) == value else (401 if name.startswith("X-") else 400, b"")
    )


def aws_notice() -> Response:
    when = (datetime.now(UTC) + timedelta(seconds=120)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return 200, json.dumps({"action": "terminate", "time": when}).encode()


def azure_events(*events: dict[str, Any]) -> Response:
    return 200, json.dumps({"DocumentIncarnation": 1, "Events": list(events)}).encode()


def azure_event(kind: str = "Preempt", vm: str = "vm1", in_s: float = 45) -> dict[str, Any]:
    nb = email.utils.formatdate(time.time() + in_s, usegmt=True)
    return {
        "EventId": f"E-{kind}-{vm}",
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": [vm],
        "EventStatus": "Scheduled",
        "NotBefore": nb,
    }


def aws_token_route(server: FakeMetadata) -> None:
    ttl = "X-aws-ec2-metadata-token-ttl-seconds"
    server.routes[("PUT", "/latest/api/token")] = lambda h: (
        (200, TOKEN.encode()) if h.get(ttl.lower()) else (400, b"")
    )


def route_aws(s: FakeMetadata, notice: bool) -> None:
    aws_token_route(s)
    resp = aws_notice() if notice else (404, b"")
    s.routes[("GET", AWS_PATH)] = need_header("X-aws-ec2-metadata-token", TOKEN, resp)


def route_gcp(s: FakeMetadata, notice: bool) -> None:
    resp = (200, b"TRUE" if notice else b"FALSE")
    s.routes[("GET", GCP_PATH)] = need_header("Metadata-Flavor", "Google", resp)


def route_azure(s: FakeMetadata, notice: bool) -> None:
    resp = azure_events(azure_event("Preempt")) if notice else azure_events()
    s.routes[("GET", AZURE_PATH)] = need_header("Metadata", "true", resp)


def route_custom(s: FakeMetadata, notice: bool) -> None:
    s.routes[("GET", "/notice")] = (200, b"drain: node upgrade" if notice else b"  \n")


# kind -> (path, set the routes (notice or not), expected detail, expected grace_s range)
KINDS: dict[str, tuple[str, Callable[[FakeMetadata, bool], None], str, tuple[float, float]]] = {
    "aws": (AWS_PATH, route_aws, "action=terminate", (100.0, 120.5)),
    "gcp": (GCP_PATH, route_gcp, "preempted=TRUE", (30.0, 30.0)),
    "azure": (AZURE_PATH, route_azure, "Preempt Scheduled", (40.0, 45.5)),
    "custom": ("/notice", route_custom, "drain: node upgrade", (0.0, 0.0)),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_poller_no_notice_then_notice(kind: str, server: FakeMetadata) -> None:
    path, route, detail, (lo, hi) = KINDS[kind]
    route(server, False)
    w = PreemptionWatcher()
    with MetadataPoller(w, kind=kind, url=server.url(path), interval_s=0.05) as poller:
        wait_for(lambda: poller.polls >= 3, what="three polls")
        assert not w.requested
        assert poller.consecutive_failures == 0, "the quiet answers must not count as failures"
        route(server, True)
        # ~2 intervals (0.1 s) alone; the wait only tells "noticed by polling" from "not
        # noticed", with room for a loaded 2-core machine where a thread can wait for a core
        assert w.wait(60.0), "the notice was not noticed"
        req = w.request
        assert req is not None and req.source == f"metadata:{kind}"
        assert detail in req.detail
        if kind == "custom":
            assert req.grace_s is None
        else:
            assert req.grace_s is not None and lo <= req.grace_s <= hi, req.grace_s
        n = poller.polls
        wait_for(lambda: poller.polls >= n + 3, what="more polls")
        assert w.count == 1, "a standing notice must trigger once"
    assert not poller.running


def test_aws_imdsv2_token_is_fetched_once_and_sent(server: FakeMetadata) -> None:
    route_aws(server, False)
    w = PreemptionWatcher()
    with MetadataPoller(w, kind="aws", url=server.url(AWS_PATH), interval_s=0.05) as poller:
        wait_for(lambda: poller.polls >= 4, what="four polls")
    puts = [r for r in server.requests if r[0] == "PUT"]
    gets = [r for r in server.requests if r[0] == "GET"]
    assert len(puts) == 1 and puts[0][1] == "/latest/api/token"
    assert puts[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert gets and all(h.get("x-aws-ec2-metadata-token") == TOKEN for _, _, h in gets)
    assert poller.consecutive_failures == 0 and not w.requested


def test_aws_falls_back_to_imdsv1_when_the_token_put_fails(server: FakeMetadata) -> None:
    server.routes[("PUT", "/latest/api/token")] = (405, b"")
    server.routes[("GET", AWS_PATH)] = (404, b"")
    w = PreemptionWatcher()
    with MetadataPoller(w, kind="aws", url=server.url(AWS_PATH), interval_s=0.05) as poller:
        wait_for(lambda: poller.polls >= 2, what="two polls")
        assert not w.requested and poller.consecutive_failures == 0
        server.routes[("GET", AWS_PATH)] = aws_notice()
        assert w.wait(60.0)
    assert w.request is not None and "action=terminate" in w.request.detail
    assert all("x-aws-ec2-metadata-token" not in h for m, _, h in server.requests if m == "GET")


def test_aws_rejected_token_is_refreshed(server: FakeMetadata) -> None:
    tokens = iter(["old", TOKEN, TOKEN, TOKEN])
    server.routes[("PUT", "/latest/api/token")] = lambda h: (200, next(tokens).encode())
    server.routes[("GET", AWS_PATH)] = need_header("X-aws-ec2-metadata-token", TOKEN, (404, b""))
    w = PreemptionWatcher()
    with MetadataPoller(w, kind="aws", url=server.url(AWS_PATH), interval_s=0.05) as poller:
        wait_for(lambda: poller.polls >= 3, what="three polls")
        wait_for(lambda: poller.consecutive_failures == 0, what="a good poll")
    assert server.count("PUT") == 2 and not w.requested


@pytest.mark.parametrize("first", [b"<html>\n<body>proxy error</body>\n</html>\n", b"\x00\xff\r\n"])
def test_aws_a_token_answer_that_is_not_a_token_is_not_kept(server: FakeMetadata, first) -> None:
    """The token PUT answered 200 once with an HTML page (a proxy) or garbage: it was kept as
    the token for 6 hours, no GET could carry it, and a spot notice went unseen all that time."""
    answers = iter([first])
    server.routes[("PUT", "/latest/api/token")] = lambda h: (200, next(answers, TOKEN.encode()))
    server.routes[("GET", AWS_PATH)] = need_header("X-aws-ec2-metadata-token", TOKEN, aws_notice())
    w = PreemptionWatcher()
    with MetadataPoller(w, kind="aws", url=server.url(AWS_PATH), interval_s=0.05):
        assert w.wait(60.0), server.requests
    assert w.request is not None and "action=terminate" in w.request.detail


def test_gcp_maintenance_event_is_optional(server: FakeMetadata) -> None:
    route_gcp(server, False)
    maint = "/computeMetadata/v1/instance/maintenance-event"
    server.routes[("GET", maint)] = need_header(
        "Metadata-Flavor", "Google", (200, b"TERMINATE_ON_HOST_MAINTENANCE")
    )
    off = PreemptionWatcher()
    with MetadataPoller(off, kind="gcp", url=server.url(GCP_PATH), interval_s=0.05) as poller:
        wait_for(lambda: poller.polls >= 3, what="three polls")
    assert not off.requested and all(p != maint for _, p, _ in server.requests)
    on = PreemptionWatcher()
    with MetadataPoller(
        on, kind="gcp", url=server.url(GCP_PATH), interval_s=0.05, gcp_maintenance=True
    ):
        assert on.wait(60.0)
    assert on.request is not None
    assert on.request.detail == "maintenance-event=TERMINATE_ON_HOST_MAINTENANCE"
    # a live migration pauses the VM and keeps it running: no reason to stop the job
    server.routes[("GET", maint)] = (200, b"MIGRATE_ON_HOST_MAINTENANCE")
    moved = PreemptionWatcher()
    with MetadataPoller(
        moved, kind="gcp", url=server.url(GCP_PATH), interval_s=0.05, gcp_maintenance=True
    ) as poller:
        wait_for(lambda: poller.polls >= 3, what="three polls")
    assert not moved.requested


def test_azure_ignores_other_event_types_and_other_vms(server: FakeMetadata) -> None:
    server.routes[("GET", AZURE_PATH)] = azure_events(
        azure_event("Reboot", "vm1"), azure_event("Preempt", "vm2")
    )
    w = PreemptionWatcher()
    url = server.url(AZURE_PATH)
    with MetadataPoller(w, kind="azure", url=url, interval_s=0.05, azure_vm_name="vm1") as p:
        wait_for(lambda: p.polls >= 3, what="three polls")
        assert not w.requested and p.consecutive_failures == 0
        server.routes[("GET", AZURE_PATH)] = azure_events(
            azure_event("Preempt", "vm2"), azure_event("Terminate", "vm1", in_s=300)
        )
        assert w.wait(60.0)
    assert w.request is not None and "Terminate" in w.request.detail
    assert w.request.grace_s is not None and 290 <= w.request.grace_s <= 300.5


def test_server_down_one_warning_then_recovers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    s = FakeMetadata(down=True)  # its port held: no other process can take it meanwhile
    w = PreemptionWatcher()
    try:
        url = s.url("/notice")
        with MetadataPoller(w, kind="custom", url=url, interval_s=0.05, warn_after_failures=3) as p:
            wait_for(lambda: p.consecutive_failures >= 8, what="eight failed polls")
            assert not w.requested
            warns = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
            assert len(warns) == 1, [r.getMessage() for r in warns]
            assert "cannot read the custom preemption notice endpoint" in warns[0].getMessage()
            assert any(r.levelno == logging.DEBUG for r in caplog.records if r.name == LOGGER)
            s.routes[("GET", "/notice")] = (200, b"spot reclaim")
            s.come_up()  # the endpoint comes back, with a notice
            assert w.wait(60.0)
    finally:
        s.close()
    assert w.request is not None and w.request.detail == "spot reclaim"
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_bad_answers_are_failures_not_notices(server: FakeMetadata) -> None:
    server.routes[("PUT", "/latest/api/token")] = (200, TOKEN.encode())
    server.routes[("GET", AWS_PATH)] = (200, b"<html>captive portal</html>")
    w = PreemptionWatcher()
    with MetadataPoller(w, kind="aws", url=server.url(AWS_PATH), interval_s=0.05) as p:
        wait_for(lambda: p.consecutive_failures >= 3, what="three failed polls")
        server.routes[("GET", AWS_PATH)] = (500, b"")
        n = p.polls
        wait_for(lambda: p.polls >= n + 2, what="two more polls")
        assert p.consecutive_failures >= 5 and p.running
    assert not w.requested


def test_stop_is_prompt_with_a_long_interval(server: FakeMetadata) -> None:
    server.routes[("GET", "/notice")] = (404, b"")
    p = MetadataPoller(
        PreemptionWatcher(), kind="custom", url=server.url("/notice"), interval_s=60
    ).start()
    wait_for(lambda: p.polls >= 1, what="the first poll")
    t0 = time.monotonic()
    p.stop()
    # far below the 60 s interval: stop() does not wait it out (loose for a loaded machine)
    assert time.monotonic() - t0 < 45.0 and not p.running
    p.stop()  # idempotent


def test_a_signal_handler_installed_after_the_checkpointer_is_warned_about(tmp_path):
    """A handler installed after the Checkpointer's replaces it: SIGTERM no longer saved, and
    nothing said so (preemption probe). The next step() warns once, pointing at the caller."""
    import torch

    from resilient_callbacks import Checkpointer

    state = {"w": torch.zeros(2)}
    with Checkpointer(tmp_path / "ck", every_n_steps=100) as ck:
        ck.step(1, state)
        before = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *a: None)
        try:
            with pytest.warns(RuntimeWarning, match="SIGTERM no longer triggers") as got:
                ck.step(2, state)
            assert got[0].filename == __file__
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ck.step(3, state)  # once
        finally:
            signal.signal(signal.SIGTERM, before)


def test_a_handler_chained_to_the_checkpointers_keeps_both(tmp_path):
    """The warning's advice was to call ``watcher.trigger()`` from one's own handler; one who
    did was still warned (the watcher cannot see inside a handler). ``watcher.chained(h)``
    makes the handler: no warning, and a signal both runs ``h`` and requests the save."""
    import torch

    from resilient_callbacks import Checkpointer

    ran: list[int] = []
    state = {"w": torch.zeros(2)}
    before = signal.getsignal(signal.SIGTERM)
    try:
        with Checkpointer(tmp_path / "ck", every_n_steps=100, exit_on_preemption=False) as ck:
            ck.step(1, state)
            signal.signal(signal.SIGTERM, ck.watcher.chained(lambda s, f: ran.append(s)))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert ck.step(2, state) is False
                os.kill(os.getpid(), signal.SIGTERM)
                wait_for(lambda: ran == [signal.SIGTERM], 30, "the chained handler")
                assert ck.step(3, state) is True  # the emergency save
            assert ck.preempted
        assert ran == [signal.SIGTERM]
        with pytest.raises(ConfigError, match="not callable"):
            ck.watcher.chained(None)  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGTERM, before)


_TWO_CHECKPOINTERS = """
import os, signal, sys, torch
from resilient_callbacks import Checkpointer
first_stays = sys.argv[2] == "first-stays"
sa, sb = {"t": torch.zeros(2)}, {"u": torch.zeros(2)}
a = Checkpointer(os.path.join(sys.argv[1], "a"), every_n_steps=100, exit_on_preemption=not first_stays)
b = Checkpointer(os.path.join(sys.argv[1], "b"), every_n_steps=100)
a.restore(sa); b.restore(sb)
for s in range(1, 20):
    sa["t"].fill_(s); sb["u"].fill_(s)
    if s == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    a.step(s, sa)
    b.step(s, sb)
"""


def _run_code(
    script: Path, code: str, *args: str, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as the script ``script`` with ``args``, the library's src importable; its
    output captured. Forked from the session's zygote (spawn_ranks.run_python: torch imported
    once), or with ``fresh`` a fresh interpreter (a claim about the interpreter's finalization)."""
    script.write_text(code)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, str(script), *args]
    if not fresh:
        return spawn_ranks.run_python(argv, env, timeout=180)
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.parametrize("how", ["default", "first-stays"])
def test_two_checkpointers_in_one_process_exit_75_on_sigterm(tmp_path, how):
    """Two Checkpointers in one loop, SIGTERM: the process exits 75 either way (it was 143: the
    second's close() passed the signal on as unanswered), the unsaved one is named; with
    exit_on_preemption=False on the first, both save step 5, each log line naming its directory."""
    r = _run_code(tmp_path / "two.py", _TWO_CHECKPOINTERS, str(tmp_path), how)
    assert r.returncode == 75, r.stderr[-2000:]
    saved = {d: sorted(n for n in os.listdir(tmp_path / d) if n.startswith("step_")) for d in "ab"}
    if how == "default":
        assert saved == {"a": ["step_000000005"], "b": []}
        assert "was not saved at this preemption" in r.stderr and str(tmp_path / "b") in r.stderr
    else:
        assert saved == {"a": ["step_000000005"], "b": ["step_000000005"]}
        # each of the two emergency saves says which directory it is (two identical lines)
        for d in "ab":
            assert f"saving step 5 to {tmp_path / d} before stopping" in r.stderr, r.stderr


@pytest.mark.parametrize("end", ["close", "at exit"])
def test_a_signal_after_the_last_step_exits_75_at_close_and_said_so(tmp_path: Path, end) -> None:
    """SIGTERM after the last step() (a short loop can end before a decision step acts on it):
    close() passed it on to the handler before ours, here the default action, and the process
    died of the signal (-15: a crash to the scheduler). It now exits 75 as a step() acting on it
    would have, what was committed kept, also when the Checkpointer is closed at exit (where
    a SystemExit is ignored), and says when the signal came and what was saved (it said the
    signal 'arrived during close()')."""
    script = (
        "import signal, sys, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "ck = Checkpointer(sys.argv[1], async_save=False)\n"
        "ck.step(1, {'w': torch.ones(2)}, final=True)\n"
        "signal.raise_signal(signal.SIGTERM)\n"
        + ("ck.close()\nprint('survived')\n" if end == "close" else "print('ends')\n")
    )
    argv = [sys.executable, "-c", script, str(tmp_path / "ck")]
    if end == "close":  # forked from the session's zygote (torch imported once)
        out = spawn_ranks.run_python(argv)
    else:  # the interpreter's own exit: a fresh one
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 75, out
    assert "survived" not in out.stdout
    assert "SIGTERM arrived" in out.stderr and "after the last step()" in out.stderr, out.stderr
    assert "step_000000001" in out.stderr and "exiting with code 75" in out.stderr
    assert (tmp_path / "ck" / "step_000000001" / "manifest.json").exists()


@pytest.mark.parametrize("end", ["with", "finally"])
def test_a_signal_after_the_last_step_keeps_the_users_own_exit_code(tmp_path: Path, end) -> None:
    """SIGTERM after the last step(), then the script's own ``sys.exit(3)`` (a run it judged
    failed: no restart wanted) reaching close() at a with block's end or in a ``finally``:
    close() raised SystemExit(75) in its place, so the scheduler requeued the run the user
    ended. The user's code ends the process, and a warning says the signal got no save."""
    body = "    ck.step(1, {'w': torch.ones(2)}, final=True)\n"
    body += "    signal.raise_signal(signal.SIGTERM)\n    sys.exit(3)\n"
    script = "import signal, sys, torch\nfrom resilient_callbacks import Checkpointer\n" + (
        "with Checkpointer(sys.argv[1], async_save=False) as ck:\n" + body
        if end == "with"
        else "ck = Checkpointer(sys.argv[1], async_save=False)\ntry:\n"
        + body
        + "finally:\n    ck.close()\n"
    )
    out = spawn_ranks.run_python([sys.executable, "-c", script, str(tmp_path / "ck")])
    assert out.returncode == 3, out
    assert "SIGTERM arrived" in out.stderr and "sys.exit(3)" in out.stderr, out.stderr
    assert (tmp_path / "ck" / "step_000000001" / "manifest.json").exists()


@pytest.mark.parametrize("first", ["ema", "model"])
def test_a_signal_after_the_last_step_exits_75_with_a_second_checkpointer_not_exiting(
    tmp_path: Path, first
) -> None:
    """Two Checkpointers, the EMA's with exit_on_preemption=False as the docs advise, SIGTERM
    after the last step(), nested with blocks: the model's close (the inner one) passes the
    signal on to the EMA's watcher, installed before its own, and the EMA's close then passed
    it on to the default action (its own exit_on_preemption=False): the process died of the
    signal (-15, a crash to the scheduler) although the model's Checkpointer exits on a
    preemption. It exits 75, whichever was created first."""
    ema = "Checkpointer(sys.argv[1] + '/ema', async_save=False, exit_on_preemption=False)"
    model = "Checkpointer(sys.argv[1] + '/model', async_save=False)"
    made = [f"ema = {ema}\n", f"model = {model}\n"]
    script = (
        "import signal, sys, torch\nfrom resilient_callbacks import Checkpointer\n"
        + "".join(made if first == "ema" else made[::-1])
        + ("with ema:\n    with model:\n" if first == "ema" else "with model:\n    with ema:\n")
        + "        model.step(1, {'w': torch.ones(2)}, final=True)\n"
        + "        ema.step(1, {'w': torch.ones(2)}, final=True)\n"
        + "        signal.raise_signal(signal.SIGTERM)\n"
        + "print('survived')\n"
    )
    out = spawn_ranks.run_python([sys.executable, "-c", script, str(tmp_path)])
    assert out.returncode == 75, out
    assert "survived" not in out.stdout
    assert "exiting with code 75" in out.stderr, out.stderr


def test_a_signal_after_the_last_step_goes_to_a_handler_of_the_users(tmp_path: Path) -> None:
    """A handler of the user's installed before the Checkpointer gets a signal that came after
    the last step() once close() has finished, as before (no exit 75 in its place)."""
    script = (
        "import signal, sys, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "signal.signal(signal.SIGTERM, lambda *a: print('mine'))\n"
        "ck = Checkpointer(sys.argv[1], async_save=False)\n"
        "ck.step(1, {'w': torch.ones(2)}, final=True)\n"
        "signal.raise_signal(signal.SIGTERM)\n"
        "ck.close()\n"
        "print('survived')\n"
    )
    out = spawn_ranks.run_python([sys.executable, "-c", script, str(tmp_path / "ck")])
    assert out.returncode == 0, out
    assert out.stdout.split() == ["mine", "survived"], out
    assert "passing it on to the handler before ours" in out.stderr, out.stderr


def test_a_signal_after_the_last_step_closed_from_another_thread_is_passed_on(
    tmp_path: Path,
) -> None:
    """close() from a thread other than the main one cannot end the process with 75 (a
    SystemExit there ends that thread only, and the script went on): the signal is passed
    on as before and the default action ends the process."""
    script = (
        "import signal, sys, threading, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "ck = Checkpointer(sys.argv[1], async_save=False)\n"
        "ck.step(1, {'w': torch.ones(2)}, final=True)\n"
        "signal.raise_signal(signal.SIGTERM)\n"
        "t = threading.Thread(target=ck.close)\n"
        "t.start()\n"
        "t.join()\n"  # (the signal, raised in the thread, is handled in the main one)
        "print('survived')\n"
    )
    out = spawn_ranks.run_python([sys.executable, "-c", script, str(tmp_path / "ck")])
    assert out.returncode == -signal.SIGTERM, out
    assert "passing it on to the handler before ours" in out.stderr, out.stderr


def test_a_signal_to_a_re_run_of_a_finished_job_names_the_checkpoint_it_restored(
    tmp_path: Path,
) -> None:
    """A finished job run again restores its last step, trains nothing and saves nothing; a
    SIGTERM then ends it with 75 as above, and the message names the checkpoint in the
    directory (it said 'the newest checkpoint is None'; found by a kill-fuzzing probe)."""
    import torch

    from resilient_callbacks import Checkpointer

    ckdir = tmp_path / "ck"
    with Checkpointer(str(ckdir), async_save=False, preemption=False) as ck:
        ck.step(1, {"w": torch.ones(2)}, final=True)
    script = (
        "import signal, sys, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "ck = Checkpointer(sys.argv[1])\n"
        "assert ck.restore({'w': torch.zeros(2)}) == 1\n"
        "signal.raise_signal(signal.SIGTERM)\n"
        "ck.close()\n"
    )
    out = spawn_ranks.run_python([sys.executable, "-c", script, str(ckdir)])
    assert out.returncode == 75, out
    said = next(line for line in out.stderr.splitlines() if "SIGTERM arrived" in line)
    assert "newest checkpoint is None" not in said, said
    assert str(ckdir / "step_000000001") + " (restored at the start)" in said, said


_FULL_DISK_AT_PREEMPTION = """
import errno, os, signal, sys, torch
from resilient_callbacks import Checkpointer, layout
real = layout.write_part

def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")

state = {"t": torch.zeros(2)}
with Checkpointer(sys.argv[1], every_n_steps=2, async_save=sys.argv[2] == "async") as ck:
    for s in range(1, 20):
        state["t"].fill_(s)
        if s == 5:
            ck.flush()  # step 4 committed before the disk "fills"
            layout.write_part = full
            os.kill(os.getpid(), signal.SIGTERM)
        ck.step(s, state)
"""


_FAILED_THEN_REMOVED = """
import errno, os, shutil, signal, sys, torch
from resilient_callbacks import Checkpointer, layout
state = {"t": torch.zeros(2)}
ck = Checkpointer(sys.argv[1], every_n_steps=2, async_save=False)
ck.restore(state)
ck.step(2, state)

def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")

layout.write_part = full
os.kill(os.getpid(), signal.SIGTERM)
try:
    ck.step(3, state)
except Exception as e:
    print("failed", type(e).__name__, flush=True)
shutil.rmtree(sys.argv[1])  # (a cleanup of the program's own) before the exit hook's close
"""


def test_a_failed_emergency_save_closed_at_exit_after_the_directory_was_removed(tmp_path):
    """The emergency save failed, then the program removed its directory and ended; the exit
    hook's close said "older checkpoints in <dir> are intact" of a directory that is gone. It
    says the directory no longer exists now."""
    root = tmp_path / "ck"
    r = _run_code(tmp_path / "gone.py", _FAILED_THEN_REMOVED, str(root))
    assert "failed CheckpointWriteError" in r.stdout, r.stderr[-2000:]
    said = next(line for line in r.stderr.splitlines() if "the emergency save of step 3" in line)
    assert said.endswith(f"{root} no longer exists (removed meanwhile), nor its checkpoints")
    assert not root.exists()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_emergency_save_that_fails_is_said_so_not_passed_on_as_unanswered(tmp_path, mode):
    """SIGTERM with a full disk: the emergency save's error reaches the loop and ends the run
    (exit 1 in both modes); close() says that save failed. It said the signal came 'after the
    last step() that could act on it (no emergency save for it)' and, with background saves,
    passed it on (exit 143)."""
    r = _run_code(tmp_path / "full.py", _FULL_DISK_AT_PREEMPTION, str(tmp_path / "ck"), mode)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "CheckpointWriteError" in r.stderr and "No space left" in r.stderr
    assert "the emergency save of step 5 failed" in r.stderr, r.stderr[-2000:]
    assert "after the last step()" not in r.stderr
    assert sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("step_")) == [
        "step_000000002",
        "step_000000004",
    ]


def test_an_exception_while_a_signal_is_pending_is_not_swallowed(tmp_path: Path) -> None:
    """SIGTERM arrives, then the training step raises before the next ckpt.step(): closing for
    the exception passed the signal on to the default handler, which killed the process (143)
    before the exception's traceback was printed; the log said the signal came after the last
    step. The exception now ends the process (exit 1, traceback shown) and the log names both."""
    script = (
        "import os, signal, sys, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "model = torch.nn.Linear(2, 2)\n"
        "with Checkpointer(sys.argv[1], every_n_steps=10) as ckpt:\n"
        "    step = ckpt.restore({'model': model})\n"
        "    ckpt.step(step + 1, {'model': model})\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    raise ValueError('loss is NaN at step 2')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = spawn_ranks.run_python([sys.executable, "-c", script, str(tmp_path / "ck")], env)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "ValueError: loss is NaN at step 2" in p.stderr, p.stderr[-2000:]
    assert "arrived while training failed with ValueError" in p.stderr, p.stderr[-2000:]


_SECOND_SIGNAL_AT_EXIT = """
import os, signal, sys, torch
from resilient_callbacks import Checkpointer
mode = sys.argv[2]
if mode == "user-handler":  # installed before the Checkpointer: it runs, as before
    signal.signal(signal.SIGTERM, lambda s, f: print("user handler", flush=True))


class SignalAtFinalization:  # a global: deleted as the interpreter tears the modules down
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        os.write(1, b"survived finalization")


if mode == "finalizing":
    keep = SignalAtFinalization()
state = {"t": torch.zeros(2)}
ck = Checkpointer(sys.argv[1], every_n_steps=100)
ck.restore(state)
try:
    for s in range(1, 20):
        state["t"].fill_(s)
        if s == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        ck.step(s, state)
finally:
    # the process is on its way out after the emergency save (the Checkpointer is closed):
    # another SIGTERM comes, as torchrun passes on a signal sent to its whole process group,
    # or a rank is signalled a moment later than the others
    if mode != "finalizing":
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived", flush=True)
"""


@pytest.mark.parametrize("mode", ["default", "user-handler", "finalizing"])
def test_a_second_signal_while_exiting_after_the_emergency_save_keeps_the_exit_code(tmp_path, mode):
    """The emergency checkpoint is committed and the process exits 75; a second SIGTERM during
    the second or more that the exit then takes (the exception's way out, then the
    interpreter's and torch's finalization) killed it with the signal (exit -15, 143 in a
    shell): a scheduler saw a crash, not "restart me". Now the process ends at once with 75
    while Python code runs, and ignores the signal during the finalization (where Python
    handlers no longer run). A handler of the user's installed before the Checkpointer is back
    after close() and runs, as before."""
    # (the interpreter's own finalization: a fresh one)
    r = _run_code(
        tmp_path / "second.py",
        _SECOND_SIGNAL_AT_EXIT,
        str(tmp_path / "ck"),
        mode,
        fresh=mode == "finalizing",
    )
    assert r.returncode == 75, (r.returncode, r.stderr[-2000:])
    assert sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("step_")) == [
        "step_000000003"
    ]
    if mode == "default":
        assert "survived" not in r.stdout  # ended at once, with the exit code
    elif mode == "user-handler":
        assert "user handler" in r.stdout and "survived" in r.stdout
    else:
        assert "survived finalization" in r.stdout  # the signal was ignored


def test_a_process_that_catches_the_preemption_exit_gets_its_handlers_back(tmp_path):
    """In-process (a notebook, a sweep, a test catching SystemExit): the handler kept for the
    exit ends the process with 75 on a further signal, until a Checkpointer is opened again;
    that one's close() then restores the handler from before the first, not the kept one."""
    import torch

    from resilient_callbacks import Checkpointer

    with saved_handlers(signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        state = {"t": torch.zeros(2)}
        ck = Checkpointer(tmp_path / "a", every_n_steps=100)
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(SystemExit):
            ck.step(1, state)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)  # kept: exits 75
        again = Checkpointer(tmp_path / "b", every_n_steps=100)
        again.close()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_dataloader_worker_killed_by_the_signal_is_named_with_what_to_do(tmp_path, caplog):
    """A signal to the whole process group (Slurm's --signal, kill -- -PGID) reaches the
    DataLoader workers too; one started with the 'spawn' or 'forkserver' method is not spared
    and dies of it, and torch raises in the training loop before the emergency save. The log
    said only that the signal came while training failed with a RuntimeError; it now says why
    and what to do."""
    import torch

    from resilient_callbacks import Checkpointer

    with saved_handlers(signal.SIGTERM, signal.SIGUSR1):
        ck = Checkpointer(tmp_path / "ck", every_n_steps=100)
        ck.step(1, {"t": torch.zeros(2)})
        os.kill(os.getpid(), signal.SIGTERM)  # recorded; the loader raises before step 2
        with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
            ck.abort(RuntimeError("DataLoader worker (pid 123) is killed by signal: Terminated. "))
    assert "SIGTERM arrived while training failed with RuntimeError" in caplog.text
    assert "A DataLoader worker died of the signal first" in caplog.text, caplog.text
    assert "multiprocessing_context" in caplog.text


_CAUGHT_EXIT = """
import os, signal, sys, time, torch
from resilient_callbacks import Checkpointer
sig = getattr(signal, sys.argv[2])
# the actions a notebook's kernel or an interactive Python has: not what this process inherited
# (a test run started in the background by a non-interactive shell ignores SIGINT, and the
# signal after the caught exit got that, as without us: ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
state = {"t": torch.zeros(2)}
ck = Checkpointer(sys.argv[1], every_n_steps=100, handle_sigint=True)
ck.restore(state)
# (a signal sent to the process may reach another thread first, so the main thread acts on it
# some bytecodes later: each part goes on until it does, 60 s bounding a hang)
deadline = time.monotonic() + 60
try:
    s = 0
    while time.monotonic() < deadline:
        s += 1
        if s == 3:
            os.kill(os.getpid(), sig)
        ck.step(s, state)
    print("never stopped", flush=True)
except SystemExit as e:  # a notebook's kernel, a sweep: the process goes on
    print("caught", e.code, flush=True)
deadline = time.monotonic() + 60
try:
    os.kill(os.getpid(), sig)  # later: Ctrl-C (a notebook's interrupt), a SIGTERM
    while time.monotonic() < deadline:
        time.sleep(0.01)
    print("no interrupt", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
print("went on", flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_after_the_preemption_exit_was_caught_acts_as_without_us(tmp_path, sig):
    """The SystemExit(75) of a preemption caught and the process going on (a notebook's
    kernel, a sweep's driver): the handler kept for that exit stayed, so the next signal ended
    the process at once with 75 (os._exit), whatever it was: a notebook's interrupt (SIGINT,
    handle_sigint=True) killed the kernel with all its state. Now, with no SystemExit under
    way, the signal gets the action it had before the Checkpointer: SIGINT's
    KeyboardInterrupt (the process goes on), SIGTERM's death by the signal."""
    r = _run_code(tmp_path / "caught.py", _CAUGHT_EXIT, str(tmp_path / "ck"), sig)
    assert "caught 75" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    if sig == "SIGINT":
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
        assert "interrupted" in r.stdout and "went on" in r.stdout
    else:
        assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr[-2000:])
        assert "went on" not in r.stdout
