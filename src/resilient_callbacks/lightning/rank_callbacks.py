"""Each rank's own callback states (and random streams before a stop's validation): saved in
its per-rank part, given back to it on resume.

Under DDP every rank runs every callback. A callback that goes by a metric each rank logs for
itself (``self.log(...)`` without ``sync_dist``: ``train_loss`` of the rank's own batches,
``val_loss`` of its own share of the validation set) keeps a state of its own on each rank:
``EarlyStopping``'s best score and wait count (Lightning stops when any rank's says so),
``ModelCheckpoint``'s best-k scores. Lightning's checkpoint dictionary holds the ``callbacks``
states of rank 0 only (its own checkpoints too); resumed from it, every rank took rank 0's,
and the run no longer stopped where the uninterrupted one did.

So each rank also saves its callbacks' states with its data position (the ``"data"`` entry,
``PerRank``), and a resume on the number of ranks that saved gives each rank its own. A state
holding more than :data:`MAX_BYTES` of tensors (``StochasticWeightAveraging``'s averaged model:
the same on every rank under DDP) is saved once, with rank 0's, as before. A checkpoint without
per-rank states (written by an earlier version) gives every rank rank 0's, as it did; so does a
resume on another number of ranks (the ranks' shares of the data differ), with a line saying so.

The random streams before the validation Lightning runs only because training stops
(:data:`STOP_RNG_KEY`, :func:`.stops.before_validation`) are each rank's too: they go the same
way, into Lightning's dictionary as this rank restores it.

Every rank, training thread; no collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from .. import dist

KEY = "callbacks"
STOP_RNG_KEY = "resilient_callbacks_rng_before_stop_validation"
WORLD_SIZE_KEY = "callbacks_world_size"
#: tensors (bytes) in a callback's state above which it is saved once, from rank 0
MAX_BYTES = 1 << 20


def saved(dump: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's entries of the ``"data"`` part: its callbacks' states, those of them whose
    tensors are small, from Lightning's checkpoint dictionary ``dump`` (not yet converted)."""
    out: dict[str, Any] = {WORLD_SIZE_KEY: dist.world_size()}
    if dump.get(STOP_RNG_KEY):
        out[STOP_RNG_KEY] = dump[STOP_RNG_KEY]
    states = dump.get("callbacks")
    if isinstance(states, Mapping):
        out[KEY] = {k: v for k, v in states.items() if _tensor_bytes(v) <= MAX_BYTES}
    return out


def put_back(checkpoint: dict[str, Any], data: Mapping[str, Any]) -> None:
    """Restoring: this rank's own callback states (from its ``"data"`` part) in place of rank
    0's in Lightning's ``checkpoint`` dictionary, when the checkpoint has them and was written
    by as many ranks as this run has; and its :data:`STOP_RNG_KEY`, if saved by this rank (a
    rank the checkpoint has no files of keeps fresh streams, as the core's restore does)."""
    saved_ranks, ranks = data.get(WORLD_SIZE_KEY), dist.world_size()
    if data.get(STOP_RNG_KEY) and isinstance(saved_ranks, int) and dist.rank() < saved_ranks:
        checkpoint[STOP_RNG_KEY] = data[STOP_RNG_KEY]
    own = data.get(KEY)
    if not isinstance(own, Mapping) or not own:
        return  # written by an earlier version (or no callbacks): rank 0's, as before
    if saved_ranks != ranks:
        if saved_ranks != 1:  # (a one-rank checkpoint had no other states)
            rank_zero_info(
                f"ResilientCheckpoint: the checkpoint was written by {saved_ranks} ranks, this "
                f"run has {ranks}: every rank's callbacks resume with rank 0's states "
                "(EarlyStopping, ModelCheckpoint, ...); on the same number of ranks each rank "
                "resumes its own"
            )
        return
    checkpoint["callbacks"] = {**(checkpoint.get("callbacks") or {}), **own}


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_tensor_bytes(v) for v in obj)
    if callable(getattr(obj, "state_dict", None)):
        return MAX_BYTES + 1  # an object saving its own state: once, as before
    return 0
