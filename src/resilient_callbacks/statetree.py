"""One walker of a training state tree: containers (mappings, lists, tuples, ``PerRank``) are
descended into, everything else is a leaf. Used on the training thread by whoever needs the
modules or optimizers of a state (hooks, fingerprint, snapshot ordering); it never copies.
:func:`rebuild` maps a tree to a new one of the same shape (the emergency save's frozen copy)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
import xxhash

from .filepart import FilePart
from .state_marks import PerRank
from .structure import part_id
from .wrapped import plain_module

_PROBING: ContextVar[bool] = ContextVar("probing", default=False)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """While the ``state_dict()`` of a state's objects is read for what it holds, not saved (the
    host buffers allocated ahead of the first save, an adapter's preflight): an object whose
    ``state_dict()`` runs user code meant for saves (Lightning's ``on_save_checkpoint`` hooks)
    may leave that code out (:func:`is_probe`). On this thread only."""
    token = _PROBING.set(True)
    try:
        yield
    finally:
        _PROBING.reset(token)


def is_probe() -> bool:
    """Whether this thread reads a state inside :func:`probing` (nothing is saved)."""
    return _PROBING.get()


def leaves(state: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` for every leaf of ``state``, depth first in container order. A path is
    the tuple of mapping keys and list indices that leads to the leaf; a ``PerRank`` wrapper
    adds nothing to it."""
    if isinstance(state, PerRank):
        yield from leaves(state.obj, path)
    elif isinstance(state, Mapping):
        for k, v in state.items():
            yield from leaves(v, (*path, k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from leaves(v, (*path, i))
    else:
        yield path, state


def rebuild(state: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """The same tree with every leaf replaced by ``fn(leaf)``: containers rebuilt (mappings as
    dicts, lists, tuples, ``PerRank`` kept); ``is_leaf`` stops the descent early (an object
    that is a container but has its own state)."""
    if is_leaf(state):
        return fn(state)
    if isinstance(state, PerRank):
        return PerRank(rebuild(state.obj, fn, is_leaf), new_ranks=state.new_ranks)
    if isinstance(state, Mapping):
        return {k: rebuild(v, fn, is_leaf) for k, v in state.items()}
    if isinstance(state, list):
        return [rebuild(v, fn, is_leaf) for v in state]
    if isinstance(state, tuple):
        return tuple(rebuild(v, fn, is_leaf) for v in state)
    return fn(state)


def optimizers(state: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in ``state``."""
    return [v for _, v in leaves(state) if isinstance(v, torch.optim.Optimizer)]


def per_rank_parts(state: Any, path: tuple[Any, ...] = ()) -> dict[str, PerRank]:
    """The ``PerRank`` of ``state``, by id (their key in each rank's structure)."""
    if isinstance(state, PerRank):
        return {part_id(path): state}
    out: dict[str, PerRank] = {}
    if isinstance(state, Mapping):
        for k, v in state.items():
            out.update(per_rank_parts(v, (*path, k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(per_rank_parts(v, (*path, i)))
    return out


def rank0_for_new_ranks(state: Any) -> set[str]:
    """The ids of the ``PerRank(..., new_ranks="rank0")`` in ``state``."""
    return {i for i, p in per_rank_parts(state).items() if p.new_ranks == "rank0"}


def fileparts(state: Any) -> dict[str, FilePart]:
    """The FileParts in ``state``, by id (their folder under ``parts/``)."""
    return {part_id(p): v for p, v in leaves(state) if isinstance(v, FilePart)}


def fingerprint(state: Any) -> str:
    """Hash of the names, shapes and dtypes of every module's tensors: identifies the model."""
    specs: list[Any] = []
    for path, obj in leaves(state):
        if isinstance(obj, torch.nn.Module):
            dotted = "".join(f".{p}" for p in path)
            for k, v in plain_module(obj).state_dict().items():
                if isinstance(v, torch.Tensor):
                    specs.append([f"{dotted}.{k}", list(v.shape), str(v.dtype)])
    return xxhash.xxh3_64_hexdigest(json.dumps(specs).encode()) if specs else ""


def mid_step(state: Any) -> str | None:
    """The key path (``"state['accumulation']"``) of the first leaf that says it is in the
    middle of a step -- an attribute ``mid_step`` that is ``True``, as
    :class:`~.accelerate.Accumulation` has inside a gradient accumulation window -- or None.
    A preemption's emergency save waits for the step to end rather than fail on it."""
    for path, leaf in leaves(state):
        if getattr(leaf, "mid_step", False) is True:
            return "state" + "".join(f"[{k!r}]" for k in path)
    return None


def mid_step_left(state: Any) -> int | None:
    """How many more steps the first leaf in the middle of a step (:func:`mid_step`) needs to
    end it, as its attribute ``steps_left`` says (an ``Accumulation``: the micro-steps to its
    window's optimizer step, at most); None when no leaf is mid-step or it does not say."""
    for _, leaf in leaves(state):
        if getattr(leaf, "mid_step", False) is True:
            n = getattr(leaf, "steps_left", None)
            ok = isinstance(n, int) and not isinstance(n, bool) and n >= 0
            return n if ok else None
    return None
