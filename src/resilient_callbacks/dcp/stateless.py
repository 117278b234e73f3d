"""Optimizer state that is not there: optimizers without any, parameters without any.

``Sharded`` saves the optimizers' state through DCP's optimizer state dict, which carries the
``param_groups`` too. When no rank's optimizer has state, it saves none (DCP would give the
optimizers state with a zero step, and a tool must not change the run): an optimizer that
never has state -- SGD without momentum -- then lost its ``param_groups``, and a resumed run
went on with the learning rate it was built with, not the one its scheduler had reached (a
chainable scheduler such as ``StepLR`` multiplies the group's current rate, so the rest of the
run was off too). :func:`hyperparameters` keeps each group's values but its parameters, as JSON.

Of several optimizers, those that have state on some rank are saved with it and the others by
their groups (:func:`saved_indices`): a second optimizer that starts stepping later must not
be given state by DCP's zero step either.

A parameter without a gradient yet (unused by the forward pass, an expert no token was routed
to) has no state in an optimizer that has state for the others; a restore, whose target state
dict DCP initialises for every parameter, must not refuse the checkpoint for lacking it
(:func:`without_saved_state`), and leaves the parameter without state, as it was.

Every rank, training thread; nothing here is collective. The groups are matched by position,
as ``torch.optim.Optimizer.load_state_dict`` matches them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointMismatchError
from .chunks import join, split, unescape

_NOT_SAVED = ("params", "param_names")  # which parameters a group holds: the optimizer's own


def hyperparameters(optimizers: Sequence[torch.optim.Optimizer]) -> list[list[Any]]:
    """Each optimizer's ``param_groups`` without their parameters, as JSON (:func:`.split`'s
    skeleton; a tensor value, such as a learning rate kept on the device, as its numbers)."""
    out = []
    for opt in optimizers:
        groups = []
        for g in opt.param_groups:
            values = {
                k: v.tolist() if isinstance(v, torch.Tensor) else v
                for k, v in g.items()
                if k not in _NOT_SAVED
            }
            skeleton, _ = split(values, "param_groups")
            groups.append(skeleton)
        out.append(groups)
    return out


def restore_hyperparameters(
    optimizers: Sequence[torch.optim.Optimizer],
    saved: Any,
    where: str,
    skip: Collection[int] = (),
) -> None:
    """Set each group's values from ``saved`` (:func:`hyperparameters`' answer), but those
    of the optimizers in ``skip`` (their state, groups included, came back with DCP's); a
    tensor value is written in place. The others were saved without state and are left with
    none, as ``Optimizer.load_state_dict`` leaves them (restored again in the same process, one
    kept the state of the steps taken since). Raises :class:`CheckpointMismatchError` when the number
    of optimizers or of their groups differs from what was saved."""
    if not isinstance(saved, list) or not all(isinstance(s, list) for s in saved):
        raise CheckpointCorruptError(f"{where}: the optimizers' groups are not a list of lists")
    if len(saved) != len(optimizers):
        raise CheckpointMismatchError(
            f"{where}: saved with {len(saved)} optimizer(s), restored into {len(optimizers)}"
        )
    for i, (opt, groups) in enumerate(zip(optimizers, saved, strict=True)):
        if i in skip:
            continue
        if len(groups) != len(opt.param_groups):
            raise CheckpointMismatchError(
                f"{where}: optimizer {i} was saved with {len(groups)} parameter group(s), this "
                f"one has {len(opt.param_groups)}"
            )
        for group, skeleton in zip(opt.param_groups, groups, strict=True):
            values = join(skeleton, _no_tensor)
            if not isinstance(values, dict):
                raise CheckpointCorruptError(f"{where}: a parameter group is not a dict")
            for k, v in values.items():
                current = group.get(k)
                if isinstance(current, torch.Tensor):
                    current.copy_(torch.as_tensor(v, dtype=current.dtype))
                else:
                    group[k] = v
        opt.state.clear()


def _no_tensor(name: str) -> Any:
    raise CheckpointCorruptError(f"a parameter group refers to a tensor ({name})")


def without_saved_state(names: set[str], sd: dict[str, Any]) -> set[str]:
    """Of ``names`` (flattened state-dict names, ``optim/state/FQN/KEY``), those of parameters
    that have no optimizer state in the checkpoint's state dict ``sd``."""
    saved = (sd.get("optim") or {}).get("state") or {}
    out = set()
    for name in names:
        parts = name.split("/")
        if len(parts) == 4 and parts[:2] == ["optim", "state"] and unescape(parts[2]) not in saved:
            out.add(name)
    return out


def saved_indices(saved: Mapping[str, Any], count: int) -> tuple[int, ...]:
    """Which of ``count`` optimizers a ``Sharded`` checkpoint (its manifest record ``saved``)
    holds the state of: all of them when it does not say (written before it could hold some
    only)."""
    if not saved.get("optim"):
        return ()
    listed = saved.get("optimizers")
    if listed is None:
        return tuple(range(count))
    return tuple(int(i) for i in listed)


def optimizers_of(
    saved: Mapping[str, Any], optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[torch.optim.Optimizer, ...]:
    """The optimizers whose state the checkpoint ``saved`` holds."""
    indices = saved_indices(saved, len(optimizers))
    if any(i >= len(optimizers) for i in indices):
        raise CheckpointMismatchError(
            f"the checkpoint holds the state of optimizer(s) {list(indices)}; this Sharded has "
            f"{len(optimizers)}"
        )
    return tuple(optimizers[i] for i in indices)
