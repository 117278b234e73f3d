"""Where a callback cannot reach: finding the Trainer, and wrapping two of its methods.

A ``TrainerCallback`` receives the model, optimizer, scheduler and data loader, but not the
Trainer, and the Trainer decides a few things a resume must change in local variables of
``_inner_training_loop`` before the first event (``on_train_begin``) fires: the epoch to start
from and the position inside it. Two of its methods are looked up on the instance at every call,
so the adapter wraps them on this one Trainer instance while ``train()`` runs and unwraps them
afterwards:

- ``_run_epoch``: called once per epoch with the epoch number and the epoch's length. After a
  resume the first call gets the checkpoint's epoch and the *rest* of that epoch (the remaining
  batches and optimizer steps), so the Trainer's own gradient-accumulation bookkeeping lines up
  with the uninterrupted run; later calls get their epoch numbers shifted accordingly.
- ``_maybe_log_save_evaluate``: called after every optimizer step and at the end of every epoch,
  and the last thing that happens for a step (logging, evaluation, best-metric tracking). The
  checkpoint of a step is taken right after it, so it holds the state the next step starts from.

Both are private methods of the Trainer (transformers 5.3 and newer); :func:`check_supported` refuses, with
a clear error, a Trainer that does not have them with the expected parameters. Every run also
wraps ``callback_handler.on_step_end`` (the epoch of the step set before any callback sees it:
:mod:`.progress`) and ``callback_handler.on_train_end``; a resumed run wraps
``callback_handler.on_epoch_begin`` (once: the random streams are put back around it) and, with
persistent workers, ``get_eval_dataloader`` (:func:`eval_loader_without_draw`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import transformers

from .. import closing
from ..errors import ConfigError

RUN_EPOCH_PARAMS = frozenset(
    {
        "epoch",
        "train_dataloader",
        "steps_in_epoch",
        "num_update_steps_per_epoch",
        "resume_from_checkpoint",
        "epochs_trained",
        "steps_trained_in_current_epoch",
    }
)
WRAPPED = ("_run_epoch", "_maybe_log_save_evaluate", "get_eval_dataloader")


def find_trainer(callback: Any, *, required: bool = True) -> Any:
    """The ``transformers.Trainer`` whose callback event is running now and that holds
    ``callback``: the nearest caller frame whose ``self`` is such a Trainer (``None`` when there
    is none and not ``required``)."""
    frame = sys._getframe(1)
    try:
        while frame is not None:
            obj = frame.f_locals.get("self")
            if isinstance(obj, transformers.Trainer):
                handler = getattr(obj, "callback_handler", None)
                if handler is not None and any(cb is callback for cb in handler.callbacks):
                    return obj
            frame = frame.f_back  # type: ignore[assignment]
    finally:
        del frame
    if not required:
        return None
    raise ConfigError(
        "ResilientCheckpoint could not find the transformers.Trainer it belongs to (no Trainer "
        "holding this callback is on the call stack). Add it with trainer.add_callback(cb) or "
        "Trainer(callbacks=[cb]); if your code calls the callback events itself, call "
        "cb.attach(trainer) before training."
    )


def check_supported(trainer: Any) -> None:
    for name in WRAPPED:
        if not callable(getattr(trainer, name, None)):
            _unsupported(trainer, f"it has no method {name}()")
    params = set(inspect.signature(trainer._run_epoch).parameters)
    missing = RUN_EPOCH_PARAMS - params
    if missing:
        _unsupported(trainer, f"its _run_epoch() lacks the parameters {sorted(missing)}")


def _unsupported(trainer: Any, why: str) -> None:
    raise ConfigError(
        f"ResilientCheckpoint cannot drive this {type(trainer).__name__} (transformers "
        f"{transformers.__version__}): {why}. The adapter needs the Trainer's per-epoch loop "
        "(Trainer._run_epoch, new in transformers 5.3); install transformers 5.3 or newer."
    )


def wrap(trainer: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """Make ``trainer.<name>(*a, **kw)`` call ``wrapper(original, *a, **kw)`` on this instance."""
    unwrap(trainer, name)
    had_own = name in trainer.__dict__
    original = getattr(trainer, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    wrapped._rc_original = original  # type: ignore[attr-defined]
    wrapped._rc_wrapper = wrapper  # type: ignore[attr-defined]
    wrapped._rc_had_own = had_own  # type: ignore[attr-defined]
    trainer.__dict__[name] = wrapped


def unwrap(trainer: Any, name: str) -> None:
    current = trainer.__dict__.get(name)
    if current is None or not hasattr(current, "_rc_original"):
        return
    if current._rc_had_own:
        trainer.__dict__[name] = current._rc_original
    else:
        del trainer.__dict__[name]


def bind_arguments(
    original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Bind a call's arguments to ``original``'s signature (for reading and changing them)."""
    return inspect.signature(original).bind(*args, **kwargs)


def persistent_workers(args: Any) -> bool:
    """Whether the Trainer's loaders keep their workers (one iterator for the whole run)."""
    return bool(args.dataloader_persistent_workers) and int(args.dataloader_num_workers) > 0


def eval_loader_without_draw(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``Trainer.get_eval_dataloader`` of a resumed run with persistent workers: a loader that
    has made no iterator yet takes its base seed from a throwaway generator (an evaluation
    loader's order is sequential: the generator serves nothing else)."""
    loader = original(*args, **kwargs)
    base = getattr(loader, "base_dataloader", loader)  # accelerate's wrapper iterates this one
    if getattr(base, "_iterator", False) is None and getattr(base, "generator", 0) is None:
        base.generator = torch.Generator().manual_seed(0)
    return loader


def end_of_train(cb: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``ResilientCheckpoint``'s wrapper of the handler's ``on_train_end``: log the final save
    (``cb._log_final``), run every callback's ``on_train_end`` (``original``; also after a
    failed last save, raised after them), then close (``cb._finish``), after them all: a close
    that raises (``UploadIncompleteError`` after an outage) skipped the callbacks after ours.
    While another exception propagates, a failure of the close is logged, not raised."""
    cb._ending, failed = True, None  # (cb.on_train_end leaves the close to this)
    try:
        try:
            cb._log_final()
        finally:
            out = original(*args, **kwargs)
    except BaseException as e:
        failed = e
        raise
    finally:
        cb._ending = False
        closing.close_on_exit(cb._finish, failed)
    return out
