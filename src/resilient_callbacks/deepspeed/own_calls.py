"""``engine.load_checkpoint`` and ``engine.save_checkpoint`` aimed at our directory.

Our directory is not DeepSpeed's: its advisory ``latest`` file names our newest checkpoint,
which ``engine.load_checkpoint(dirpath)`` then took for one of its own tags and failed on with
a bare ``AssertionError``. That call is refused with a :class:`ConfigError` that says where the
restore already happened and how to pick another step. ``engine.save_checkpoint(dirpath)``
works but overwrites ``latest`` and mixes DeepSpeed's pickled tags into the directory: it goes
on, with a warning (once) to give it a directory of its own. Calls on any other directory go
to DeepSpeed unchanged.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import AT_CALLER, ConfigError, warn_and_log

log = logging.getLogger("resilient_callbacks")


def same_dir(path: Any, dirpath: str) -> bool:
    """Whether ``path`` names ``dirpath`` (local paths resolved; URLs compared as text)."""
    if path is None:
        return False
    a, b = os.fspath(path), os.fspath(dirpath)
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


class OwnCalls:
    """Wraps ``engine.load_checkpoint`` and ``engine.save_checkpoint`` (instance attributes,
    like the handle's ``step``) for the handle whose Checkpointer writes ``dirpath``."""

    def __init__(self, engine: Any, dirpath: str) -> None:
        self.engine, self.dirpath = engine, dirpath
        # where dirpath and resume were given: rcds.attach's keywords (attach() sets it), or
        # the config's section
        self.attached = False
        self.warned = False
        self._load, self._save = engine.load_checkpoint, engine.save_checkpoint
        engine.load_checkpoint = self._on_load
        engine.save_checkpoint = self._on_save

    def _on_load(self, load_dir: Any, *args: Any, **kwargs: Any) -> Any:
        if same_dir(load_dir, self.dirpath):
            when, resume = (
                ("rcds.attach() was called", "pass resume= to rcds.attach()")
                if self.attached
                else ("the engine was made", 'set "resume" in the section')
            )
            raise ConfigError(
                f"engine.load_checkpoint({os.fspath(load_dir)!r}): that is resilient_callbacks' "
                f"checkpoint directory ({self._where()}), not a DeepSpeed one: its "
                f"checkpoints are read by the restore, which already ran when {when} "
                f"(engine.global_steps is {self.engine.global_steps}). To start from "
                f"another of its checkpoints, {resume} (a step number or a "
                "checkpoint's path); for DeepSpeed's own checkpoints use another directory"
            )
        return self._load(load_dir, *args, **kwargs)

    def _on_save(self, save_dir: Any, *args: Any, **kwargs: Any) -> Any:
        if same_dir(save_dir, self.dirpath) and not self.warned:
            self.warned = True
            warn_and_log(
                log,
                f"engine.save_checkpoint({os.fspath(save_dir)!r}) writes DeepSpeed's checkpoint "
                f"into resilient_callbacks' directory ({self._where()}): it overwrites the "
                "directory's `latest` file and leaves DeepSpeed's pickled tags beside our "
                "checkpoints, which DeepSpeed's load_checkpoint then cannot tell apart. The "
                "run is checkpointed already; give save_checkpoint a directory of its own",
                UserWarning,
                stacklevel=AT_CALLER,
            )
        return self._save(save_dir, *args, **kwargs)

    def _where(self) -> str:
        return "rcds.attach()'s dirpath" if self.attached else "the section's dirpath"

    def unwrap(self) -> None:
        for name, ours in (("load_checkpoint", self._on_load), ("save_checkpoint", self._on_save)):
            if self.engine.__dict__.get(name) == ours:
                del self.engine.__dict__[name]
