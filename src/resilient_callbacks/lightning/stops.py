"""Why a Lightning run stopped before ``max_steps``/``max_epochs``, recorded with its last
checkpoint, and whether the re-run of its script trains on.

A stop is recorded (``trainer.should_stop`` when the last step was saved: early stopping,
``max_time``, the user's code) so that re-running a finished script trains nothing. A stop by
``max_time`` alone is recorded as such: Lightning's ``Timer`` keeps the training time across
a resume, so the re-run trains on when its ``max_time`` leaves time (raised, or removed) and
trains nothing when it does not -- the way to run one ``max_time`` chunk per job. Any other
stop stays a stop.

Every rank, training thread. :func:`trains_on` is collective for a run recorded as stopped by
``max_time`` (what is recorded is rank 0's, the same on every rank): every rank follows rank 0's
decision, as the ``Timer`` broadcasts its own. Each rank reads its own clock and its own
``Timer`` (a re-run may even give the ranks different ``max_time``s); ranks that decided
differently would hang, one training, the other stopped, in the next collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, Timer

from .. import dist, rng
from . import checks
from .state import finite_metrics

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer
    from .boundary import StepEnd
    from .state import SaveContext

MAX_TIME = "max_time"


def recorded(trainer: pl.Trainer) -> bool | str:
    """What a save records of the stop: ``False`` (not stopping), :data:`MAX_TIME` (a Timer's
    time is up and no early stopping stopped the run), or ``True`` (any other stop)."""
    if not trainer.should_stop:
        return False
    timers = _timers(trainer)
    if not any((t.time_remaining() or 0.0) <= 0 for t in timers):
        return True
    for c in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(c, EarlyStopping):
            reason = getattr(c, "stopping_reason", None)  # (Lightning 2.6 on)
            if reason is None or getattr(reason, "value", reason) != "not_stopped":
                return True
    return MAX_TIME


def trains_on(trainer: pl.Trainer, stopped: Any) -> str | None:
    """For a run resumed at the step where it stopped (``stopped``: what was recorded): why
    it trains on, or ``None`` when it stays stopped: rank 0's answer, on every rank (a
    broadcast, for a run stopped by ``max_time``). Called once the Timer's state is back."""
    if stopped != MAX_TIME:
        return None
    left = [r for t in _timers(trainer) if (r := t.time_remaining()) is not None]
    why = None
    if not left:
        why = "it stopped at max_time, and no max_time is set now"
    elif min(left) > 0:
        why = f"it stopped at max_time, and max_time now leaves {min(left):.0f} s"
    return dist.broadcast_json(why)


def before_validation(trainer: pl.Trainer) -> dict[str, Any] | None:
    """Before a validation of the fit sets up its loaders: this rank's random streams, when
    Lightning runs this validation only because training stops (``should_stop`` after a batch
    it would not validate after otherwise: a ``Timer``'s, ``EarlyStopping`` on a train metric,
    your code). Creating its dataloader iterators draws from the global torch RNG, which a run
    that did not stop never did; a re-run that trains on from the stop (:func:`trains_on`)
    goes on from the streams taken here, as that run did. Else ``None``."""
    fetcher = trainer.fit_loop._data_fetcher
    if not trainer.should_stop or trainer.sanity_checking or fetcher is None:
        return None
    trainer.should_stop = False
    try:  # would Lightning validate after this batch if training went on?
        regular = trainer.fit_loop.epoch_loop._should_check_val_fx(fetcher)
    finally:
        trainer.should_stop = True
    if regular:
        return None
    info, tensors = rng.capture()
    return {"info": info, "tensors": {k.removeprefix("@rng/"): v for k, v in tensors.items()}}


def streams(saved: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """What :func:`before_validation` took, as a restored checkpoint holds it, for
    :func:`resilient_callbacks.rng.restore`; ``None`` if there is none."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("tensors"), Mapping):
        return None
    return saved["info"], {f"@rng/{k}": v for k, v in saved["tensors"].items()}


def why(stopped: Any) -> str:
    """The recorded stop in words, for the message of a re-run that trains nothing."""
    if stopped == MAX_TIME:
        return "its max_time was used up: raise max_time to train on"
    return "trainer.should_stop: early stopping or your code"


def _timers(trainer: pl.Trainer) -> list[Timer]:
    return [
        c
        for c in trainer.callbacks  # type: ignore[attr-defined]
        if isinstance(c, Timer) and getattr(c, "_duration", None) is not None
    ]


def save_stopped_step(
    trainer: pl.Trainer,
    ckpt: Checkpointer | None,
    ctx: SaveContext | None,
    state: Any,
    end: StepEnd | None,
    marks: Callable[[], dict[str, Any]],
) -> bool:
    """At the fit loop's end, before the ``on_train_end`` hooks (``WeightAveraging``'s copies
    its averages into the model, which a save after it would hold as the trained weights): a
    stop asked after a batch that made no optimizer step (with
    ``accumulate_grad_batches``, ``EarlyStopping`` on a validation or a ``Timer`` after a
    batch that only accumulated gradients) ends the fit after the last step's boundary, which
    saved it only if due. Save that step now, as the final one, recorded as stopped: the
    weights, optimizers and schedulers are still that step's (no step since; the accumulated
    gradients are dropped, as by Lightning at a stop), the loop state is its boundary's
    (``end``), the callbacks' states are the stop's. True if saved. Every rank calls it."""
    if ckpt is None or ctx is None or state is None or end is None or ckpt.closed:
        return False
    if not checks.stops(trainer) or trainer.global_step != end.step:
        return False
    if ckpt.last_saved_step == end.step:
        return False
    ctx.reset(marks=marks)
    ctx.fit_loop_override = end.fit_loop
    return ckpt.save(end.step, state, finite_metrics(trainer.callback_metrics), final=True)
