"""A step loop with a PreemptionWatcher, signalled by test_preemption.py (not a test module).

It installs the watcher, prints ``ready``, then runs "steps" (a short sleep each). At the first
step boundary where ``watcher.requested`` is true it prints one JSON line and exits with
``PREEMPTED_EXIT``. A KeyboardInterrupt prints a JSON line and exits with 130. Nothing
happening for ``--max-seconds`` exits with 3.

``--trace-handler`` records every call made inside the signal handler (and in what it calls),
so the test can check that the handler did no I/O: no write, print, open, lock, log, save,
sleep or signal juggling. The profile hook is a C callable (print into a StringIO), and the
watched signals are kept blocked except inside one ``pthread_sigmask`` call per step: CPython
runs a pending handler at its next check, and a check inside a profile callback would run the
handler unprofiled; inside ``pthread_sigmask`` (a C call, profiled) it is always seen. A signal
landing in the few microseconds between unblocking and blocking again can still be missed: the
output then has no handler calls and the test runs the child again.

The preemption module is loaded without the package facade (``resilient_callbacks/__init__``
imports torch, two seconds per child): this also shows that the module needs no torch.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import json
import re
import signal
import sys
import time
import types

PREEMPTED_EXIT = 42


def load_preemption() -> types.ModuleType:
    spec = importlib.util.find_spec("resilient_callbacks")
    assert spec is not None and spec.submodule_search_locations is not None
    pkg = types.ModuleType("resilient_callbacks")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["resilient_callbacks"] = pkg
    import resilient_callbacks.preemption as preemption

    return preemption


_BUILTIN = re.compile(r"<(?:built-in (?:function|method) |method '|slot wrapper ')(\w+)")


def handler_calls(trace: str) -> list[str]:
    """The names of the functions called (directly or not) by PreemptionWatcher._on_signal."""
    calls: list[str] = []
    depth = 0
    for line in trace.splitlines():
        parts = line.split("\x1f")
        if len(parts) != 3:
            continue
        frame, event, arg = parts
        code = frame.rsplit("code ", 1)[-1].rstrip(">")
        if depth == 0:
            if event == "call" and code == "_on_signal":
                depth = 1
                calls.append("PreemptionWatcher._on_signal")
        elif event == "call":
            depth += 1
            calls.append(code)
        elif event == "return":
            depth -= 1
        elif event == "c_call":
            m = _BUILTIN.match(arg)
            calls.append(m.group(1) if m else arg)
    return calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--signals", default="SIGTERM,SIGUSR1")
    ap.add_argument("--handle-sigint", action="store_true")
    ap.add_argument("--step-seconds", type=float, default=0.005)
    ap.add_argument("--max-seconds", type=float, default=20.0)
    ap.add_argument("--trace-handler", action="store_true")
    args = ap.parse_args()

    preemption = load_preemption()
    # An interactive Python has this for SIGINT; a child of a non-interactive shell may have
    # inherited SIG_IGN instead. Make "SIGINT not handled by the watcher" mean KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    watcher = preemption.PreemptionWatcher(
        signals=args.signals.split(",") if args.signals else [],
        handle_sigint=args.handle_sigint,
    )
    trace = io.StringIO()
    profile = functools.partial(print, sep="\x1f", file=trace) if args.trace_handler else None
    watched = {getattr(signal, n) for n in watcher.config.signals}
    step = 0
    try:
        with watcher:
            if profile is not None:
                signal.pthread_sigmask(signal.SIG_BLOCK, watched)
                sys.setprofile(profile)
            print(json.dumps({"event": "ready", "signals": watcher.installed_signals}), flush=True)
            deadline = time.monotonic() + args.max_seconds
            while time.monotonic() < deadline:
                if watcher.requested:  # the step boundary: the only place we react
                    sys.setprofile(None)
                    req = watcher.request
                    print(
                        json.dumps(
                            {
                                "event": "preempted",
                                "source": req.source,
                                "signum": req.signum,
                                "grace_s": req.grace_s,
                                "step": step,
                                "count": watcher.count,
                                "handler_calls": handler_calls(trace.getvalue()),
                                "torch_imported": "torch" in sys.modules,
                            }
                        ),
                        flush=True,
                    )
                    return PREEMPTED_EXIT
                time.sleep(args.step_seconds)  # the "training step"
                step += 1
                if profile is not None:  # pending signals are handled inside the first call
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
                    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    except KeyboardInterrupt:
        sys.setprofile(None)
        print(json.dumps({"event": "keyboardinterrupt", "requested": watcher.requested}))
        return 130
    return 3


if __name__ == "__main__":
    sys.exit(main())
