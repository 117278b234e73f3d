"""Optimizer state kept in its own dtype through ``set_optimizer_state_dict``.

``torch.optim.Optimizer.load_state_dict`` casts every floating-point state tensor but ``step``
to its parameter's dtype. An optimizer that keeps its state in another dtype than its
parameters -- fp32 moments of bf16 parameters, as optimizers written for low-precision
training do -- was restored by :class:`~.sharded.Sharded` with its state rounded to bf16, in
silence, and the resumed run went on differently from one that was not stopped. The restore
reads the saved values into the live state tensors first (of the saved dtype: a sharded
tensor of another dtype is refused before loading; a plain one, such as a 0-d state, is read
into the live one where it has the saved dtype, :func:`same`); :func:`kept` records them, and
:func:`put_back` returns each one whose dtype the optimizer's load changed to its place. Under FSDP1 read
directly (:mod:`.flat_restore`) the restore builds the optimizer's own state dict of fresh
tensors in the saved dtypes: :func:`given` records those.

Which ranks call what: every rank, for itself, in ``Sharded.load``; nothing here is collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

import torch

Kept = list[tuple[torch.optim.Optimizer, Any, str, torch.Tensor]]


def kept(optims: Iterable[torch.optim.Optimizer], loaded: Mapping[str, Any]) -> Kept:
    """``(optimizer, parameter, key, tensor)`` of every state tensor of ``optims`` that is one
    of ``loaded`` (the values the restore read, by name): those read into the live tensor."""
    ids = {id(v) for v in loaded.values() if isinstance(v, torch.Tensor)}
    return [
        (o, p, k, v)
        for o in optims
        for p, state in o.state.items()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and id(v) in ids
    ]


def given(optimizer: torch.optim.Optimizer, osd: Mapping[str, Any]) -> Kept:
    """:func:`kept` of the state tensors of ``osd``, ``optimizer``'s own state dict (its
    parameters by position), before ``optimizer.load_state_dict(osd)``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [
        (optimizer, params[int(i)], k, v)
        for i, state in osd["state"].items()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and 0 <= int(i) < len(params)
    ]


def same(live: Any, saved: torch.Tensor) -> TypeGuard[torch.Tensor]:
    """Whether the saved tensor of a state that was not sharded (an optimizer's 0-d state: its
    ``step``, a per-parameter scale) can be read into the ``live`` one, which :func:`kept` then
    finds: a plain tensor of its dtype and shape. (Read into a new tensor, a floating one of
    another dtype than its parameter's was rounded by the optimizer's load: an fp32 scale of
    bf16 parameters came back as bf16.)"""
    return (
        type(live) is torch.Tensor
        and live.dtype == saved.dtype
        and live.shape == saved.shape
        and not live.requires_grad
    )


def put_back(states: Kept) -> None:
    """After the optimizers' ``load_state_dict``: each state of ``states`` that it cast to
    another dtype is the tensor read (the loaded values, in the dtype the optimizer keeps)."""
    for o, p, k, v in states:
        now = o.state.get(p, {}).get(k)
        if isinstance(now, torch.Tensor) and now.dtype != v.dtype and now.shape == v.shape:
            o.state[p][k] = v
