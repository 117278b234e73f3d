"""The trainer internals the Lightning callback wraps for one ``fit`` (Lightning 2.x), on the
trainer instance, and their unwrapping at ``teardown``:

- ``_checkpoint_connector.resume_start`` (where Lightning loads ``ckpt_path``): the callback
  constructs its ``Checkpointer`` and restores there;
- ``_checkpoint_connector.restore_lr_schedulers`` (where Lightning loads the schedulers'
  states): the callback compares their settings with the checkpoint's first;
- ``fit_loop._load_combined_loader_states`` (where Lightning restores the train dataloaders,
  after it built them and before it iterates them): the callback makes them resumable first;
  and ``fit_loop.setup_data`` (which does that): after it, a resumed epoch's length is set;
- ``fit_loop.epoch_loop.val_loop.increment_progress_to_evaluation_end``: run with the random
  streams isolated (see :func:`wrap_fit`);
- ``fit_loop.epoch_loop.val_loop.setup_data`` (before each validation creates its loaders'
  iterators): the callback takes the random streams before a validation run only because
  training stops, and adjusts the val loaders it built;
- ``fit_loop.epoch_loop.on_advance_end`` (a training batch's validation, step-interval plateau
  schedulers and bookkeeping) and ``fit_loop.on_advance_end`` (the epoch-end hooks and
  epoch-interval plateau schedulers): a step is saved once Lightning finished its work;
- ``fit_loop.on_advance_start`` (the epoch-start hooks) and ``fit_loop.epoch_loop.on_run_start``
  (where a new epoch's dataloader iterators are made): a resume from an epoch's end runs the
  hooks and makes the iterators as the uninterrupted run does;
- ``fit_loop.run`` (which Lightning leaves at once when ``max_steps`` is reached) and
  ``fit_loop.on_run_end`` (the ``on_train_end`` hooks): a resumed ``fit()`` that trains
  nothing ends as the uninterrupted run did after the restored step.

Which ranks call what: every rank wraps its own trainer in ``setup`` (Lightning runs every hook
on every rank); nothing here runs a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.seed import isolate_rng


@dataclass(frozen=True)
class FitHooks:
    """What the callback runs at the wrapped internals (see :func:`wrap_fit`)."""

    resume_start: Callable[[Any, Any, Any], None]
    """``(original, checkpoint_path, weights_only)``, instead of ``resume_start``
    (``original`` is Lightning's, to call for what the callback does not handle)."""
    before_lr_schedulers: Callable[[], None]
    """Before Lightning loads the restored LR schedulers' states."""
    before_loader_states: Callable[[], None]
    """Before Lightning restores the train dataloaders' states."""
    after_setup_data: Callable[[], None]
    """After ``fit_loop.setup_data`` (the train loaders built, their states loaded)."""
    before_val_setup: Callable[[], None]
    """Before the validation loop sets up its dataloaders (a validation of the fit starts)."""
    after_val_setup: Callable[[], None]
    """After the validation loop set up its dataloaders."""
    after_batch: Callable[[], None]
    """After a training batch's ``on_advance_end`` (its validation, plateau schedulers)."""
    before_epoch_start: Callable[[], None]
    """Before ``fit_loop.on_advance_start`` (where the epoch-start hooks run)."""
    before_epoch_run: Callable[[], None]
    """Before ``fit_loop.epoch_loop.on_run_start`` (an epoch's first batch follows)."""
    before_epoch_end: Callable[[], None]
    """Before ``fit_loop.on_advance_end`` (the epoch-end hooks and plateau schedulers)."""
    after_epoch_end: Callable[[], None]
    """After ``fit_loop.on_advance_end``."""
    before_run_end: Callable[[], None]
    """Before ``fit_loop.on_run_end`` (where the ``on_train_end`` hooks run)."""
    after_run: Callable[[], None]
    """After ``fit_loop.run`` (also when Lightning skipped the loop: ``max_steps`` reached)."""


def wrap_fit(trainer: pl.Trainer, hooks: FitHooks) -> list[Callable[[], None]]:
    """Wrap the internals of ``trainer`` to run ``hooks``. Returns the functions that unwrap
    them (each removes only its own wrapper), in the order they were wrapped."""
    unwrap: list[Callable[[], None]] = []
    conn = trainer._checkpoint_connector
    original_resume = conn.resume_start

    def call_original(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        # resume_start has no weights_only before Lightning 2.6 (where None is its default)
        if weights_only is None:
            original_resume(checkpoint_path)
        else:
            original_resume(checkpoint_path, weights_only)

    def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        hooks.resume_start(call_original, checkpoint_path, weights_only)

    conn.resume_start = resume_start  # type: ignore[method-assign]
    unwrap.append(lambda: _unwrap(conn, "resume_start", resume_start))

    unwrap.append(_around(conn, "restore_lr_schedulers", before=hooks.before_lr_schedulers))
    fit_loop = trainer.fit_loop
    unwrap.append(
        _around(fit_loop, "_load_combined_loader_states", before=hooks.before_loader_states)
    )
    unwrap.append(_around(fit_loop, "setup_data", after=hooks.after_setup_data))

    # On a restart Lightning may fast-forward the validation progress of the step it
    # resumes at; doing so creates a val dataloader iterator, which draws a seed from the
    # global RNG where the uninterrupted run drew none. Keep the random streams out of it.
    val_loop = fit_loop.epoch_loop.val_loop
    original_ff = val_loop.increment_progress_to_evaluation_end

    def fast_forward() -> None:
        with isolate_rng():
            original_ff()

    val_loop.increment_progress_to_evaluation_end = fast_forward  # type: ignore[method-assign]
    unwrap.append(lambda: _unwrap(val_loop, "increment_progress_to_evaluation_end", fast_forward))

    unwrap.append(
        _around(val_loop, "setup_data", before=hooks.before_val_setup, after=hooks.after_val_setup)
    )
    unwrap.append(_around(fit_loop.epoch_loop, "on_advance_end", after=hooks.after_batch))
    unwrap.append(_around(fit_loop, "on_advance_start", before=hooks.before_epoch_start))
    unwrap.append(_around(fit_loop.epoch_loop, "on_run_start", before=hooks.before_epoch_run))
    unwrap.append(
        _around(
            fit_loop, "on_advance_end", before=hooks.before_epoch_end, after=hooks.after_epoch_end
        )
    )
    unwrap.append(_around(fit_loop, "on_run_end", before=hooks.before_run_end))
    unwrap.append(_around(fit_loop, "run", after=hooks.after_run))
    return unwrap


def _around(
    obj: Any,
    name: str,
    before: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """Wrap ``obj.name(...)`` to call ``before()`` first and ``after()`` last (not when it
    raises); return what unwraps it."""
    original = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> None:
        if before is not None:
            before()
        original(*args, **kwargs)
        if after is not None:
            after()

    setattr(obj, name, wrapped)
    return lambda: _unwrap(obj, name, wrapped)


def persistent_val_loaders(trainer: pl.Trainer) -> list[Any]:
    """The validation dataloaders of the fit that keep their workers (one iterator for the
    whole fit), as far as they are built."""
    combined = trainer.fit_loop.epoch_loop.val_loop._combined_loader
    loaders = list(combined.flattened) if combined is not None else []
    return [
        dl
        for dl in loaders
        if getattr(dl, "persistent_workers", False) and getattr(dl, "num_workers", 0) > 0
    ]


def seed_val_loaders_aside(trainer: pl.Trainer) -> None:
    """The validation loop built its loaders, resumed where the run's persistent validation
    iterators existed (only reset since, without a draw): the first ones made now take their
    base seeds from a throwaway generator (a global RNG draw would shift the run)."""
    for dl in persistent_val_loaders(trainer):
        if dl._iterator is None and dl.generator is None:
            dl.generator = torch.Generator().manual_seed(0)


def _unwrap(obj: Any, name: str, ours: Any) -> None:
    """Remove our wrapper ``ours`` of ``obj.name`` (the class's method shows again), unless
    something replaced it since."""
    if obj.__dict__.get(name) is ours:
        del obj.__dict__[name]
