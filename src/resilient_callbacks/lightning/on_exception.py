"""``save_on_exception`` for the Lightning callback: save the state of the last *completed* step
when ``fit()`` leaves with an exception.

An exception can come in the middle of a step: after the optimizer changed the weights but
before the step's bookkeeping ran, the live state matches no step. So at the end of every
completed step (one rank only; with several ranks the others could not join the save) the
callback remembers what changes *within* a step and cannot be recovered from the live objects:
the fit loop's progress, the random streams and the module's buffers. At the exception it saves
the live weights and optimizer with those, unless an optimizer step began its update since
(then the weights are those of a step that did not finish, perhaps half-updated by an update that
raised part-way, and nothing is saved: say so; an exception in the forward or backward pass,
inside the closure Lightning hands the optimizer, changed no weight and is saved), or a parameter
was written in place or replaced since (its version counter or address changed: a SAM-style
``first_step()`` or the user's own write in a manual-optimization ``training_step``, which no
``optimizer.step()`` hook sees; a write through ``p.data`` shows in neither and is not seen), or
the exception
came during a validation with Lightning's ``WeightAveraging``, whose averaged weights the model
holds then, or after a new epoch's start hooks changed the optimizers' parameter groups since an
epoch's last step (nothing saved either).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from .. import notices, rng
from ..checkpointer import Checkpointer
from ..inplace import same_value
from ..optimizer_steps import Entry, Follower
from ..param_watch import ParamVersion, ParamWatch, changed_params
from . import state as st
from .boundary import EPOCH_END_KEY

log = logging.getLogger("resilient_callbacks")


@dataclass
class _Boundary:
    """What the exception path needs to save the state of the last completed step."""

    step: int
    fit_loop: dict[str, Any]
    marks: dict[str, Any]
    rng_state: tuple[dict[str, Any], dict[str, torch.Tensor]]
    buffers: dict[str, torch.Tensor]
    epochs_ready: int  # the fit loop's epochs begun (their on_train_epoch_start hooks run)
    groups: Any  # at an epoch's end: the optimizers' parameter groups (:func:`_groups`)
    versions: list[ParamVersion]  # the parameters' version counters and addresses


class ExceptionSave:
    """The last completed step's boundary, and the save of it at an exception."""

    def __init__(self) -> None:
        self._boundary: _Boundary | None = None
        self._watch = ParamWatch()  # the parameters' list, kept between steps
        self._steps = Follower()  # the optimizers' step counts (optimizer_steps.py)
        self._marks: list[tuple[Entry, int]] = []  # their updates begun at the boundary

    @property
    def stepped(self) -> bool:
        """Whether an optimizer step began its update after the boundary (or the hooks)."""
        return any(entry.updates != n for entry, n in self._marks)

    def hook_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Notice optimizer steps after the boundary, from the moment the update may begin (a
        step that raised part-way counts: :func:`.optim.update_began`); :meth:`release` lets
        go of them."""
        self._marks = [(e, e.updates) for e in (self._steps.follow(o)[0] for o in optimizers)]

    def release(self) -> None:
        """Let go of the optimizers (their hooks removed where nothing else follows them)."""
        self._steps.release()
        self._marks = []

    def remember(
        self, trainer: pl.Trainer, step: int, fit_loop: dict[str, Any], marks: dict[str, Any]
    ) -> None:
        """End of a completed step (one rank): what a save of this step needs later;
        ``fit_loop``: the loop state saved for that step, ``marks``: what a save of it records
        besides (both not changed later)."""
        module = trainer.lightning_module
        self._boundary = _Boundary(
            step=step,
            fit_loop=fit_loop,
            marks=marks,
            rng_state=rng.capture(),
            buffers={name: b.detach().clone() for name, b in module.named_buffers()},
            epochs_ready=trainer.fit_loop.epoch_progress.total.ready,
            groups=_groups(trainer) if marks.get(EPOCH_END_KEY) else None,
            versions=self._watch.versions({"model": module, "optimizers": trainer.optimizers}),
        )
        self._marks = [(e, e.updates) for e, _ in self._marks]

    def save(
        self,
        ckpt: Checkpointer | None,
        ctx: st.SaveContext | None,
        state: dict[str, Any] | None,
        trainer: pl.Trainer,
        exception: BaseException,
    ) -> None:
        """Save the last completed step's state, or say why not."""
        b = self._boundary
        if ckpt is None or ctx is None or state is None or ckpt.closed:
            return
        if ckpt.world_size > 1:
            log.warning(  # (the exception this rank got: said by this rank, naming it)
                notices.on_this_rank(
                    "save_on_exception: not saving after %s with several ranks (the other "
                    "ranks cannot join the save); the newest checkpoint is the last periodic one"
                ),
                type(exception).__name__,
            )
            return
        if b is None:
            return
        if self.stepped:
            log.warning(
                "save_on_exception: %s came after the optimizer began updating the weights in a "
                "step that did not finish; the state matches no step, so nothing is saved",
                type(exception).__name__,
            )
            return
        changed = changed_params(b.versions)
        if changed:
            log.warning(
                "save_on_exception: %s came after %s was written in place since step %d, not by "
                "an optimizer.step() (a two-pass optimizer's first_step(), a write of your own "
                "in on_train_batch_start or in training_step before the optimizer's step); the "
                "state matches no step, so nothing is saved; the newest checkpoint is the last "
                "periodic one. A write of your own (weight normalisation, clamping) belongs to "
                "the step a save holds when it comes after the optimizer's step: in "
                "on_train_batch_end (with manual optimization also after opt.step() in "
                "training_step)",
                type(exception).__name__,
                changed,
                b.step,
            )
            return
        began = trainer.fit_loop.epoch_progress.total.ready > b.epochs_ready
        if began and b.groups is not None and not same_value(_groups(trainer), b.groups):
            log.warning(
                "save_on_exception: %s came after epoch %d began, and an on_train_epoch_start "
                "hook changed the optimizers' parameter groups since step %d ended the epoch "
                "before (BackboneFinetuning scales the backbone's learning rate there); a "
                "resume from that step runs the hook again, so nothing is saved; the newest "
                "checkpoint is the last periodic one",
                type(exception).__name__,
                trainer.current_epoch,
                b.step,
            )
            return
        if trainer.validating and (averaging := _weight_averaging(trainer)):
            log.warning(
                "save_on_exception: %s came during a validation, in which %s puts the averaged "
                "weights into the model (and the trained ones into its averaged model): the "
                "state matches no step, so nothing is saved; the newest checkpoint is the last "
                "periodic one",
                type(exception).__name__,
                averaging,
            )
            return
        log.warning(
            "%s during training: saving the state of step %d before it propagates",
            type(exception).__name__,
            b.step,
        )
        ctx.reset(marks=lambda: b.marks)  # the step's marks: epoch end, metrics, ...
        ctx.fit_loop_override = b.fit_loop
        ctx.buffer_override = b.buffers
        rng.restore(*b.rng_state)  # the random streams as they were after step b.step
        ckpt.emergency_save(b.step, state, st.finite_metrics(trainer.callback_metrics))


def _weight_averaging(trainer: pl.Trainer) -> str | None:
    """The name of a ``WeightAveraging`` callback of ``trainer`` (Lightning 2.6 on), if any: it
    swaps the averaged weights into the model for every validation and back after it."""
    from lightning.pytorch import callbacks

    kind = getattr(callbacks, "WeightAveraging", None)
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if kind is not None and isinstance(cb, kind):
            return type(cb).__name__
    return None


def _groups(trainer: pl.Trainer) -> list[list[dict[str, Any]]]:
    """Each optimizer's parameter groups: their hyperparameters and sizes (copied)."""
    return [
        [{**copy.deepcopy({k: v for k, v in g.items() if k != "params"}), "n": len(g["params"])}
         for g in o.param_groups]
        for o in trainer.optimizers
    ]  # fmt: skip
