"""``TrainingArguments(auto_find_batch_size=True)``: a resume continues at the batch size the run
had found.

With ``auto_find_batch_size`` the Trainer runs ``_inner_training_loop`` through accelerate's
``find_executable_batch_size``: it starts at ``per_device_train_batch_size`` and, after each
out-of-memory error, runs the loop again at 90% of the size. A run that had lowered its size
(16 to 14) and is started again starts at 16: its loader, its epoch length and what a batch index
means all differ from the checkpoint's. The Trainer's own ``train(resume_from_checkpoint=...)``
sets the checkpoint's size before the loop; this callback restores inside the loop
(``on_train_begin``), after the loader was built at the starting size.

So the callback wraps ``_inner_training_loop`` on the Trainer instance (at ``on_init_end``, or in
``attach``). When the checkpoint to resume from was written at a smaller size, ``on_train_begin``
raises :class:`Restart` (nothing was trained yet), and the wrapper runs the loop again at that
size, as the Trainer itself does after an out-of-memory error. The loop rebuilds the loader,
optimizer and scheduler, and the restore puts the checkpoint into them exactly. Before the
restore, :func:`check_ahead` reads the size from the small structure file of the checkpoint to
load (the newest valid, or the step or path ``resume`` names), so no restore is made and recorded
twice; :func:`check`, after the restore, decides where that could not tell (a remote copy, a
fallback to an older checkpoint).

Ranks: rank 0 reads ahead and broadcasts what it found; every rank restores the same checkpoint.
So every rank raises :class:`Restart` at the same point and runs the loop again at the same size.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .. import dist, layout, notices, reader
from ..catalog import Depth
from ..errors import CheckpointMismatchError
from . import hooks
from .trainer_state import FORMAT

log = logging.getLogger("resilient_callbacks")

LOOP = "_inner_training_loop"
# what the batch size changes, and the dataset's length (data_settings takes it at an epoch's end)
_DERIVED = ("per_device_batch_size", "steps_in_epoch", "num_samples")


class Restart(Exception):
    """Raised in ``on_train_begin``: run the training loop again at ``batch_size``."""

    def __init__(self, batch_size: int, step: int) -> None:
        super().__init__(f"restart the training loop at batch size {batch_size} (step {step})")
        self.batch_size = batch_size
        self.step = step


class _LoopAtSavedSize:
    """Wraps ``Trainer._inner_training_loop``: runs it again at the size a :class:`Restart`
    names, and never at a larger size afterwards (accelerate's own counter still starts at the
    starting size after an out-of-memory error)."""

    def __init__(self) -> None:
        self.ceiling: int | None = None

    def __call__(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        bound = hooks.bind_arguments(original, args, kwargs)
        while True:
            size = bound.arguments.get("batch_size")
            if self.ceiling is not None and size is not None and size > self.ceiling:
                bound.arguments["batch_size"] = self.ceiling
            try:
                return original(*bound.args, **bound.kwargs)
            except Restart as restart:
                notices.log_once(  # (the same on every rank: said once, on rank 0)
                    log,
                    "ResilientCheckpoint: the checkpoint of step %d was written at per-device "
                    "batch size %d (auto_find_batch_size had lowered it from %s); the training "
                    "loop starts again at %d to resume it exactly",
                    restart.step,
                    restart.batch_size,
                    bound.arguments.get("batch_size"),
                    restart.batch_size,
                )
                self.ceiling = restart.batch_size
                bound.arguments["batch_size"] = restart.batch_size


def install(trainer: Any) -> None:
    """Wrap the loop of a Trainer that finds its batch size (once; nothing otherwise)."""
    if not getattr(trainer.args, "auto_find_batch_size", False) or installed(trainer):
        return
    if callable(getattr(trainer, LOOP, None)):
        hooks.wrap(trainer, LOOP, _LoopAtSavedSize())


def installed(trainer: Any) -> bool:
    return isinstance(getattr(trainer.__dict__.get(LOOP), "_rc_wrapper", None), _LoopAtSavedSize)


def check(trainer: Any, values: Mapping[str, Any], signature: Mapping[str, Any], step: int) -> None:
    """Every rank, after restoring ``step``: raise :class:`Restart` when ``auto_find_batch_size``
    had lowered the batch size before the checkpoint was written and this loop started above it.
    Any other difference is left to :mod:`.data_settings` (a restore at the lowered size, with
    another dataset length, goes on from an epoch's end over the new data)."""
    if not getattr(trainer.args, "auto_find_batch_size", False) or values.get("format") != FORMAT:
        return
    saved_data = values["data"]
    saved, now = saved_data.get("per_device_batch_size"), signature["per_device_batch_size"]
    if not isinstance(saved, int) or saved >= now:
        return
    if any(saved_data.get(k) != v for k, v in signature.items() if k not in _DERIVED):
        return
    if not installed(trainer):
        raise CheckpointMismatchError(
            f"the checkpoint of step {step} was written at per-device batch size {saved}, to "
            f"which auto_find_batch_size had lowered it; this run started at {now}, and a "
            "callback added with trainer.add_callback() sees the run too late to start it at "
            f"{saved}. Pass it as Trainer(callbacks=[cb]), or call cb.attach(trainer) before "
            "train(), and it resumes at that size."
        )
    raise Restart(saved, step)


def check_ahead(trainer: Any, ckpt: Any, signature: Mapping[str, Any]) -> None:
    """Every rank, before the restore (a collective when ``auto_find_batch_size`` is on): raise
    :class:`Restart` as :func:`check` would for the newest valid checkpoint in dirpath, read
    by rank 0 (its structure file only, verified)."""
    if not getattr(trainer.args, "auto_find_batch_size", False) or not installed(trainer):
        return
    seen = dist.broadcast_json(
        newest_values(ckpt.dirpath, ckpt.config.resume) if ckpt.is_coordinator else None
    )
    if seen is not None:
        check(trainer, seen[1], signature, seen[0])


def newest_values(dirpath: str, resume: Any) -> tuple[int, Any] | None:
    """(step, the Trainer values) of the checkpoint a restore of ``dirpath`` with ``resume``
    loads first, when it is a valid local one (the newest, the step ``resume`` names, or the
    checkpoint path it names: ``reader.select``, sizes checked); None where that cannot be told
    cheaply (a remote copy, none there)."""
    where, step = dirpath, None
    if isinstance(resume, int):
        step = resume
    elif str(resume) == "never":
        return None
    elif str(resume) != "auto":  # the path of one checkpoint
        where = resume
    try:
        sel = reader.select(where, step, depth=Depth.SIZE)
        shared = layout.read_json(sel.path, sel.manifest, layout.SHARED_STRUCTURE)
        return int(sel.manifest.step), shared["structure"]["trainer"]
    except Exception as e:  # (the restore reads it again, and says what is wrong)
        log.debug("could not read ahead: %s", e)
        return None
