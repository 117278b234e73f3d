"""Whether the optimizers a ``Sharded`` restores into are the kind it saved: each one's class
and parameter groups, recorded in the manifest at every save (:func:`describe`) and compared
before anything is loaded (:func:`problems`).

DCP's ``set_optimizer_state_dict`` checks neither. An AdamW checkpoint restored into an AdamW
whose parameters were split into two groups loaded, and left the first group without its
``lr`` and ``betas`` (the next ``step()`` raised ``KeyError``); into an ``Adam``, whose state
has the same keys, it loaded AdamW's hyper-parameters silently. The plain path refuses both
(:func:`resilient_callbacks.fit.check_fit`); so does this one. With
``StateDictOptions(strict=False)`` the groups are compared on the parameters the checkpoint
holds: the same groups restored after it was split in two, or with a group of new parameters
only, loaded, and that group had no ``lr``/``betas`` (DCP gives each saved group's
hyper-parameters to one group holding its parameters).

A group is recorded as the number of parameters it holds and a digest of their names, as
``get_state_dict`` names them (FSDP1's flat parameter by the names of the parameters it
holds), so a checkpoint moves between FSDP1, FSDP2 and numbers of ranks unrefused. An
optimizer with a parameter outside the model is recorded without groups (not checked).

Every rank, training thread; nothing here is collective (the same answer on every rank: each
rank's optimizers hold the same parameters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from ..errors import CheckpointMismatchError
from .chunks import unescape
from .flat import Names
from .views import MODEL, state_of


class Fingerprints:
    """What each save records of the optimizers (``__call__``), the parameters' names looked
    up once (a model's parameters do not change between saves; ``names`` caches their
    FQNs) and each optimizer's record kept while its groups hold the same parameters."""

    def __init__(self, model: torch.nn.Module, names: Names) -> None:
        self.model = model
        self.names = names
        self._by_id: dict[int, str] = {}
        self._kept: dict[int, tuple[tuple[tuple[int, ...], ...], dict[str, Any]]] = {}

    def __call__(
        self, optimizers: Sequence[torch.optim.Optimizer], within: set[str] | None = None
    ) -> list[dict[str, Any]]:
        """Each optimizer's record; ``within``: of its groups, only the parameters of these
        names are counted (not kept)."""
        if within is not None:
            return [self._one(o, within) for o in optimizers]
        return [self._one(o) for o in optimizers]

    def parameters(self) -> set[str]:
        """The names of the model's parameters, as ``get_state_dict`` gives them."""
        return {f for p in self.model.parameters() for f in self._fqns(id(p)) or ()}

    def buffers(self) -> set[str]:
        """The names of the model's buffers, as ``get_state_dict`` gives them."""
        return {f for n, _ in self.model.named_buffers() for f in self.names.every(n)}

    def frozen(self) -> set[str]:
        """The names of the model's frozen parameters (``requires_grad`` False)."""
        frozen = (p for p in self.model.parameters() if not p.requires_grad)
        return {f for p in frozen for f in self._fqns(id(p)) or ()}

    def _one(self, opt: torch.optim.Optimizer, within: set[str] | None = None) -> dict[str, Any]:
        ids = tuple(tuple(id(p) for p in g["params"]) for g in opt.param_groups)
        kept = self._kept.get(id(opt))
        if kept is not None and kept[0] == ids and within is None:
            return kept[1]
        said: dict[str, Any] = {"type": qualname(opt)}
        groups = [self._group(g, within) for g in ids]
        if all(g is not None for g in groups):
            said["groups"] = groups
        if within is None:
            self._kept[id(opt)] = (ids, said)
        return said

    def _group(self, ids: tuple[int, ...], within: set[str] | None = None) -> list[Any] | None:
        """``[number of parameters, digest of their names]`` (of those ``within``, if given),
        or ``None`` where a parameter is not the model's."""
        names: list[str] = []
        for i in ids:
            fqns = self._fqns(i)
            if fqns is None:
                return None
            names.extend(f for f in fqns if within is None or f in within)
        return [len(names), xxhash.xxh3_64_hexdigest("\n".join(sorted(names)).encode())]

    def _fqns(self, param_id: int) -> tuple[str, ...] | None:
        """The FQNs of the model's parameter ``param_id``; ``None`` if it is not the model's."""
        if param_id not in self._by_id:  # (first call, or a parameter added since)
            self._by_id = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        name = self._by_id.get(param_id)
        return None if name is None else self.names.every(name)


def qualname(opt: torch.optim.Optimizer) -> str:
    t = type(opt)
    return f"{t.__module__}.{t.__qualname__}"


