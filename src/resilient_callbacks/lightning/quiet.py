"""Lightning's checkpoint dictionary read without the ``on_save_checkpoint`` hooks, where
nothing is saved.

The callback dumps Lightning's dictionary (``dump_checkpoint``, which calls every callback's
and the LightningModule's ``on_save_checkpoint``) for each save. Twice it is read without a
save: the preflight at ``on_train_start`` (a value that cannot be saved fails before the first
step) and the core's allocation of host buffers ahead of the first save, both inside
:func:`~resilient_callbacks.statetree.probing`. There the hooks are left out, so they run once
per save, as under Lightning's ``ModelCheckpoint``: a hook that counts saves, logs or writes a
file sees real saves only. What a hook adds to the dictionary is checked at the first save.

Such a quiet dump is cached by the :class:`~.state.SaveContext` like any other; every save
resets the context first (:meth:`~.state.SaveContext.reset`), so it never reaches a checkpoint.

Which ranks call what: each rank dumps its own dictionary; nothing here is collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..statetree import is_probe


@contextlib.contextmanager
def _hooks_left_out() -> Iterator[None]:
    """``dump_checkpoint`` without the callbacks' and the module's ``on_save_checkpoint``
    (Lightning's ``trainer.call`` helpers that run them, swapped for the dump)."""
    from lightning.pytorch.trainer import call

    module_hook = getattr(call, "_call_lightning_module_hook", None)
    callbacks_hook = getattr(call, "_call_callbacks_on_save_checkpoint", None)
    if module_hook is None or callbacks_hook is None:  # pragma: no cover - another Lightning
        yield
        return

    def module_hook_but_saves(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
        if hook_name == "on_save_checkpoint":
            return None
        return module_hook(trainer, hook_name, *args, **kwargs)

    call._call_lightning_module_hook = module_hook_but_saves
    call._call_callbacks_on_save_checkpoint = lambda trainer, checkpoint: None
    try:
        yield
    finally:
        call._call_lightning_module_hook = module_hook
        call._call_callbacks_on_save_checkpoint = callbacks_hook


def dump_fn(dump: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``dump``, with the ``on_save_checkpoint`` hooks left out inside ``probing()``."""

    def dump_unless_probe() -> dict[str, Any]:
        if not is_probe():
            return dump()
        with _hooks_left_out():
            return dump()

    return dump_unless_probe
