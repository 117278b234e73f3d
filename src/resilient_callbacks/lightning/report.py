"""The resume message, said where a Lightning user looks.

Lightning reports its own restore ("Restoring states from the checkpoint path at ...") with
``rank_zero_info`` through the ``lightning.pytorch`` loggers, which print INFO by default; the
adapter says its resume the same way: the checkpoint, its step and epoch, its tier (the local
copy, or the remote copy it downloaded) and every newer checkpoint it skipped, and why.

What the core did while restoring (fallbacks, a download) is read from its log records.
"""

from __future__ import annotations

import logging
from typing import Any

CORE_LOGGER = "resilient_callbacks"
_SKIP = "skipping checkpoint "
_REMOTE = "restoring from the remote copy "


class RestoreWatch(logging.Handler):
    """While active, collects the core's restore reports: skipped checkpoints, a download."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.skipped: list[str] = []
        self.remote: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(_SKIP):
            self.skipped.append(msg[len(_SKIP) :].split("; falling back")[0])
        elif msg.startswith(_REMOTE):
            self.remote = msg[len(_REMOTE) :]

    def __enter__(self) -> RestoreWatch:
        logging.getLogger(CORE_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger(CORE_LOGGER).removeHandler(self)


def resumed(path: str, step: int, where: str, watch: RestoreWatch) -> str:
    """``ResilientCheckpoint: resumed at step N (where) from <path> (local copy)[; skipped ...]``"""
    tier = f"remote copy {watch.remote}, downloaded" if watch.remote else "local copy"
    msg = f"ResilientCheckpoint: resumed at step {step} ({where}) from {path} ({tier})"
    if watch.skipped:
        msg += "; skipped newer checkpoint(s): " + "; ".join(watch.skipped)
    return msg
