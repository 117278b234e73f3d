"""Fits that are not the run's (``fast_dev_run``, the ``Tuner``'s), and Lightning's tuner next
to the callback: ``Tuner(trainer).lr_find(...)`` /
``.scale_batch_size(...)`` before ``fit()``, and the ``LearningRateFinder`` /
``BatchSizeFinder`` callbacks in ``fit()``.

A finder saves the trainer to a file of its own (``trainer.save_checkpoint``), trains or
validates a few trial steps (with ``trainer.callbacks`` replaced by its own: ours sees none of
them) and restores that file through ``_checkpoint_connector.restore``, whose
``resume_start`` the callback wraps. That restore is the finder's, not the fit's resume
point (the callback passes it on to Lightning as it is). The ``Tuner`` runs its finder in a
``fit()`` of its own, ended at the finder's ``on_fit_start`` (``_TunerExitException``): in it
the callback neither resumes nor saves, so the tuning runs as in the uninterrupted run (on
fresh weights) and the ``fit()`` that follows resumes. A finder among the fit's callbacks runs
at every ``fit()``'s start, and its restore would load its own file over ours (fresh
optimizers, loops at step 0): at a resume from one of our checkpoints a ``LearningRateFinder``
is not run again (the uninterrupted run ran it once, at its start; the learning rate it set is
in the restored optimizers' state), and a ``BatchSizeFinder`` is refused (the batch size it
chose is kept nowhere: the ``Tuner``'s, before ``fit()``, resumes).

Every rank decides alike (each holds the same callbacks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.utilities import rank_zero_info

from ..errors import ConfigError
from .checks import callbacks


def _finders(trainer: Any) -> list[Any]:
    return [
        cb for cb in callbacks(trainer) if isinstance(cb, (LearningRateFinder, BatchSizeFinder))
    ]


def not_the_run(trainer: Any) -> str | None:
    """Why this ``fit()`` is not the run's, in words, or ``None``: ``fast_dev_run`` (Lightning:
    "Logging and checkpointing is suppressed"), or the ``Tuner``'s fit (a finder that ends the
    fit when done). The callback neither resumes nor saves in it."""
    if trainer.fast_dev_run:
        return "fast_dev_run"
    if any(getattr(cb, "_early_exit", False) for cb in _finders(trainer)):
        return "the Tuner's fit()"
    return None


def skip_at_resume(trainer: Any) -> list[Callable[[], None]]:
    """At a resume from one of our checkpoints: the ``LearningRateFinder`` callbacks'
    ``on_fit_start`` made a no-op for this ``fit()`` (returns the undo callables); a
    ``BatchSizeFinder`` raises :class:`ConfigError`."""
    undo: list[Callable[[], None]] = []
    for cb in _finders(trainer):
        if isinstance(cb, BatchSizeFinder):
            raise ConfigError(
                "a BatchSizeFinder among the fit()'s callbacks cannot resume: it searches again "
                "at every fit()'s start, on the restored state, and the batch size it chose "
                "for the run is kept nowhere. Run it before fit() instead, as "
                "Tuner(trainer).scale_batch_size(model, ...): that resumes exactly"
            )
        had = "on_fit_start" in vars(cb)
        before = vars(cb).get("on_fit_start")

        def restore(cb: Any = cb, had: bool = had, before: Any = before) -> None:
            if had:
                cb.on_fit_start = before
            else:
                vars(cb).pop("on_fit_start", None)

        cb.on_fit_start = _skipped
        undo.append(restore)
        rank_zero_info(
            f"ResilientCheckpoint: {type(cb).__name__} not run again at the resume: the run "
            "ran it at its start, and what it found is in the restored state"
        )
    return undo


def _skipped(*args: Any, **kwargs: Any) -> None:
    return None
