"""One writer per checkpoint directory.

The coordinator of a run holds an exclusive ``flock`` on ``<dirpath>/.lock`` for the lifetime of
its :class:`~resilient_callbacks.Checkpointer`. A second writer gets a clear error naming the
holder instead of interleaving files. The lock dies with its process (SIGKILL included), so a
crashed run never leaves the directory locked.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from .errors import CheckpointLockedError

LOCK_NAME = ".lock"


class DirLock:
    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            try:
                with open(self.path) as f:
                    info = json.loads(f.read() or "{}")
                holder = f" (held by pid {info.get('pid')} on {info.get('host')} since {info.get('since')})"
            except (OSError, ValueError):
                pass
            os.close(fd)
            if f"pid {os.getpid()} on {socket.gethostname()}" in holder:
                raise CheckpointLockedError(
                    f"this process already has an open Checkpointer on {os.path.dirname(self.path)}"
                    f"{holder}; close() it (or use `with Checkpointer(...)`) before opening another"
                ) from None
            raise CheckpointLockedError(
                f"another process is writing checkpoints to {os.path.dirname(self.path)}{holder}. "
                "Two runs must not share a checkpoint directory: give this run its own dirpath, "
                "or stop the other run first."
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
