"""Lightning's checkpoint dictionary as a state the core ``Checkpointer`` saves and restores.

The saved state mirrors ``Trainer.save_checkpoint``'s dictionary (``dump_checkpoint``), split
into four entries so the core can treat each part the way it should:

- ``"state_dict"``: the LightningModule's weights, through :class:`ModuleState`, an
  ``nn.Module`` whose parameters are the model's, so the core's overlapped snapshot copies them
  while the next forward/backward runs;
- ``"optimizer_states"``: :class:`OptimizerStates`, all optimizers as one value (an
  ``Optimizer`` subclass for the same reason, whose step pre-hooks are not used: the callback
  waits for the copy in ``on_before_optimizer_step``, after the closure);
- ``"data"``: the train dataloaders' positions (``combined_loader`` in Lightning's fit-loop
  state), per rank;
- ``"lightning"``: everything else (loop progress, callbacks, LR schedulers, precision plugin,
  datamodule, hyper-parameters, ``on_save_checkpoint`` extras), converted to tensors and JSON
  values by :class:`Converter`.

Nothing is dumped until the core really saves: each entry calls :meth:`SaveContext.dump` from its
``state_dict()``, which runs ``dump_checkpoint`` (and so the user's ``on_save_checkpoint`` hooks)
at most once per save. :func:`receivers` is the matching restore target; :func:`assemble` puts
Lightning's dictionary back together for ``_CheckpointConnector``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import logging
import math
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from ..errors import UnsupportedStateError, warn_and_log
from ..inplace import as_live_keys
from ..structure import PerRank
from ..wrapped import with_metadata
from .rank_callbacks import STOP_RNG_KEY, put_back, saved

log = logging.getLogger("resilient_callbacks.lightning")

#: keys of the saved state; restore expects exactly these
KEYS = ("lightning", "state_dict", "optimizer_states", "data")

# where Lightning keeps the train dataloaders' states in its checkpoint
_LOADER_PATH = ("loops", "fit_loop", "state_dict", "combined_loader")
# in Lightning's checkpoint dictionary as we save it: the run stopped after this step before its
# end (trainer.should_stop: early stopping, max_time, the user's code), so a re-run trains nothing
STOPPED_KEY = "resilient_callbacks_stopped"
# ... and trainer.accumulate_grad_batches then (a re-run with another one is warned about)
ACCUMULATE_KEY = "resilient_callbacks_accumulate"
# ... and the validation loaders' persistent worker iterators existed at this step (so the
# resumed run's first validation must not draw their base seed from the global RNG)
VAL_ITERATORS_KEY = "resilient_callbacks_val_iterators"
# ... and this rank's random streams before a validation run only because training stopped
# (STOP_RNG_KEY, saved per rank: :mod:`.rank_callbacks`, :func:`.stops.before_validation`)


def lossy_keys(*objs: Any) -> frozenset[str]:
    """The checkpoint keys of the hyper-parameters of ``objs`` (the LightningModule, the
    datamodule or ``None``): stored as ``repr`` where they cannot be saved (:class:`Converter`)."""
    names = (
        "CHECKPOINT_HYPER_PARAMS_KEY",
        "CHECKPOINT_HYPER_PARAMS_NAME",
        "CHECKPOINT_HYPER_PARAMS_TYPE",
    )
    return frozenset(
        getattr(obj, attr)
        for obj in objs
        if obj is not None
        for attr in names
        if isinstance(getattr(obj, attr, None), str)
    )


class HparamsConversionWarning(UserWarning):
    """A hyper-parameter could not be saved as it is and was stored as its ``repr`` string."""


# ----------------------------------------------------------------------------- conversion


class Converter:
    """Makes Lightning checkpoint contents saveable without pickle.

    Converted (and reported once, at INFO): ``pathlib`` paths -> ``str``, enums -> their value,
    ``argparse.Namespace`` and dataclasses -> ``dict``, named tuples -> ``dict``, classes ->
    their qualified name, OmegaConf containers -> plain containers. Tensors, NumPy arrays,
    JSON values, containers and objects with ``state_dict()`` pass through to the core.

    Anything else is an error (:class:`UnsupportedStateError` naming the key path), except under
    hyper-parameter keys (``lossy_keys``): hyper-parameters are only recorded, never needed to
    resume, so such a value is stored as its ``repr`` with a :class:`HparamsConversionWarning`.
    """

    def __init__(self) -> None:
        self._reported: set[str] = set()

    def convert(self, obj: Any, lossy_keys: frozenset[str] = frozenset()) -> Any:
        if not isinstance(obj, Mapping):
            return self._conv(obj, (), False)
        return {
            k: self._conv(v, (k,), isinstance(k, str) and k in lossy_keys) for k, v in obj.items()
        }

    def _note(self, path: tuple[Any, ...], what: str) -> None:
        key = _path(path)
        if key not in self._reported:
            self._reported.add(key)
            log.info("checkpoint[%s]: %s", key, what)

    def _conv(self, obj: Any, path: tuple[Any, ...], lossy: bool) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        if isinstance(obj, (torch.Tensor, np.ndarray, np.generic, torch.dtype, torch.device)):
            return obj
        if isinstance(obj, torch.Size):
            return obj
        if isinstance(obj, PerRank):
            return PerRank(self._conv(obj.obj, path, lossy))
        omega = _omegaconf_container(obj)
        if omega is not None:
            self._note(path, f"OmegaConf {type(obj).__name__} saved as a plain container")
            return self._conv(omega, path, lossy)
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                key = self._key(k, (*path, k), lossy)
                out[key] = self._conv(v, (*path, k), lossy)
            return out
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            self._note(path, f"named tuple {_qualname(obj)} saved as a dict")
            return {f: self._conv(getattr(obj, f), (*path, f), lossy) for f in obj._fields}
        if isinstance(obj, (list, tuple)):
            items = [self._conv(v, (*path, i), lossy) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, (set, frozenset)):
            conv = [self._conv(v, (*path, "<item>"), lossy) for v in obj]
            return set(conv) if isinstance(obj, set) else frozenset(conv)
        if isinstance(obj, pathlib.PurePath):
            self._note(path, "path saved as str")
            return str(obj)
        if isinstance(obj, enum.Enum):
            self._note(path, f"enum {_qualname(obj)} saved as its value")
            return self._conv(obj.value, path, lossy)
        if isinstance(obj, argparse.Namespace):
            self._note(path, "argparse.Namespace saved as a dict")
            return self._conv(vars(obj), path, lossy)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            self._note(path, f"dataclass {_qualname(obj)} saved as a dict")
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return self._conv(fields, path, lossy)
        if isinstance(obj, type):
            self._note(path, "class saved as its qualified name")
            return f"{obj.__module__}.{obj.__qualname__}"
        if callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            return obj  # the core saves its state_dict()
        if lossy:
            key = _path(path)
            if key not in self._reported:
                self._reported.add(key)
                msg = (
                    f"hyper-parameter checkpoint[{key}] has type {_qualname(obj)}, which cannot "
                    "be saved without pickle; it is stored as its repr() string and will not be "
                    "restored. Resuming does not need it. To keep it, pass JSON-able values to "
                    "save_hyperparameters() (or exclude it with ignore=[...])."
                )
                warn_and_log(log, msg, HparamsConversionWarning, stacklevel=2)
            return repr(obj)
        raise UnsupportedStateError(
            f"Lightning checkpoint entry checkpoint[{_path(path)}] has type {_qualname(obj)}, "
            "which cannot be saved without pickle. It comes from a callback's state_dict(), a "
            "datamodule's state_dict() or an on_save_checkpoint() hook: make it return tensors "
            "and JSON-able values (dict, list, tuple, str, int, float, bool, None), or an "
            "object with state_dict()/load_state_dict()."
        )

    def _key(self, k: Any, path: tuple[Any, ...], lossy: bool) -> Any:
        if k is None or isinstance(k, (bool, int, float, str, tuple)):
            return k
        if isinstance(k, (pathlib.PurePath, enum.Enum, type)):
            conv = self._conv(k, path, lossy)
            return conv if isinstance(conv, (str, int, float, bool)) else str(conv)
        if lossy:
            return repr(k)
        raise UnsupportedStateError(
            f"Lightning checkpoint entry checkpoint[{_path(path[:-1])}] has a key of type "
            f"{_qualname(k)}; only str, int, float, bool, None and tuples can be saved"
        )


def _omegaconf_container(obj: Any) -> Any:
    mod = type(obj).__module__
    if not mod.startswith("omegaconf"):
        return None
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:  # pragma: no cover
        return None
    if isinstance(obj, Container):
        return OmegaConf.to_container(obj, resolve=True)
    return None


def _qualname(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _path(path: tuple[Any, ...]) -> str:
    return "][".join(repr(p) for p in path) if path else ""


# ----------------------------------------------------------------------------- saving


class SaveContext:
    """One save's view of the trainer: Lightning's checkpoint dictionary, dumped at most once.

    ``overrides``: used by the exception path to put a step boundary's loop progress and module
    buffers back (see ``ResilientCheckpoint``)."""

    def __init__(
        self,
        dump_fn: Callable[[], dict[str, Any]],
        lossy_keys: frozenset[str],
        converter: Converter,
    ) -> None:
        self._dump_fn = dump_fn
        self._lossy_keys = lossy_keys
        self._converter = converter
        self._dump: dict[str, Any] | None = None
        self._rest: dict[str, Any] | None = None
        self.fit_loop_override: dict[str, Any] | None = None
        self.buffer_override: dict[str, torch.Tensor] | None = None
        self._marks: Callable[[], dict[str, Any]] | None = None

    def reset(self, marks: Callable[[], dict[str, Any]] | None = None) -> None:
        """Forget the previous dump (called at every step boundary). ``marks()``: asked only
        when a save dumps, what to record with it (:data:`STOPPED_KEY`, ...); the entries
        that are true (a flag set, a dict not empty) are added to the dictionary."""
        self._dump = None
        self._rest = None
        self.fit_loop_override = None
        self.buffer_override = None
        self._marks = marks

    def dump(self) -> dict[str, Any]:
        if self._dump is None:
            d = dict(self._dump_fn())
            if isinstance(cms := d.get("current_model_state"), dict):  # (WeightAveraging)
                d["state_dict"] = with_metadata(cms, d["state_dict"])  # the module's versions
            if self.fit_loop_override is not None:
                d["loops"] = {**d["loops"], "fit_loop": copy.deepcopy(self.fit_loop_override)}
            if self.buffer_override:  # the trained model's (WeightAveraging moves it aside)
                key = "current_model_state" if "current_model_state" in d else "state_dict"
                sd = {k: self.buffer_override.get(k, v) for k, v in d[key].items()}
                d[key] = with_metadata(d[key], sd)
            if self._marks is not None:
                d.update({k: v for k, v in self._marks().items() if v})
            self._dump = d
        return self._dump

    def loader_states(self) -> list[Any]:
        return list(_get(self.dump(), _LOADER_PATH) or [])

    def rest(self) -> dict[str, Any]:
        """Everything but the weights, optimizer states and loader positions, converted."""
        if self._rest is None:
            d = {
                k: v
                for k, v in self.dump().items()
                if k not in ("state_dict", "optimizer_states", STOP_RNG_KEY)
            }
            d = _without(d, _LOADER_PATH)
            self._rest = self._converter.convert(d, self._lossy_keys)
        return self._rest


class LightningState:
    """``"lightning"``: the converted rest of Lightning's checkpoint dictionary."""

    def __init__(self, ctx: SaveContext) -> None:
        self._ctx = ctx

    def state_dict(self) -> dict[str, Any]:
        return self._ctx.rest()

    def load_state_dict(self, sd: Any) -> None:  # pragma: no cover - restore uses receivers
        raise TypeError("restore into receivers()")


