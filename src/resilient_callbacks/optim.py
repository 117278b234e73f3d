"""Which optimizer a wrapper steps, and the shapes of the parameters it steps.

Which optimizer a wrapper steps: Accelerate's ``AcceleratedOptimizer`` (and wrappers like
it) is a ``torch.optim.Optimizer`` that never ran ``Optimizer.__init__``: its ``step()`` steps
the optimizer it holds, whose step hooks are the ones that fire and whose class a checkpoint
records.

Our optimizer step hooks run untraced in a compiled ``step()`` (:func:`untraced`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.optim import lr_scheduler as _sched

_F = TypeVar("_F", bound=Callable[..., Any])


def untraced(hook: _F) -> _F:
    """``hook`` as ``torch.compile`` runs it untraced (``torch.compiler.disable``) where
    TorchDynamo is loaded: a compiled ``opt.step()`` -- PyTorch's recipe for a faster
    optimizer -- traced our step hooks, with a warning at every run (they read the thread
    and a lock) and their reads made guards of the compiled step. Not loaded (nothing
    compiled yet), the hook is left as it is: importing TorchDynamo takes about a second."""
    if "torch._dynamo" not in sys.modules:
        return hook
    return torch.compiler.disable(hook)


_PreHook = Callable[
    [Any, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]] | None
]


def update_began(mark: Callable[[], None]) -> _PreHook:
    """An optimizer step pre-hook that calls ``mark`` once the step may change the state: at
    once for a ``step()`` without a closure; for a ``step(closure)`` (Lightning's automatic
    optimization, LBFGS) once the closure returned, as every torch optimizer evaluates it
    before it updates anything. An exception in the closure's forward or backward (an
    out-of-memory error, a NaN check) leaves the weights those of the last step; a post-hook
    missed a step that raised part-way through the update, whose weights match no step."""

    def pre_step(
        _opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # ``args`` are step()'s own, the optimizer first: step(closure) has it second
        positional = len(args) > 1 and callable(args[1])
        closure = args[1] if positional else kwargs.get("closure")
        if not callable(closure):
            mark()
            return None
        inner = closure

        def evaluated(*a: Any, **k: Any) -> Any:
            out = inner(*a, **k)
            mark()  # (the update comes next)
            return out

        if positional:
            return (args[0], evaluated, *args[2:]), kwargs
        return args, {**kwargs, "closure": evaluated}

    return pre_step


def hookable(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose step hooks fire when ``opt`` steps: ``opt`` itself, or the one a
    wrapper that never ran ``Optimizer.__init__`` steps (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer`` and Fabric's optimizer, ``.optimizer``; the latter two
    pass the hooks' attributes on from the optimizer they hold: its own ``__dict__`` tells)."""
    for _ in range(4):
        inner = getattr(opt, "optimizer", None)
        if (
            not isinstance(opt, torch.optim.Optimizer)  # not a torch optimizer's wrapper
            # it ran Optimizer.__init__ itself
            or "_optimizer_step_pre_hooks" in getattr(opt, "__dict__", {})
            or not isinstance(inner, torch.optim.Optimizer)
        ):
            break
        opt = inner
    return opt


def two_pass_base(obj: Any) -> torch.optim.Optimizer | None:
    """The optimizer that ``obj`` steps if ``obj`` is a two-pass wrapper (SAM and its kin:
    ``first_step()`` moves the weights in place, ``second_step()`` puts them back and steps the
    optimizer held in ``.base_optimizer``), else None. Such a wrapper writes its parameters
    outside any optimizer's ``step()``, where no step hook runs. A torch optimizer that ran
    ``Optimizer.__init__`` and holds another in an attribute is taken for one; accelerate's
    ``AcceleratedOptimizer`` (see :func:`hookable`), which writes only through ``step()``, and
    an LR scheduler (its ``.optimizer``) are not."""
    base = getattr(obj, "base_optimizer", None)
    if isinstance(base, torch.optim.Optimizer) and base is not obj:
        return base
    if not isinstance(obj, torch.optim.Optimizer) or hookable(obj) is not obj:
        return None
    for value in vars(obj).values():
        if isinstance(value, torch.optim.Optimizer) and value is not obj:
            return value
    return None


def param_shapes(opt: torch.optim.Optimizer) -> list[list[list[int]]] | None:
    """The shape of every parameter ``opt`` steps, group by group, in the order its
    ``state_dict()`` numbers them: recorded with its state, so that a restore into an optimizer
    given other parameters (another order, another model) is refused before anything is loaded
    (``load_state_dict`` checks only how many parameters each group has)."""
    groups = getattr(opt, "param_groups", None)
    if not isinstance(groups, list):
        groups = getattr(hookable(opt), "param_groups", None)
    if not isinstance(groups, list):
        return None
    return [
        [list(p.shape) for p in g.get("params", ()) if isinstance(p, torch.Tensor)]
        for g in groups
        if isinstance(g, dict)
    ]


