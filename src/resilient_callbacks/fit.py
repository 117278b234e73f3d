"""Does a checkpoint fit the live state? Every key and shape that does not, listed before
anything is loaded (``check_fits``), so a checkpoint of another model is one clear error instead
of a half-loaded state.

A mapping in the state may explain a key mismatch in words the user knows: a method
``explain_key_mismatch(missing, unexpected) -> str | None`` (the keys the checkpoint lacks and
the keys only it has) adds its answer to the list (the DeepSpeed engine's state names the ZeRO
stages, say); one with a ``saved_keys`` keyword also gets, for each unexpected key, the keys the
checkpoint holds under it. A stateful object may refuse a checkpoint before any other problem
is listed: a method ``refuse_saved(saved)`` (the entries of its saved state) that raises
:class:`CheckpointMismatchError` (the DeepSpeed engine's counters refuse a dtype change at ZeRO
0, which the optimizer's class would otherwise report, and an LR scheduler of another kind,
whatever key of the state comes first)."""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from . import mapped, module_versions, notices
from .errors import CheckpointMismatchError, caller_stacklevel
from .filepart import FilePart
from .optim import hookable, param_shapes
from .state_marks import PerRank
from .structure import TAG, _has_live_objects, _qualname, is_stateful, path_str
from .structure_decode import _describe, _node_items, _node_seq
from .wrapped import plain_module, unwrapped_keys

log = logging.getLogger("resilient_callbacks")


def _tensor_specs(node: Any, tensors_meta: Mapping[str, tuple[str, list[int]]]) -> dict[str, Any]:
    """Flat ``{dotted key: (dtype, shape)}`` for the tensors under a structure node, plus
    ``None`` for non-tensor leaves; used to compare a checkpoint with a live module."""
    out: dict[str, Any] = {}

    def rec(n: Any, prefix: str) -> None:
        if isinstance(n, dict) and n.get(TAG) == "tensor":
            out[prefix] = tensors_meta.get(n["key"])
        elif isinstance(n, dict) and n.get(TAG) is None:
            for k, v in n.items():
                rec(v, f"{prefix}.{k}" if prefix else k)
        else:
            out[prefix] = None

    rec(node, "")
    return out


def its_own_shape(module: torch.nn.Module, key: str, live: torch.Tensor) -> bool:
    """Whether a saved shape of ``key`` that differs from the ``live`` tensor's is for
    ``module``'s own ``load_state_dict`` to take or refuse, not a mismatch: a lazy module's
    uninitialized tensor (``nn.LazyLinear`` before its first forward), which loading
    materializes, or a tensor of a torch.ao submodule with loading code of its own
    (``_load_from_state_dict``): the fake-quantize modules and observers of quantization-aware
    training resize their buffers (per-channel scales, min/max) to the saved shape. Every other
    module (``torch.nn``'s, a user's or a library's own loader, which mostly renames keys before
    ``torch.nn``'s) is checked here, before anything is loaded."""
    if is_lazy(live):
        return True
    try:
        sub = module.get_submodule(key.rpartition(".")[0])
    except AttributeError:
        return False
    loader = type(sub)._load_from_state_dict
    return mapped.own_loader(sub) and getattr(loader, "__module__", "").startswith("torch.ao.")


