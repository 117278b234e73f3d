"""What save_on_exception watches between a step() and an exception: the parameters' version
counters and addresses, and the modules' buffers (:class:`.emergency.Emergency`)."""

from __future__ import annotations

import operator
from itertools import chain, compress
from typing import Any

import torch

from . import statetree, structure
from .optim import hookable

#: the parameters of one object of the state (:meth:`ParamWatch.versions`): its key path, the
#: object, its parameters not already listed for an earlier object, their version counters and
#: addresses
ParamVersion = tuple[tuple[Any, ...], Any, list[torch.Tensor], list[int], list[int]]

Buffers = list[tuple[torch.nn.Module, str, torch.Tensor]]


def _same(a: list[Any], b: list[Any]) -> bool:
    """The same objects in the same order (by identity: a tensor's ``==`` compares values)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _walk(top: torch.nn.Module) -> list[torch.nn.Module]:
    """``top`` and its submodules, each once, in ``named_modules()``' order (children pushed
    reversed, so popped in order: the first changed parameter is named alike)."""
    out: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [top]
    while stack:
        mod = stack.pop()
        if id(mod) not in seen:
            seen.add(id(mod))
            out.append(mod)
            stack.extend(m for m in reversed(mod._modules.values()) if m is not None)
    return out


_MODULES = operator.attrgetter("_modules")
_PARAMETERS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
_VERSION = operator.attrgetter("_version")


# (map and chain: the loops run in C, a third faster than comprehensions at 1000 modules)
def _children(mods: list[torch.nn.Module]) -> list[Any]:
    return list(chain.from_iterable(map(dict.values, map(_MODULES, mods))))


def _params(mods: list[torch.nn.Module]) -> list[Any]:
    return list(chain.from_iterable(map(dict.values, map(_PARAMETERS, mods))))


class ParamWatch:
    """The parameters of the state's modules and optimizers with their version counters and
    addresses (:meth:`versions`), and the modules' buffers (:meth:`buffers`), taken at every
    ``step()`` of save_on_exception; one per :class:`.emergency.Emergency`.

    An in-place write since (``p.add_``, any optimizer's step, also one the state does not
    hold, such as a SAM wrapper's base optimizer) bumps a counter, ``p.data = t`` changes an
    address. (A write through ``p.data`` is not seen.) Walking the modules is most of the cost
    (2000 parameters: 1.6 ms of a 2.2 ms step(), ``benchmarks/bench_step_cost.py``), so each
    module's list of submodules is kept between steps and checked instead: every kept module's
    children are read again and compared by identity (one list comprehension), and a module
    added, replaced or removed anywhere in the tree (``setattr``, ``ModuleList.insert``, a
    write into ``_modules``) has the tree walked again. The parameters are read again from the
    kept modules and the optimizers' ``param_groups`` at every step (a parameter replaced, a
    param group added), and only their de-duplication across objects is kept while they are
    the same objects. Only a changed parameter is named (:func:`changed_params`)."""

    def __init__(self) -> None:
        # id(module of the state) -> (it, its submodules, their children when walked)
        self._trees: dict[int, tuple[torch.nn.Module, list[torch.nn.Module], list[Any]]] = {}
        self._checked: dict[int, list[torch.nn.Module]] = {}  # this step's, by id(module)
        self._raw: list[tuple[tuple[Any, ...], Any, list[Any]]] = []
        self._new: list[tuple[tuple[Any, ...], Any, list[torch.Tensor]]] = []
        self.walks = 0  # module trees walked (a test counts them)

    def clear(self) -> None:
        """Let go of every module and parameter (the Checkpointer closes)."""
        self._trees, self._checked, self._raw, self._new = {}, {}, [], []

    def _modules(self, top: torch.nn.Module) -> list[torch.nn.Module]:
        mods = self._checked.get(id(top))
        if mods is not None:
            return mods
        kept = self._trees.get(id(top))
        if kept is not None and kept[0] is top and _same(_children(kept[1]), kept[2]):
            mods = kept[1]
        else:
            self.walks += 1
            mods = _walk(top)
            self._trees[id(top)] = (top, mods, _children(mods))
        self._checked[id(top)] = mods
        return mods

    def versions(self, state: Any) -> list[ParamVersion]:
        """The parameters now, per object of ``state``, each listed once (for the first object
        that holds it), with their version counters and addresses."""
        self._checked = {}
        raw: list[tuple[tuple[Any, ...], Any, list[Any]]] = []
        for path, obj in statetree.leaves(state):
            if isinstance(obj, torch.nn.Module):
                params = _params(self._modules(obj))
            elif isinstance(obj, torch.optim.Optimizer):
                groups = getattr(hookable(obj), "param_groups", None) or []
                params = [p for g in groups for p in g["params"]]
            else:
                continue
            raw.append((path, obj, params))
        kept = len(raw) == len(self._raw) and all(
            a[0] == b[0] and a[1] is b[1] and _same(a[2], b[2])
            for a, b in zip(raw, self._raw, strict=True)
        )
        if not kept:
            seen: set[int] = set()
            self._new = []
            for path, obj, params in raw:
                # (_parameters holds None for an unset bias)
                new: list[torch.Tensor] = [p for p in params if p is not None and id(p) not in seen]
                seen.update(map(id, new))
                if new:
                    self._new.append((path, obj, new))
            # (modules no longer in the state are let go)
            self._trees = {k: v for k, v in self._trees.items() if k in self._checked}
        self._raw = raw
        return [
            (path, obj, new, list(map(_VERSION, new)), list(map(torch.Tensor.data_ptr, new)))
            for path, obj, new in self._new
        ]

    def buffers(self, state: Any) -> Buffers:
        """The saved buffers of the state's modules, with a copy of each as it is now: a
        forward pass in train mode changes some in place (BatchNorm's running statistics),
        without even bumping their version counters. (After :meth:`versions` of the same
        modules: their trees as checked there.)"""
        out: Buffers = []
        for _, obj in statetree.leaves(state):
            if isinstance(obj, torch.nn.Module):
                mods = self._modules(obj)
                out.extend(
                    (mod, name, b.detach().clone())
                    # (only the modules that have buffers: most have none)
                    for mod in compress(mods, map(_BUFFERS, mods))
                    for name, b in mod._buffers.items()
                    if b is not None and name not in mod._non_persistent_buffers_set
                )
        return out


def changed_params(versions: list[ParamVersion]) -> str | None:
    """The first parameter of :meth:`ParamWatch.versions` changed since, by name, or None."""
    for path, obj, params, vs, ptrs in versions:
        now_vs, now_ptrs = [p._version for p in params], [p.data_ptr() for p in params]
        if now_vs != vs or now_ptrs != ptrs:
            i = next(i for i in range(len(params)) if now_vs[i] != vs[i] or now_ptrs[i] != ptrs[i])
            return _param_name(path, obj, params[i])
    return None


def _param_name(path: tuple[Any, ...], obj: Any, p: torch.Tensor) -> str:
    """``state['model'].0.weight``; ``state['opt'].parameter 3`` for one of an optimizer's."""
    name = "a parameter"
    if isinstance(obj, torch.nn.Module):
        name = next((n for n, q in obj.named_parameters(remove_duplicate=False) if q is p), name)
    else:
        groups = getattr(hookable(obj), "param_groups", None) or []
        params = [q for g in groups for q in g["params"]]
        name = next((f"parameter {i}" for i, q in enumerate(params) if q is p), name)
    where = structure.path_str(path)
    return f"{where}.{name}" if where else name


def put_back(buffers: Buffers) -> Buffers | None:
    """Set the buffers back to their copies and return copies of their values before (to put
    back after a save of the copies' step: the live run goes on with its own); None (nothing
    changed) if one was replaced by another tensor or changed its shape since."""
    live = [mod._buffers.get(name) for mod, name, _ in buffers]
    if any(b is None or b.shape != c.shape for b, (_, _, c) in zip(live, buffers, strict=True)):
        return None
    before: Buffers = []
    with torch.no_grad():
        for b, (mod, name, c) in zip(live, buffers, strict=True):
            assert b is not None
            before.append((mod, name, b.detach().clone()))
            b.copy_(c)
    return before