class LoaderStates:
    """``"data"``: the states of the stateful train dataloaders and this rank's callbacks'
    states (:mod:`.rank_callbacks`), wrapped in ``PerRank``."""

    def __init__(self, ctx: SaveContext, converter: Converter) -> None:
        self._ctx = ctx
        self._converter = converter

    def state_dict(self) -> dict[str, Any]:
        states = self._ctx.loader_states()
        own = {k: self._converter._conv(v, (k,), False) for k, v in saved(self._ctx.dump()).items()}
        return {"loaders": self._converter._conv(states, ("combined_loader",), False), **own}

    def load_state_dict(self, sd: Any) -> None:  # pragma: no cover - restore uses receivers
        raise TypeError("restore into receivers()")


class ModuleState(torch.nn.Module):
    """``"state_dict"``: the LightningModule's state dict as Lightning dumps it (after the
    ``on_save_checkpoint`` hooks), reported by an ``nn.Module`` whose ``parameters()`` are the
    model's: the core copies those in the background (``overlap_snapshot``)."""

    _ctx: SaveContext
    _module: torch.nn.Module

    def __init__(self, ctx: SaveContext, module: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_ctx", ctx)  # plain attributes: not registered submodules
        object.__setattr__(self, "_module", module)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self._module.parameters(recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return with_metadata(sd := self._ctx.dump()["state_dict"], dict(sd))  # (its versions)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover
        raise TypeError("restore into receivers()")


class _Handles:
    def __init__(self, handles: list[RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class OptimizerStates(torch.optim.Optimizer):
    """``"optimizer_states"``: every optimizer's state, as Lightning dumps them, in one value.

    An ``Optimizer`` subclass only so that the core recognises the optimizer state tensors and
    the parameters in its ``param_groups`` as changed by optimizer steps alone (copied in the
    background by an overlapped save; never known unchanged by an incremental one). It never
    steps.
    Step *post*-hooks registered on it go to the real optimizers (the core's
    ``save_on_exception`` bookkeeping); step *pre*-hooks are not forwarded: a pre-hook runs before
    the closure (forward/backward), and the callback instead waits for the snapshot in
    ``on_before_optimizer_step``, after it."""

    def __init__(self, ctx: SaveContext, optimizers: list[torch.optim.Optimizer]) -> None:
        # no super().__init__(): this object holds no parameters of its own
        self._ctx = ctx
        self._optimizers = list(optimizers)

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        merged: dict[Any, Any] = {}
        for opt in self._optimizers:
            merged.update(opt.state)
        return merged

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every optimizer's groups: which parameters the optimizer steps change."""
        return [g for opt in self._optimizers for g in opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": list(self._ctx.dump().get("optimizer_states", []))}

    def load_state_dict(self, state_dict: Any) -> None:  # pragma: no cover
        raise TypeError("restore into receivers()")

    def step(self, closure: Any = None) -> Any:  # pragma: no cover - never called
        raise TypeError("OptimizerStates never steps")

    def register_step_pre_hook(self, hook: Any) -> Any:
        return _Handles([])

    def register_step_post_hook(self, hook: Any) -> Any:
        return _Handles([opt.register_step_post_hook(hook) for opt in self._optimizers])

    def __repr__(self) -> str:
        return f"OptimizerStates({len(self._optimizers)} optimizer(s))"


def saved_state(
    ctx: SaveContext,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    converter: Converter,
) -> dict[str, Any]:
    """The state handed to ``Checkpointer.step``/``save`` (cheap: nothing is dumped yet)."""
    return {
        "lightning": LightningState(ctx),
        "state_dict": ModuleState(ctx, module),
        "optimizer_states": OptimizerStates(ctx, optimizers),
        "data": PerRank(LoaderStates(ctx, converter)),
    }


# ----------------------------------------------------------------------------- restoring


class Receiver:
    """A restore target that keeps whatever state dict it is given."""

    def __init__(self) -> None:
        self.value: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: Any) -> None:
        self.value = sd


def receivers() -> dict[str, Any]:
    return {
        "lightning": Receiver(),
        "state_dict": Receiver(),
        "optimizer_states": Receiver(),
        "data": PerRank(Receiver()),
    }


def assemble(holder: dict[str, Any], module: torch.nn.Module | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dictionary from a restored :func:`receivers` holder; the weights
    (``WeightAveraging``'s ``current_model_state`` too) keyed and versioned as ``module`` has them."""
    ckpt = dict(holder["lightning"].value)
    ckpt["state_dict"] = holder["state_dict"].value
    for k in ("state_dict", "current_model_state"):  # (both by the versions of state_dict's)
        if module is not None and isinstance(ckpt.get(k), dict):
            ckpt[k] = as_live_keys(with_metadata(holder["state_dict"].value, ckpt[k]), module)
    ckpt["optimizer_states"] = list(holder["optimizer_states"].value["optimizers"])
    put_back(ckpt, holder["data"].obj.value)  # this rank's callbacks' states
    loaders = holder["data"].obj.value["loaders"]
    if loaders:
        node: dict[str, Any] = ckpt
        for k in _LOADER_PATH[:-1]:
            node = node.setdefault(k, {})
        node[_LOADER_PATH[-1]] = list(loaders)
    return ckpt


# ----------------------------------------------------------------------------- helpers


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return d


def _without(d: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """A copy of ``d`` without ``path`` (only the dicts along the path are copied)."""
    if not path or not isinstance(d, Mapping) or path[0] not in d:
        return d
    out = dict(d)
    if len(path) == 1:
        del out[path[0]]
    else:
        out[path[0]] = _without(out[path[0]], path[1:])
    return out


def finite_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The numeric scalars of ``trainer.callback_metrics`` (tensors stay tensors: the core
    converts them only when it saves)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            if v.numel() == 1:
                out[str(k)] = v.detach()
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[str(k)] = float(v) if math.isfinite(v) else float("nan")
    return out


def position(checkpoint: Mapping[str, Any], epoch_end: bool) -> str:
    """Where in training a Lightning checkpoint is, in words (for the resume message)."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    batch = loops.get("epoch_loop.batch_progress", {}).get("current", {}).get("processed", "?")
    # completed, as trainer.current_epoch: "processed" runs one ahead after Lightning's own
    # resume from some checkpoints (ModelCheckpoint's, written as a fit() stopped)
    epoch = loops.get("epoch_progress", {}).get("current", {}).get("completed", "?")
    return f"end of epoch {epoch}" if epoch_end else f"epoch {epoch}, {batch} batch(es) into it"
