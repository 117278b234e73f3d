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

import copy
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..data import ResumableDataLoader
from ..inplace import as_live_keys
from ..state_marks import DROPPED, RANK0, PerRank
from ..wrapped import with_metadata
from .conversion import Converter, HparamsConversionWarning  # noqa: F401 (re-exported)
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


class DataReceiver(Receiver):
    """The ``"data"`` restore target (:class:`LoaderStates`); on fewer ranks than the save, it
    says what takes the place of the ranks gone's entries (their train dataloaders' positions,
    their callbacks' states), once it holds this rank's (``stand_in_for_gone_ranks``)."""

    def stand_in_for_gone_ranks(self) -> tuple[str, str]:
        held = self.value if isinstance(self.value, Mapping) else {}
        loaders = list(held.get("loaders") or [])
        other = [i for i, s in enumerate(loaders) if not ResumableDataLoader.is_state(s)]
        callbacks = (
            "; every rank's callbacks (EarlyStopping, ModelCheckpoint, ...) resume with rank "
            "0's states"
            if held.get("callbacks")
            else ""
        )
        if not other:
            said = (
                "no train dataloader saved a position"
                if not loaders
                else "the train dataloaders are ResumableDataLoaders (a plain DataLoader is "
                "made one), whose position is the same on every rank: rank 0's is loaded, and "
                "the rest of the epoch is sharded over this run's ranks, each sample once"
            )
            return RANK0, said + callbacks + ". Nothing to do."
        which = ", ".join(f"#{i}" for i in other)
        return DROPPED, (
            f"the position of train dataloader(s) {which} is each rank's own and cannot be "
            "sharded anew (not a ResumableDataLoader: a StatefulDataLoader, a loader of your "
            "own), so the ranks gone's positions in them are dropped and this run's ranks "
            "resume them from their own: until the epoch ends they do not hand out the rest "
            "the saving ranks had left (samples may be trained twice or not at all); later "
            "epochs are whole" + callbacks + ". To keep the data order, resume on the number "
            "of ranks that saved, or pass a plain DataLoader (made resumable) or a "
            "ResumableDataLoader"
        )


def receivers() -> dict[str, Any]:
    return {
        "lightning": Receiver(),
        "state_dict": Receiver(),
        "optimizer_states": Receiver(),
        "data": PerRank(DataReceiver()),
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
