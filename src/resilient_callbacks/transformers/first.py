"""The restore runs before every callback's ``on_train_begin``, as under the Trainer's own resume.

``train(resume_from_checkpoint=...)`` loads the ``TrainerState``, the callbacks' states, the
weights, optimizer and scheduler before its first event, so every callback's
``on_train_begin`` sees the resumed run: ``state.global_step``, ``epoch``, ``log_history``,
the trained weights. ``ResilientCheckpoint`` restores when it begins, and began in its own
``on_train_begin``: the callbacks before it (every one of the Trainer's ``callbacks=`` when it
is added with ``add_callback``) saw step 0 and the initial weights -- a schedule keyed on the
step, a logger, an EMA copying the weights got the fresh run's.

A callback is not told of a ``train()`` before that event, so ``CallbackHandler.on_train_begin``
is wrapped, on the class, once per process (when a ``ResilientCheckpoint`` is made): for a
handler holding one, it begins (finds its Trainer, opens, restores) before the handler calls
any callback (and closes it when one of them raises); a handler without one runs as before. Its own ``on_train_begin`` then does
nothing (:func:`begun`); where the events are called without the handler (``attach``) it
begins there, as before.

Every rank runs the same handler, so every rank restores at the same point (collectives
included), as before.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

_WRAPPED = "_resilient_callbacks_begins_first"
_BEGUN: weakref.WeakSet[Any] = weakref.WeakSet()  # began in the handler's on_train_begin


def install(callback_class: type[Any]) -> None:
    """Wrap ``CallbackHandler.on_train_begin`` (once): a ``callback_class`` instance among the
    handler's callbacks begins, through its ``_start(args, state, train_dataloader)``, before
    the handler calls any callback's ``on_train_begin``."""
    from transformers.trainer_callback import CallbackHandler

    original = CallbackHandler.on_train_begin
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def on_train_begin(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        began = []
        try:
            for cb in list(self.callbacks):
                if isinstance(cb, callback_class):
                    _BEGUN.discard(cb)
                    cb._start(args, state, getattr(self, "train_dataloader", None))
                    _BEGUN.add(cb)
                    began.append(cb)
            return original(self, args, state, control, **kwargs)
        except BaseException as e:  # train() leaves: close what began (as for a failed step)
            for cb in began:
                _BEGUN.discard(cb)
                cb._abort(e)
            raise

    setattr(on_train_begin, _WRAPPED, True)
    CallbackHandler.on_train_begin = on_train_begin  # type: ignore[method-assign]


def begun(callback: Any) -> bool:
    """Whether ``callback`` began already in this ``on_train_begin`` (asked once, from it)."""
    if callback in _BEGUN:
        _BEGUN.discard(callback)
        return True
    return False
