"""Lightning's checkpoint dictionary read without the ``on_save_checkpoint`` hooks, where
nothing is saved.

The callback dumps Lightning's dictionary (``dump_checkpoint``, which calls every callback's
and the LightningModule's ``on_save_checkpoint``) for each save. Twice it is read without a
save: the preflight at ``on_train_start`` (a value that cannot be saved fails before the first
step) and the core's allocation of host buffers ahead of the first save, both inside
:func:`~resilient_callbacks.statetree.probing`. There the hooks are left out, so they run once
per save, as under Lightning's ``ModelCheckpoint``: a hook that counts saves, logs or writes a
file sees real saves only. What a hook adds to the dictionary is checked at the first save.

What a hook takes out or replaces (a LoRA module dropping its frozen base weights, Lightning's
``ModelPruning`` making pruning permanent) a read without it cannot know: host buffers
allocated from it would hold tensors the saves never copy (the whole base model, pinned on a
GPU, where torch's host allocator keeps them). So where such a hook exists (:func:`save_hooks`)
the allocation ahead is not made from a quiet read (:class:`HooksDecideTheSave`): the first save
allocates what it copies. The preflight (:func:`preflight`) still reads without the hooks.

Such a quiet dump is cached by the :class:`~.state.SaveContext` like any other; every save
resets the context first (:meth:`~.state.SaveContext.reset`), so it never reaches a checkpoint.

Which ranks call what: each rank dumps its own dictionary; nothing here is collective. The
hooks are left out on the dumping thread only (another Trainer's save on another thread runs
them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from ..statetree import is_probe, probing

_PREFLIGHT: ContextVar[bool] = ContextVar("rc_lightning_preflight", default=False)


class HooksDecideTheSave(Exception):
    """Raised by a quiet dump outside :func:`preflight` where ``on_save_checkpoint`` hooks may
    change what a save holds: the core's allocation ahead of the first save reads nothing then
    (it logs this at DEBUG and leaves the allocation to the first save)."""


@contextlib.contextmanager
def preflight() -> Iterator[None]:
    """:func:`~resilient_callbacks.statetree.probing` for the preflight: the dump is read
    without the hooks even where they change what a save holds."""
    with probing():
        token = _PREFLIGHT.set(True)
        try:
            yield
        finally:
            _PREFLIGHT.reset(token)


def save_hooks(trainer: Any) -> list[str]:
    """The ``on_save_checkpoint`` hooks a dump of ``trainer`` runs: the LightningModule's, the
    callbacks' (Lightning's own included), where overridden."""
    from lightning.pytorch import Callback, LightningModule

    found = []
    module = getattr(trainer, "lightning_module", None)
    if module is not None and type(module).on_save_checkpoint is not (
        LightningModule.on_save_checkpoint
    ):
        found.append(type(module).__name__)
    for cb in getattr(trainer, "callbacks", None) or ():
        if type(cb).on_save_checkpoint is not Callback.on_save_checkpoint:
            found.append(type(cb).__name__)
    return found


_LEFT_OUT: ContextVar[bool] = ContextVar("rc_lightning_save_hooks_left_out", default=False)
_INSTALL = threading.Lock()


def _install_gates(call: Any) -> bool:
    """Wrap Lightning's ``trainer.call`` helpers that run the ``on_save_checkpoint`` hooks, once
    per process, in gates that leave the hooks out where :data:`_LEFT_OUT` is set: on the
    thread (context) of a quiet dump only. Whether that could be done."""
    with _INSTALL:
        module_hook = getattr(call, "_call_lightning_module_hook", None)
        callbacks_hook = getattr(call, "_call_callbacks_on_save_checkpoint", None)
        if module_hook is None or callbacks_hook is None:  # pragma: no cover - another Lightning
            return False
        if not getattr(module_hook, "_rc_gate", False):

            def module_hook_gated(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
                if hook_name == "on_save_checkpoint" and _LEFT_OUT.get():
                    return None
                return module_hook(trainer, hook_name, *args, **kwargs)

            module_hook_gated._rc_gate = True  # type: ignore[attr-defined]
            call._call_lightning_module_hook = module_hook_gated
        if not getattr(callbacks_hook, "_rc_gate", False):

            def callbacks_hook_gated(trainer: Any, checkpoint: dict[str, Any]) -> None:
                if not _LEFT_OUT.get():
                    callbacks_hook(trainer, checkpoint)

            callbacks_hook_gated._rc_gate = True  # type: ignore[attr-defined]
            call._call_callbacks_on_save_checkpoint = callbacks_hook_gated
        return True


@contextlib.contextmanager
def _hooks_left_out() -> Iterator[None]:
    """``dump_checkpoint`` without the callbacks' and the module's ``on_save_checkpoint``, on
    this thread only. (Swapping Lightning's module-level helpers for the dump and back left
    them out of a real save on another thread meanwhile, and two overlapping dumps could put
    the hook-less ones back for good: the gates stay, and a context variable opens them.)"""
    from lightning.pytorch.trainer import call

    if not _install_gates(call):  # pragma: no cover - another Lightning
        yield
        return
    token = _LEFT_OUT.set(True)
    try:
        yield
    finally:
        _LEFT_OUT.reset(token)


def dump_fn(dump: Callable[[], dict[str, Any]], trainer: Any) -> Callable[[], dict[str, Any]]:
    """``dump`` of ``trainer``, with the ``on_save_checkpoint`` hooks left out inside
    ``probing()``; raising :class:`HooksDecideTheSave` there, outside :func:`preflight`, where
    such a hook exists."""

    def dump_unless_probe() -> dict[str, Any]:
        if not is_probe():
            return dump()
        if not _PREFLIGHT.get() and (hooks := save_hooks(trainer)):
            raise HooksDecideTheSave(
                f"on_save_checkpoint hooks ({', '.join(hooks)}) decide what a save holds: its "
                "host buffers are allocated at the first save"
            )
        with _hooks_left_out():
            return dump()

    return dump_unless_probe
