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

__version__ = "0.1.0"

from .adaptive import AdaptiveSchedule, LossJumpTrigger
from .checkpointer import RESUMABLE_EXIT_CODE, Checkpointer, SaveStats
from .data import ResumableDataLoader, ResumableSampler
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
    ForeignCheckpointsWarning,
    NoValidCheckpointError,
    ResumeFallbackWarning,
    UnsafeManifestError,
    UnsupportedStateError,
)
from .preemption import MetadataPoller, PreemptionRequest, PreemptionWatcher
from .structure import PerRank

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
    "ConfigError",
    "ForeignCheckpointsWarning",
    "LossJumpTrigger",
    "MetadataPoller",
    "NoValidCheckpointError",
    "PerRank",
    "PreemptionRequest",
    "PreemptionWatcher",
    "ResumableDataLoader",
    "ResumableSampler",
    "ResumeFallbackWarning",
    "SaveStats",
    "UnsafeManifestError",
    "UnsupportedStateError",
    "__version__",
]