def problems(saved: Any, now: Sequence[Mapping[str, Any]], groups: bool = True) -> list[str]:
    """Why optimizers described as ``now`` do not take the state of those described as
    ``saved`` (a manifest's record; none when it holds none: written before it was recorded).
    ``groups``: compare their parameter groups too."""
    if not isinstance(saved, list):
        return []
    if len(saved) != len(now):
        return [f"saved with {len(saved)} optimizer(s), restored into {len(now)}"]
    out = []
    for i, (s, n) in enumerate(zip(saved, now, strict=True)):
        if not isinstance(s, dict):
            continue
        if s.get("type") != n["type"]:
            out.append(f"optimizer {i}: a {s.get('type')} in the checkpoint, a {n['type']} here")
            continue
        mine, theirs = n.get("groups"), s.get("groups")
        if not groups or not isinstance(theirs, list) or mine is None or theirs == mine:
            continue
        sizes = [g[0] if isinstance(g, list) and g else "?" for g in theirs]
        here = [g[0] for g in mine]
        other = " (the same sizes, other parameters)" if sizes == here else ""
        out.append(
            f"optimizer {i}: parameter groups of {sizes} in the checkpoint, of {here} here{other}"
        )
    return out


def check(
    part_id: str,
    saved: Mapping[str, Any],
    kinds: Fingerprints,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
) -> None:
    """Raise :class:`CheckpointMismatchError` when ``optimizers`` (none: a restore of the model
    alone) do not take the state a ``Sharded`` part saved (its manifest record ``saved``).
    Their groups are compared where the model's parameters are all in the checkpoint (a
    model that changed is refused by name, parameter by parameter) or, without ``strict``,
    on the parameters the checkpoint holds (a lenient restore loads what fits)."""
    if not optimizers:
        return
    keys = [*(saved.get("tensors") or {}), *(saved.get("plain") or {})]
    held = {unescape(k.removeprefix(MODEL)) for k in keys}  # (the parameters' names)
    if saved.get("frozen_left_out"):  # (ignore_frozen_params: the groups saved count them)
        held |= kinds.frozen()
    if kinds.parameters() <= held or not strict:
        # strict=False: a model that gained parameters (in a group it had, or in a group
        # added after the restore: optimizer.add_param_group) loads the state of those the
        # checkpoint holds; compared on those. DCP's load gives each saved group's
        # hyper-parameters to a group holding one of its parameters: groups split or merged
        # left a group without them (the next step() raised KeyError) or with another's lr.
        changed = problems(saved.get("optimizer_kinds"), kinds(optimizers, held), True)
    else:  # (a model that changed is refused by name, parameter by parameter)
        changed = problems(saved.get("optimizer_kinds"), kinds(optimizers), False)
    if changed:
        counted = "" if strict else lenient_note(held, kinds, saved)
        raise CheckpointMismatchError(
            f"part {part_id!r}: the optimizers are not those the checkpoint holds the state "
            f"of: {'; '.join(changed)}{counted} (to go on with new optimizers from the saved "
            "model, load Sharded(model) alone through a Checkpointer opened with "
            "read_only=True, and save into a new dirpath)"
        )


def lenient_note(held: set[str], kinds: Fingerprints, saved: Mapping[str, Any]) -> str:
    """What a ``strict=False`` refusal of the groups adds: how they were counted and, by what
    the model gained or lost since the save (``held``: the names the checkpoint holds), where
    its parameters may go. The checkpoint does not record which saved names were parameters:
    those with optimizer state were; the others (buffers, parameters without state) are said
    as saved tensors."""
    now = kinds.parameters()
    models = [*(saved.get("tensors") or {}), *(saved.get("plain") or {})]
    saved_names = {unescape(k.removeprefix(MODEL)) for k in models if k.startswith(MODEL)}
    lost = saved_names - now - kinds.buffers()
    stated = {of[0] for k in models if (of := state_of(k)) is not None}
    notes = []
    if now - held or not lost & stated:
        notes.append(
            "new parameters go into a group that holds saved ones, or into a group added "
            "after the restore, with optimizer.add_param_group"
        )
    if lost & stated:
        notes.append(
            f"the saved groups also count {_names(lost & stated, 'parameter(s)')}, which no "
            "group here holds: their optimizer state does not fit these groups"
        )
    if lost - stated:
        notes.append(
            f"the checkpoint also holds {_names(lost - stated, 'saved tensor(s)')} without "
            "optimizer state: buffers, or parameters the saved groups count where an "
            "optimizer held them"
        )
    return (
        " (strict=False: the parameters of each group that the checkpoint holds are counted; "
        + "; ".join(notes)
        + ")"
    )


def _names(names: set[str], what: str) -> str:
    """``N what this model no longer has (a, b, ...)``: the first five of ``names``, sorted."""
    first = sorted(names)
    more = f" (and {len(first) - 5} more)" if len(first) > 5 else ""
    return f"{len(first)} {what} this model no longer has ({', '.join(first[:5])}{more})"