def key_differences(
    want: Mapping[str, Sequence[int] | None],
    have: Mapping[str, Sequence[int] | None],
    upgraded: list[str] | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """Compare a model's tensor shapes (``want``) with a checkpoint's (``have``; ``None``: shape
    unknown): the keys missing from the checkpoint, those the model lacks, and those of another
    shape, each sorted. ``upgraded``: the submodules whose version changed since the save
    (:func:`.module_versions.upgraded`); their loading code upgrades their entries (renames
    keys, reshapes), so theirs are left to ``load_state_dict`` (strict) to judge."""
    if upgraded:
        want = {k: v for k, v in want.items() if not module_versions.under(k, upgraded)}
        have = {k: v for k, v in have.items() if not module_versions.under(k, upgraded)}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    reshaped = [
        k
        for k in sorted(set(want) & set(have))
        if (shape := have[k]) is not None and list(shape) != list(want[k] or ())
    ]
    return missing, unexpected, reshaped


def _explain(obj: Any, missing: list[Any], unexpected: list[Any], items: dict) -> str | None:
    """``obj.explain_key_mismatch``'s words for a key mismatch, if it has any; one that takes
    ``saved_keys`` is also given the keys inside each unexpected entry of the checkpoint."""
    explain = getattr(obj, "explain_key_mismatch", None)
    if explain is None or not (missing or unexpected):
        return None
    if "saved_keys" not in inspect.signature(explain).parameters:
        return explain(missing, unexpected)
    saved = {k: sorted(map(str, _node_items(items[k]) or {})) for k in unexpected}
    return explain(missing, unexpected, saved_keys=saved)


def _refuse_first(obj: Any, n: dict[str, Any]) -> None:
    """``obj.refuse_saved(saved)``, where a stateful object has it: given the entries of its
    saved state (JSON values as saved, others as encoded nodes), it raises
    :class:`CheckpointMismatchError` in its own words, before any other problem is listed."""
    refuse = getattr(obj, "refuse_saved", None)
    saved = _node_items(n.get("state"))
    if callable(refuse) and saved is not None:
        refuse(saved)


def _absent_allowed(obj: Any, missing: list[Any]) -> bool:
    """Whether ``obj.missing_allowed(missing)`` says the checkpoint may lack every one of
    ``missing``: the one hook for keys an older checkpoint may lack (a dict subclass of an
    adapter whose newer version saves entries its older checkpoints lack:
    :class:`~.state_marks.OptionalKeys`, DeepSpeed's ``ModuleExtras``). All or nothing: allowed,
    they keep their live values (the object may warn that they do); refused, every missing key
    is named in the error."""
    allowed = getattr(obj, "missing_allowed", None)
    return bool(missing) and allowed is not None and bool(allowed(list(missing)))


MATERIALIZE = (
    "Allocate it before restore() (module.to_empty(device=...), or build it on a real device)."
)


def check_fits(
    state: Any,
    structure: Any,
    tensors_meta: Mapping[str, tuple[str, list[int]]],
    partial: bool = False,
    through: tuple[str, ...] = (),
) -> list[str]:
    """Raise :class:`CheckpointMismatchError` listing every key that is missing, unexpected or of
    another shape, before anything is loaded. Modules and tensors are compared exactly;
    other stateful objects (optimizers, schedulers) are checked by their own ``load_state_dict``.
    A tensor of another dtype is cast on load, as ``load_state_dict`` does (a run resumed in
    another precision), with a warning that names it: a resume that is not exact says so.
    ``partial``: the state may hold a part of the checkpoint's entries (a read-only restore of
    the model alone); the entries of a dict left out are returned, not refused. ``through``: a
    framework's directories between the user's line and the library (where the cast warning
    points)."""
    problems: list[str] = []
    left_out: list[str] = []
    cast: list[str] = []  # of the replicated state: the same on every rank, said once
    cast_here: list[str] = []  # of this rank's PerRank state: said by this rank
    into = [cast]

    def dtypes(where: str, saved: str, here: str) -> None:
        if saved != here:
            into[-1].append(f"{where}: {saved} in checkpoint, {here} here")

    def rec(obj: Any, n: Any, path: tuple[Any, ...]) -> None:
        if isinstance(obj, PerRank):
            into.append(cast_here)
            try:
                rec(obj.obj, n, path)
            finally:
                into.pop()
            return
        if isinstance(obj, FilePart):
            if not (isinstance(n, dict) and n.get(TAG) == "filepart"):
                problems.append(f"{path_str(path)}: checkpoint holds {_describe(n)}, not a part")
            return
        if isinstance(obj, torch.nn.Module):
            obj = plain_module(obj)  # a wrapper's (compile, DDP) module: its keys, unprefixed
            # a module's state; or a state dict saved as a dict (Lightning's "state_dict")
            saved = n["state"] if isinstance(n, dict) and n.get(TAG) == "stateful" else n
            if _node_items(saved) is None:
                problems.append(f"{path_str(path)}: checkpoint holds {_describe(n)}, not a module")
                return
            live_sd = obj.state_dict()
            live = {k: v for k, v in live_sd.items() if isinstance(v, torch.Tensor)}
            want = {
                k: (str(v.dtype).removeprefix("torch."), None if is_lazy(v) else list(v.shape))
                for k, v in live.items()
            }
            if on_meta := [k for k, v in live.items() if v.is_meta]:
                problems.append(
                    f"{path_str(path)}: {_short(on_meta)} are on the meta device, which holds "
                    f"no values: loading into them does nothing. {MATERIALIZE}"
                )
            have = {
                k: v
                for k, v in unwrapped_keys(_tensor_specs(saved, tensors_meta), want).items()
                if k in want or v is not None
            }
            missing, unexpected, reshaped = key_differences(
                {k: v[1] for k, v in want.items()},
                {k: None if v is None else v[1] for k, v in have.items()},
                module_versions.upgraded(module_versions.attach({}, n), live_sd),
            )
            problems.extend(_key_problems(path, missing, unexpected))
            for k in reshaped:
                if its_own_shape(obj, k, live[k]):
                    continue  # the module's own load_state_dict takes or refuses that shape
                problems.append(
                    f"{path_str(path)}[{k!r}]: shape {list(have[k][1])} in checkpoint, "
                    f"{want[k][1]} in model"
                )
            for k, spec in have.items():
                if k in want and spec is not None:
                    dtypes(f"{path_str(path)}[{k!r}]", spec[0], want[k][0])
            return
        if isinstance(obj, torch.Tensor):
            if not (isinstance(n, dict) and n.get(TAG) == "tensor"):
                problems.append(f"{path_str(path)}: checkpoint holds {_describe(n)}, not a tensor")
                return
            if obj.is_meta:
                problems.append(
                    f"{path_str(path)} is on the meta device, which holds no values: loading "
                    f"into it does nothing. {MATERIALIZE}"
                )
            if any(st == 0 and size > 1 for st, size in zip(obj.stride(), obj.shape, strict=True)):
                problems.append(  # (copy_ into it raises, after the objects before it loaded)
                    f"{path_str(path)} is an expanded tensor (stride 0: its elements share "
                    "memory), which cannot hold the checkpoint's values; keep a tensor of its "
                    "own in the state (.clone() it)"
                )
            meta = tensors_meta.get(n["key"])
            if meta is not None and list(meta[1]) != list(obj.shape):
                problems.append(
                    f"{path_str(path)}: shape {list(meta[1])} in checkpoint, {list(obj.shape)} here"
                )
            if meta is not None:
                dtypes(path_str(path), meta[0], str(obj.dtype).removeprefix("torch."))
            return
        if is_stateful(obj):
            if not (isinstance(n, dict) and n.get(TAG) == "stateful"):
                problems.append(
                    f"{path_str(path)}: checkpoint holds {_describe(n)}, not the state of a "
                    f"{_qualname(obj)}"
                )
                return
            _refuse_first(obj, n)
            if isinstance(obj, torch.optim.Optimizer):
                problems.extend(_optimizer_problems(obj, n, path))
                cast.extend(_optimizer_casts(obj, n, tensors_meta, path))
            return
        if isinstance(obj, Mapping):
            items = _node_items(n)
            if items is None:
                problems.append(f"{path_str(path)}: checkpoint holds {_describe(n)}, not a dict")
                return
            if not _has_live_objects(obj):
                return  # plain data (counters, histories): replaced wholesale on restore
            missing = [k for k in obj if k not in items]
            if _absent_allowed(obj, missing):  # kept as they are: the object said so
                missing = []
            unexpected = [k for k in items if k not in obj]
            if partial:
                left_out.extend(path_str((*path, k)) for k in unexpected)
                unexpected = []
            problems.extend(_key_problems(path, missing, unexpected))
            hint = _explain(obj, missing, unexpected, items)
            if hint:
                problems.append(f"{path_str(path)}: {hint}")
            for k in obj:
                if k in items:
                    rec(obj[k], items[k], (*path, k))
            return
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            seq = _node_seq(n)
            if seq is None:
                problems.append(
                    f"{path_str(path)}: checkpoint holds {_describe(n)}, not a sequence"
                )
                return
            if _has_live_objects(obj) and len(seq) != len(obj):
                problems.append(
                    f"{path_str(path)}: {len(seq)} items in checkpoint, {len(obj)} here"
                )
                return
            for i, (o, s) in enumerate(zip(obj, seq, strict=False)):
                rec(o, s, (*path, i))

    rec(state, structure, ())
    if problems:
        only_unexpected = not partial and all("unexpected keys in" in p for p in problems)
        raise CheckpointMismatchError(
            "the checkpoint does not fit the objects it is loaded into:\n  - "
            + "\n  - ".join(problems)
            + (
                "\nTo load a part of the state (the model alone, say), open the Checkpointer "
                "with read_only=True."
                if only_unexpected
                else ""
            )
            + "\nIf this directory belongs to another model or run, use a new dirpath "
            "(or resume='never' to start fresh and leave those checkpoints alone)."
        )
    warn_cast(cast, *through)
    warn_cast(cast_here, *through, this_rank=True)
    if left_out:
        log.info("restore: not loaded, as the state does not hold them: %s", ", ".join(left_out))
    return left_out


def warn_cast(cast: Sequence[str], *through: str, this_rank: bool = False) -> None:
    """Say, at the user's line, that the tensors ``cast`` (``"where: saved in checkpoint, here
    here"``) load in another dtype: a resume in another precision is not exact. ``through``:
    a framework's directories between the user's line and the library. Tensors of the state
    every rank holds alike: said once, on rank 0; ``this_rank`` (its ``PerRank`` state): said
    by this rank, naming it (:mod:`.notices`)."""
    if not cast:
        return
    msg = (
        f"{len(cast)} tensor(s) of the checkpoint are cast to the dtype they have here, so "
        "the resume is not exact: "
        + "; ".join(cast[:5])
        + (f" (and {len(cast) - 5} more)" if len(cast) > 5 else "")
    )
    level = caller_stacklevel(*through)
    if this_rank:
        warnings.warn(notices.on_this_rank(msg), stacklevel=level)
    else:
        notices.say_once(log, msg, stacklevel=level)


def _optimizer_casts(
    opt: torch.optim.Optimizer,
    n: dict[str, Any],
    tensors_meta: Mapping[str, tuple[str, list[int]]],
    path: tuple[Any, ...],
) -> list[str]:
    """The optimizer state tensors that torch's ``load_state_dict`` casts to the dtype of their
    floating-point parameter (every state tensor but ``step``): a checkpoint of an fp32 run
    loaded into a bf16 one rounds its Adam moments too."""
    sd = _node_items(n.get("state"))
    state = _node_items(sd.get("state")) if sd else None
    params = [p for g in opt.param_groups for p in g["params"]]
    out = []
    for idx, entry in (state or {}).items():
        if not isinstance(idx, int) or not 0 <= idx < len(params):
            continue
        here = str(params[idx].dtype).removeprefix("torch.")
        if not params[idx].is_floating_point():
            continue
        for key, t in (_node_items(entry) or {}).items():
            if key == "step" or not (isinstance(t, dict) and t.get(TAG) == "tensor"):
                continue
            spec = tensors_meta.get(t["key"])
            if spec is not None and spec[0] != here:
                where = path_str((*path, "state", idx, key))
                out.append(f"{where}: {spec[0]} in checkpoint, {here} here")
    return out


def _optimizer_problems(
    opt: torch.optim.Optimizer, n: dict[str, Any], path: tuple[Any, ...]
) -> list[str]:
    """Why the saved optimizer state ``n`` would not load into ``opt``, checked before anything
    is loaded (its own ``load_state_dict`` raises only after the model was loaded): another
    optimizer class, or other parameter groups (their number, the parameters in each, or their
    shapes, where the checkpoint recorded them)."""
    here = {_qualname(opt), _qualname(hookable(opt))}  # a wrapper, or what it steps
    if n.get("type") not in here and isinstance(n.get("type"), str):
        return [
            f"{path_str(path)}: a {n['type']} in the checkpoint, a {_qualname(hookable(opt))} here"
        ]
    groups = _node_seq((_node_items(n.get("state")) or {}).get("param_groups"))
    if groups is None:
        return []
    live_groups = getattr(opt, "param_groups", None)  # (a wrapper may not have its own)
    if not isinstance(live_groups, list):
        return []
    saved = [len(_node_seq((_node_items(g) or {}).get("params")) or []) for g in groups]
    live = [len(g.get("params", ())) for g in live_groups if isinstance(g, dict)]
    if saved != live:
        return [
            f"{path_str(path)}: parameter groups of {saved} parameter(s) in the checkpoint, "
            f"of {live} here"
        ]
    shapes, here_shapes = n.get("param_shapes"), param_shapes(opt)
    if not isinstance(shapes, list) or here_shapes is None:  # written before it was recorded
        return []
    odd = [
        f"group {g} parameter {i}: {s} in the checkpoint, {h} here"
        for g, (gs, gh) in enumerate(zip(shapes, here_shapes, strict=False))
        for i, (s, h) in enumerate(zip(gs, gh, strict=False))
        if list(s) != list(h)
    ]
    if odd:
        return [
            f"{path_str(path)}: the optimizer steps parameters of other shapes than the "
            f"checkpoint's state belongs to (given in another order, or of another model): "
            + "; ".join(odd[:3])
            + (f" (and {len(odd) - 3} more)" if len(odd) > 3 else "")
        ]
    return []


def _key_problems(path: tuple[Any, ...], missing: list[Any], unexpected: list[Any]) -> list[str]:
    out = []
    if missing:
        out.append(f"{path_str(path)}: missing keys in checkpoint: {_short(missing)}")
    if unexpected:
        out.append(f"{path_str(path)}: unexpected keys in checkpoint: {_short(unexpected)}")
    return out


def _short(keys: list[Any], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
