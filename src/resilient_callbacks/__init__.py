"""resilient_callbacks: fault-tolerant checkpointing for PyTorch training.

One object gives a training loop atomic, verified, pickle-free checkpoints, retention that never
deletes the wrong thing, and exact auto-resume::

    from resilient_callbacks import Checkpointer

    ckpt = Checkpointer("ckpts/run1", every_n_steps=100, keep_last=3)
    start = ckpt.restore(state)
    for step in range(start, total):
        ...
        ckpt.step(step + 1, state, metrics={"loss": loss.item()})
    ckpt.close()

This package imports no training framework; adapters live in their own modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import resilient_callbacks_ds_guard  # noqa: F401  (stdlib only; see that module)

from ._version import __version__
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CollectiveError,
    ConfigError,
    ForeignCheckpointsWarning,
    NoValidCheckpointError,
    RemoteDeleteRefusedError,
    RemoteUnavailableError,
    RemoteWaitPreemptedError,
    ResumeFallbackWarning,
    UnknownOptionError,
    UnsafeManifestError,
    UnsupportedStateError,
    UploadIncompleteError,
)

# The rest imports torch: loaded on first use (PEP 562), so `resilient-ckpt --help`, the errors
# and the version cost no torch import.
_LAZY = {
    "AdaptiveSchedule": "adaptive",
    "LossJumpTrigger": "adaptive",
    "RESUMABLE_EXIT_CODE": "checkpointer",
    "Checkpointer": "checkpointer",
    "SaveStats": "checkpointer",
    "ResumableDataLoader": "data",
    "ResumableSampler": "data",
    "MetadataPoller": "preemption",
    "PreemptionRequest": "preemption",
    "PreemptionWatcher": "preemption",
    "PerRank": "state_marks",
}

if TYPE_CHECKING:
    from .adaptive import AdaptiveSchedule, LossJumpTrigger
    from .checkpointer import RESUMABLE_EXIT_CODE, Checkpointer, SaveStats
    from .data import ResumableDataLoader, ResumableSampler
    from .preemption import MetadataPoller, PreemptionRequest, PreemptionWatcher
    from .state_marks import PerRank


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient_callbacks' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "RESUMABLE_EXIT_CODE",
    "AdaptiveSchedule",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "Checkpointer",
    "CollectiveError",
    "ConfigError",
    "ForeignCheckpointsWarning",
    "LossJumpTrigger",
    "MetadataPoller",
    "NoValidCheckpointError",
    "PerRank",
    "PreemptionRequest",
    "PreemptionWatcher",
    "RemoteDeleteRefusedError",
    "RemoteUnavailableError",
    "RemoteWaitPreemptedError",
    "ResumableDataLoader",
    "ResumableSampler",
    "ResumeFallbackWarning",
    "SaveStats",
    "UnknownOptionError",
    "UnsafeManifestError",
    "UnsupportedStateError",
    "UploadIncompleteError",
    "__version__",
]