def unsaved_params(
    optimizers: list[torch.optim.Optimizer], saved: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The parameters the ``optimizers`` step (requiring grad) whose memory no tensor of
    ``saved`` holds: a checkpoint would restore the optimizer's state for them but not their
    values (fp32 master weights kept outside the state: the resume silently started from the
    initial masters)."""
    held = {t.untyped_storage().data_ptr() for t in saved if t.numel()}
    out = []
    for opt in optimizers:
        for group in hookable(opt).param_groups:
            for p in group["params"]:
                if p.requires_grad and p.numel() and p.untyped_storage().data_ptr() not in held:
                    out.append(p)
    return out


def unsaved_inner_optimizers(
    optimizers: list[tuple[str, Any]], saved: list[torch.Tensor]
) -> list[str]:
    """``"state['sam'].base_optimizer"`` for each torch optimizer held in an attribute of one of
    ``optimizers`` (by key path: torch optimizers, and wrappers of any class that
    :func:`two_pass_base` finds) whose state holds tensors that no tensor of ``saved`` holds: a
    SAM-style wrapper steps the optimizer it holds (``.base_optimizer``), whose momentum its own
    ``state_dict()`` leaves out, so the resume silently started the momentum from zero."""
    held = {t.untyped_storage().data_ptr() for t in saved if t.numel()}
    listed = {id(o) for _, o in optimizers} | {id(hookable(o)) for _, o in optimizers}
    out = []
    for where, opt in optimizers:
        for name, inner in vars(opt).items():
            if not isinstance(inner, torch.optim.Optimizer) or id(inner) in listed:
                continue
            tensors = [
                v
                for per_param in inner.state.values()
                if isinstance(per_param, dict)
                for v in per_param.values()
                if isinstance(v, torch.Tensor) and v.numel()
            ]
            if any(t.untyped_storage().data_ptr() not in held for t in tensors):
                out.append(f"{where}.{name}")
    return out


#: two objects of a state that share their ``param_groups`` (the same list, or the same
#: group dicts in lists of their own): :func:`shared_param_groups`
GroupLink = tuple[Any, Any, bool]


def shared_param_groups(objs: list[Any]) -> list[GroupLink]:
    """The pairs of ``objs`` (and of the optimizers their two-pass wrappers step,
    :func:`two_pass_base`) that share their parameter groups: ``(a, b, True)`` for the same
    list (SAM: ``self.param_groups = self.base_optimizer.param_groups``), ``(a, b, False)`` for
    the same group dicts. ``load_state_dict`` gives an optimizer new groups, so after a restore
    the wrapper's learning rate (what an LR scheduler made for the wrapper changes) no longer
    reached the base optimizer that steps: :func:`relink_param_groups` shares them again. The
    optimizer an LR scheduler of ``objs`` changes (``.optimizer``) counts too: a state holding
    the base optimizer alone, with a scheduler made for the wrapper, is relinked as well."""
    found: list[Any] = []
    for obj in objs:
        held = None  # the optimizer an LR scheduler of torch's changes
        if isinstance(obj, (_sched.LRScheduler, _sched.ReduceLROnPlateau)):
            held = obj.optimizer
        for o in (obj, two_pass_base(obj), held, two_pass_base(held)):
            if isinstance(getattr(o, "param_groups", None), list) and all(
                o is not f for f in found
            ):
                found.append(o)
    links: list[GroupLink] = []
    for i, a in enumerate(found):
        for b in found[i + 1 :]:
            ga, gb = a.param_groups, b.param_groups
            if ga is gb:
                links.append((a, b, True))
            elif ga and len(ga) == len(gb) and all(x is y for x, y in zip(ga, gb, strict=True)):
                links.append((a, b, False))
    return links


def relink_param_groups(links: list[GroupLink], loaded: list[Any]) -> None:
    """After a restore, share the groups of each pair of :func:`shared_param_groups` again:
    those of the one loaded last (``loaded``: the objects given ``load_state_dict``, in
    order), which hold the checkpoint's values; a pair neither of which was loaded is left."""
    order = {id(o): i for i, o in enumerate(loaded)}
    for a, b, same_list in links:
        if id(a) not in order and id(b) not in order:
            continue
        src, dst = (a, b) if order.get(id(a), -1) > order.get(id(b), -1) else (b, a)
        if src.param_groups is dst.param_groups:
            continue
        if same_list:
            dst.param_groups = src.param_groups
        else:
            dst.param_groups[:] = src.param_groups
