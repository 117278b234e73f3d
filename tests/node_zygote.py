"""A pre-started "node" for the multi-node tests (a helper, not a test module).

Starting Python and importing torch and s3fs takes seconds of CPU per process; the multi-node
tests start two processes per run, many runs per test. This process pays the imports once and
then, for every JSON line ``{"env": {...}, "argv": [...], "log": path}`` read from stdin, forks a
fresh process that runs ``train_script.main(argv)`` with exactly that environment, its stdout and
stderr going to ``log``, in a session of its own. It answers each line with the child's pid.
When the child returns, it writes its exit status to ``<log>.rc``; a child killed by a signal
leaves no such file. Nothing of the library is set up before the fork (no process group, no
thread, no file handle): each child is a fresh training process, only its imports are shared.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import s3fs  # noqa: F401
import torch
import torch._dynamo  # noqa: F401  (the optimizers' constructors import it: seconds)

# the modules the library imports lazily, so that no child imports them again
import resilient_callbacks.node_restore
import resilient_callbacks.node_session
import resilient_callbacks.peers
import resilient_callbacks.remote
import resilient_callbacks.remote_commit  # noqa: F401
import train_script


def _child(req: dict) -> None:
    rc = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["train_script.py", *req["argv"]]
        rc = train_script.main(req["argv"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            with open(req["log"] + ".rc", "w") as f:
                f.write(str(rc))
        finally:
            os._exit(rc)


def main() -> None:
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # fork keeps only this thread: another one's locks could stay taken
        print(f"node_zygote: {threads} threads after the imports (set OMP_NUM_THREADS=1)")
        sys.exit(2)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(pid, flush=True)
    os._exit(0)  # stdin closed: the test is done (skip the interpreter's slow teardown)


if __name__ == "__main__":
    main()
