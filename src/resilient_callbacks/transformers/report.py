"""The resume message, said where a Trainer user looks.

The Trainer logs through the ``transformers`` logging tree, whose default verbosity is WARNING
(``transformers.logging.set_verbosity_*``, ``TRANSFORMERS_VERBOSITY``); its own "Continuing
training from checkpoint" is INFO and so is not shown by default. A resume decides what the run
trains, so the adapter says it at WARNING through ``transformers.trainer``, on the main process:
the checkpoint, its step and epoch position, its tier (the local copy, or the remote copy it
downloaded) and every newer checkpoint it skipped, and why.

What the core did while restoring (fallbacks, a download) is read from its log records.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers.utils import logging as hf_logging

CORE_LOGGER = "resilient_callbacks"
_SKIP = "skipping checkpoint "
_REMOTE = "restoring from the remote copy "

trainer_log = hf_logging.get_logger("transformers.trainer")


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


def resumed(path: str, step: int, where: str, watch: RestoreWatch, extra: str = "") -> str:
    """``ResilientCheckpoint: resumed at step N (where) from <path> (local copy)[; skipped ...]``"""
    tier = f"remote copy {watch.remote}, downloaded" if watch.remote else "local copy"
    msg = f"ResilientCheckpoint: resumed at step {step} ({where}) from {path} ({tier})"
    if watch.skipped:
        msg += "; skipped newer checkpoint(s): " + "; ".join(watch.skipped)
    return msg + extra
