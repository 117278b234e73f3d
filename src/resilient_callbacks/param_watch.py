"""What save_on_exception watches between a step() and an exception: the parameters' version
counters and addresses, and the modules' buffers (:class:`.emergency.Emergency`)."""

from __future__ import annotations

from typing import Any

import torch

from . import statetree, structure
from .optim import hookable


def module_buffers(state: Any) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """The saved buffers of the state's modules, with a copy of each as it is now: a forward
    pass in train mode changes some in place (BatchNorm's running statistics), without even
    bumping their version counters."""
    out: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    for _, obj in statetree.leaves(state):
        if isinstance(obj, torch.nn.Module):
            for mod in obj.modules():
                skip = mod._non_persistent_buffers_set
                for name, b in mod._buffers.items():
                    if b is not None and name not in skip:
                        out.append((mod, name, b.detach().clone()))
    return out


#: the parameters of one object of the state (:func:`param_versions`): its key path, the object,
#: its parameters not already listed for an earlier object, their version counters and addresses
ParamVersion = tuple[tuple[Any, ...], Any, list[torch.Tensor], list[int], list[int]]


def param_versions(state: Any) -> list[ParamVersion]:
    """The parameters of the state's modules and optimizers, with their version counters and
    addresses now: an in-place write since (``p.add_``, any optimizer's step, also one the state
    does not hold, such as a SAM wrapper's base optimizer) bumps the counter, ``p.data = t``
    changes the address. (A write through ``p.data`` is not seen.) Taken at every ``step()``,
    so kept to list comprehensions per object (2000 parameters: about 1 ms, one core, of the
    2.8 ms a step() takes with save_on_exception, ``benchmarks/bench_step_cost.py``): the modules are walked through their ``_modules``
    and ``_parameters``, without the names ``named_parameters()`` builds; only a changed
    parameter is named (:func:`changed_params`)."""
    out: list[ParamVersion] = []
    seen: set[int] = set()
    for path, obj in statetree.leaves(state):
        params: list[Any] = []
        if isinstance(obj, torch.nn.Module):
            stack = [obj]
            while stack:
                mod = stack.pop()
                params.extend(mod._parameters.values())
                # (children reversed: popped in named_parameters()' order, which names the
                # first changed parameter alike)
                stack.extend(m for m in reversed(mod._modules.values()) if m is not None)
        elif isinstance(obj, torch.optim.Optimizer):
            groups = getattr(hookable(obj), "param_groups", None) or []
            params = [p for g in groups for p in g["params"]]
        # (a tied parameter twice in one module is compared twice: harmless, and cheaper than
        # a check per parameter; _parameters holds None for an unset bias)
        new = [p for p in params if p is not None and id(p) not in seen]
        seen.update(map(id, new))
        if new:
            out.append((path, obj, new, [p._version for p in new], [p.data_ptr() for p in new]))
    return out


def changed_params(versions: list[ParamVersion]) -> str | None:
    """The first parameter of :func:`param_versions` changed since, by name, or None."""
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


def put_back(buffers: list[tuple[torch.nn.Module, str, torch.Tensor]]) -> bool:
    """Set the buffers back to their copies; False (nothing changed) if one was replaced by
    another tensor or changed its shape since."""
    live = [mod._buffers.get(name) for mod, name, _ in buffers]
    if any(b is None or b.shape != c.shape for b, (_, _, c) in zip(live, buffers, strict=True)):
        return False
    with torch.no_grad():
        for b, (_, _, c) in zip(live, buffers, strict=True):
            assert b is not None
            b.copy_(c)
    return True
