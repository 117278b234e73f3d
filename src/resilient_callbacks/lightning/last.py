"""``fit(ckpt_path="last")`` next to ``ResilientCheckpoint``.

``ckpt_path="last"`` is Lightning's way to resume from the newest checkpoint: it picks, by
modification time, among the ``last*.ckpt`` files of the Trainer's ``ModelCheckpoint``\\ s and
the file of an ``OnExceptionCheckpoint``. It knows nothing of ours, which are written as often
or more, and which resume exactly (Lightning's files hold no random streams). So a script that
keeps ``fit(ckpt_path="last")`` with a ``ModelCheckpoint(save_last=True)`` resumed, after each
kill, from Lightning's file: not exactly (silently when that file was of the same step as our
newest), or from an older step. A path Lightning's ``"last"`` can pick is taken to mean "the
newest checkpoint": when our newest committed checkpoint in ``dirpath`` is of that file's step or
later (read from the file with ``weights_only``; where it cannot be, written no earlier, the
one rule Lightning applies among its own candidates), the fit resumes from ours, as without
``ckpt_path``. Any other path (``"best"``, a file named) wins as before.

Every rank calls :func:`prefers_ours` and gets global rank 0's answer (one collective when a
process group is up).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from .. import catalog, dist
from ..manifest import MANIFEST_NAME
from . import checks, refit


def _last_files(trainer: Any) -> set[str]:
    """The files Lightning's ``ckpt_path="last"`` chooses among."""
    found: set[str] = set()
    for cb in checks.callbacks(trainer):
        if isinstance(cb, ModelCheckpoint):
            found |= set(cb._find_last_checkpoints(trainer))
        elif isinstance(cb, OnExceptionCheckpoint):
            found.add(cb.ckpt_path)
    return {os.path.realpath(p) for p in found if p}


def _step_of(path: str) -> int | None:
    """The ``global_step`` in Lightning's file, read without unpickling anything but plain
    values (``weights_only``); ``None`` when it cannot be read so."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # an older format, or objects weights_only refuses
        return None
    step = loaded.get("global_step") if isinstance(loaded, dict) else None
    return step if isinstance(step, int) else None


def _newer_of_ours(path: str, dirpath: str) -> str | None:
    """Our newest committed checkpoint in ``dirpath`` if it is as new as ``path``: of the same
    step or later (Lightning's ``ModelCheckpoint`` writes a ``last.ckpt`` in ``on_train_end``
    of a fit in which it saved nothing, after our final checkpoint of that step), or, where
    the file's step cannot be read, written no earlier."""
    entries = [e for e in catalog.scan(dirpath) if e.status is catalog.Status.VALID]
    if not entries:
        return None
    newest = entries[-1]
    theirs = _step_of(path)
    if theirs is not None and newest.step is not None:
        return newest.path if newest.step >= theirs else None
    try:
        ours_time = os.path.getmtime(os.path.join(newest.path, MANIFEST_NAME))
        theirs_time = os.path.getmtime(path)
    except OSError:
        return None
    return newest.path if ours_time >= theirs_time else None


def prefers_ours(trainer: Any, checkpoint_path: Any, dirpath: str) -> bool:
    """Every rank, at ``fit()``'s checkpoint loading with ``ckpt_path`` given (resolved by
    Lightning): True if it is a file Lightning's ``"last"`` picks and ours in ``dirpath`` is as
    new, said on rank 0; then the fit resumes from ours."""
    newest = None
    if refit.fitted_here(trainer, dirpath):
        return False  # a later stage of this process: "last" is the earlier stage's end
    if dist.rank() == 0:
        path = os.path.realpath(os.fspath(checkpoint_path))
        if path in _last_files(trainer):
            newest = _newer_of_ours(path, dirpath)
    newest = dist.broadcast_json(newest)
    if newest is None:
        return False
    rank_zero_info(
        f"ResilientCheckpoint: fit(ckpt_path=...) is Lightning's last checkpoint, "
        f"{os.fspath(checkpoint_path)}; {newest} is at least as new and resumes exactly: "
        "resuming from ours (name another file than a last one to load it instead)"
    )
    return True
