"""Lightning ``ModelCheckpoint`` files that an interrupted run wrote after the step a resume
restored.

A ``ModelCheckpoint`` next to ``ResilientCheckpoint`` keeps writing ``.ckpt`` files between our
last checkpoint and a kill. The resumed run restores the ``ModelCheckpoint``'s state as of our
checkpoint (its top-k list, last and best paths), which knows none of them: they stayed on
disk forever (beyond ``save_top_k``), and the resumed run, writing the same step again, found
the name taken and wrote ``epoch=0-step=7-v1.ckpt`` beside it, so ``best_model_path`` and the
top-k names differed from the uninterrupted run's.

So when a ``fit()`` resumed from the newest checkpoint starts (not from one chosen with
``resume=`` or ``fit(ckpt_path=...)``: a branch from an older step keeps the files), each ``ModelCheckpoint``'s files whose name holds a step
past the restored one (``step=N`` in the file name, as Lightning's default and most templates
have), that its restored state does not list, and that were written since the run began (its
first life's start: a file of another run that used the same folder before is older, and is
never touched; a filesystem that tells no modification time keeps every file) are removed, with
one line saying which. The
``ModelCheckpoint`` removes them itself (``_remove_checkpoint``: through the strategy, on
global rank 0, local or remote). A file name without ``step=`` is left alone.

Called on every rank at ``on_train_start`` (after Lightning restored the callbacks' states,
before any ``ModelCheckpoint`` save); only global rank 0 lists and removes.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

log = logging.getLogger("resilient_callbacks.lightning")

_STEP = re.compile(r"(?:^|[^A-Za-z0-9])step=(\d+)")


def remove_rolled_back(
    trainer: pl.Trainer, restored_step: int | None, run_start: float | None
) -> list[str]:
    """Remove the ``ModelCheckpoint`` files of steps after ``restored_step`` (the step this
    ``fit()`` resumed at; ``None``: a fresh start) written since ``run_start`` (the run's
    start, ``time.time()``; ``None``: nothing is removed, as for a checkpoint the user chose
    with ``resume=`` or ``ckpt_path=``, whose later files stay). Returns their paths."""
    if restored_step is None or run_start is None or not trainer.is_global_zero:
        return []
    removed: list[str] = []
    for cb in getattr(trainer, "callbacks", None) or []:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            removed += _remove(trainer, cb, restored_step, run_start)
    if removed:
        rank_zero_info(
            f"ResilientCheckpoint: resumed at step {restored_step}, so the ModelCheckpoint "
            f"file(s) the interrupted run wrote after it are removed (the resumed run writes "
            f"those steps again, under the same names): {', '.join(removed)}"
        )
    return removed


def _remove(
    trainer: pl.Trainer, cb: ModelCheckpoint, restored_step: int, run_start: float
) -> list[str]:
    fs: Any = cb._fs
    dirpath = str(cb.dirpath)
    try:
        if not fs.isdir(dirpath):
            return []
        paths = fs.ls(dirpath, detail=False)
    except OSError as e:  # a listing that fails changes nothing: Lightning's naming goes on
        log.warning("could not list the ModelCheckpoint directory %s: %s", dirpath, e)
        return []
    listed = (*cb.best_k_models, cb.best_model_path, cb.last_model_path, cb.kth_best_model_path)
    kept = {os.path.basename(str(p)) for p in listed if p}
    removed = []
    for path in sorted(str(p) for p in paths):
        name = os.path.basename(path.rstrip("/"))
        if not name.endswith(cb.FILE_EXTENSION) or name in kept:
            continue
        found = _STEP.search(name[: -len(cb.FILE_EXTENSION)])
        target = os.path.join(dirpath, name)
        if (
            found is not None
            and int(found.group(1)) > restored_step
            and _written_since(fs, target, run_start)
        ):
            cb._remove_checkpoint(trainer, target)
            removed.append(target)
    return removed


def _written_since(fs: Any, path: str, since: float) -> bool:
    """Whether ``path`` was last written at or after ``since`` (False when unknown)."""
    try:
        return bool(fs.modified(path).timestamp() >= since)
    except (OSError, NotImplementedError, AttributeError, ValueError):
        return False
