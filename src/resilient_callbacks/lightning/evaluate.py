"""``trainer.validate()``/``test()``/``predict()`` with this callback's checkpoints.

A fit's ``ResilientCheckpoint`` takes the place of Lightning's default ``ModelCheckpoint``. The
usual script, ``trainer.fit(model, dm)`` then ``trainer.test(datamodule=dm)``, asks for the
``"best"`` checkpoint of that fit (no model given: Lightning's default); it raised
``ValueError: ... ModelCheckpoint is not configured to save the best model``. Now:

- after a fit in this process, ``best_model_path`` (in a validate/test/predict only, and only
  without a ``ModelCheckpoint``, whose best file it names otherwise) is this callback's
  checkpoint to evaluate: the best by ``monitor`` where ``keep_best`` ranks them, else the
  newest valid one (the fit's last step) -- as the default ``ModelCheckpoint``'s, the last;
- during a validate/test/predict, a ``ckpt_path`` that is one of this callback's checkpoint
  directories (that one, or one given explicitly) is loaded, read-only and verified, into
  Lightning's checkpoint dictionary: the weights and what ``on_load_checkpoint`` hooks read.
  The random streams are left as they were (a restore puts the checkpoint's back).

Under a sharded strategy (FSDP, tensor parallel, DeepSpeed) none of this applies: Lightning's
own handling stays (load such a run's weights with ``Checkpointer(read_only=True)``).

Which ranks call what: Lightning resolves the path and calls ``resume_start`` on every rank,
at the same point, so every rank opens the read-only ``Checkpointer`` (whose construction
checks the options across ranks) and restores the same checkpoint together.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from .. import branches, catalog, dist, rng
from ..catalog import Depth, Status
from ..checkpointer import Checkpointer
from ..errors import CheckpointNotFoundError
from ..manifest import MANIFEST_NAME
from . import checks, sharded
from . import state as st

EVALUATING = (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING)


def is_ours(path: Any) -> bool:
    """Whether ``path`` is a checkpoint directory of ours (it has a manifest)."""
    return bool(path) and os.path.isfile(os.path.join(os.fspath(path), MANIFEST_NAME))


def ours_on_every_rank(path: Any) -> bool:
    """Every rank, together: whether ``path`` is a checkpoint directory of ours (:func:`is_ours`)
    on every rank -- then every rank opens the read-only ``Checkpointer``, a collective -- or on
    none. Where the ranks disagree (a node-local directory present on some nodes only), each
    rank raises :class:`CheckpointNotFoundError` naming the ranks that lack it (only the ranks
    that saw it entered the collective, and the job hung)."""
    answers = [bool(a) for a in dist.all_gather_json(is_ours(path))]
    if all(answers) or not any(answers):
        return answers[0]
    lacking = [r for r, ours in enumerate(answers) if not ours]
    raise CheckpointNotFoundError(
        f"ckpt_path {os.fspath(path)!r} is a checkpoint directory with a manifest on rank(s) "
        f"{[r for r, ours in enumerate(answers) if ours]} but not on rank(s) {lacking}: every "
        "rank loads the same checkpoint, so it must be where every rank reads it (a shared "
        "filesystem, or a copy at the same path on each node)"
    )


def evaluated(
    dirpath: str,
    monitor: str | None,
    mode: str | None,
    latest: str | None,
    run_id: str | None = None,
) -> str:
    """The checkpoint an evaluation after the fit that saved into ``dirpath`` loads: the best
    valid one of its run (``run_id``; not another run's beside it) by ``monitor`` (``mode``
    "max" or "min"; as retention ranks them: of tied scores the earliest, and one of a branch
    a roll-back abandoned only after the current lineage's) where it is set, else ``latest`` (the newest valid one when the fit ended); "" when there is none."""
    if not monitor:
        return latest or ""
    sign = -1.0 if mode == "max" else 1.0
    mine = [
        (e, e.manifest)
        for e in catalog.committed(catalog.scan(dirpath, Depth.SIZE))
        if e.manifest is not None  # another run's (ForeignCheckpointsWarning), not this fit's:
        and (run_id is None or e.manifest.run_id == run_id)
    ]
    # as retention ranks them: the current lineage's first (a checkpoint of a branch a
    # roll-back abandoned is from a timeline the run threw away); of tied scores the earliest
    off = branches.off_lineage((m.run_id, e.seq, m.lineage) for e, m in mine)
    scored = []
    for e, m in mine:
        value = m.metrics.get(monitor)
        if e.status is Status.VALID and isinstance(value, (int, float)) and math.isfinite(value):
            scored.append(((m.run_id, e.seq) in off, sign * float(value), e.seq, e.path))
    return min(scored)[3] if scored else latest or ""


def wrap_resume_start(trainer: pl.Trainer) -> Any:
    """For this validate/test/predict: Lightning's ``resume_start`` loads a checkpoint of ours
    as described above. Returns the function that unwraps it."""
    conn = trainer._checkpoint_connector
    original = conn.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        if trainer.state.fn not in EVALUATING or sharded.is_sharded(trainer):
            return original(checkpoint_path, weights_only)
        if not ours_on_every_rank(checkpoint_path):
            return original(checkpoint_path, weights_only)
        path = os.path.abspath(os.fspath(checkpoint_path))
        holder = st.receivers()
        live = rng.capture()
        try:
            with Checkpointer(os.path.dirname(path), read_only=True, resume=path) as ckpt:
                ckpt.restore(holder)
        finally:
            rng.restore(*live)
        checkpoint = st.assemble(holder, trainer.lightning_module)
        checks.check_model_fits(trainer, checkpoint["state_dict"], path)
        conn._ckpt_path = path
        conn._loaded_checkpoint = checks.migrate(checkpoint, path)
        return None

    conn.resume_start = resume_start  # type: ignore[method-assign]

    def unwrap() -> None:
        if vars(conn).get("resume_start") is resume_start:
            del conn.resume_start

    return unwrap


def at_setup(cb: Any, trainer: pl.Trainer) -> None:
    """The callback's ``setup`` of a validate/test/predict: wrap ``resume_start`` till its
    ``teardown``."""
    cb._unpatch_all()
    cb._unpatch.append(wrap_resume_start(trainer))


def fit_ended(cb: Any, dirpath: str, latest: str | None, run_id: str | None) -> None:
    """A fit of ``cb`` (run ``run_id``) that saved into ``dirpath`` ended without an error, its
    newest valid checkpoint ``latest``: what a later evaluation's ``"best"`` is chosen from."""
    cb._evaluate_from = (dirpath, latest, run_id)


def best_path(cb: Any, trainer: Any) -> str:
    """``cb.best_model_path`` in a validate/test/predict after its fit (no ``ModelCheckpoint``
    in the trainer): the checkpoint to evaluate; "" otherwise."""
    after_fit = getattr(cb, "_evaluate_from", None)
    if trainer is None or after_fit is None or trainer.state.fn not in EVALUATING:
        return ""
    if sharded.is_sharded(trainer):
        return ""
    kwargs = cb._kwargs
    dirpath, latest, run_id = after_fit
    return evaluated(dirpath, kwargs.get("monitor"), kwargs.get("mode"), latest, run_id)
