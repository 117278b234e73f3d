"""Per-parameter views of a ZeRO optimizer's partitions: the one layout every stage shares.

Whatever the stage, each rank of a ZeRO 1, 2 or 3 engine holds, for every trainable parameter,
one contiguous range ``[start, start + numel)`` of the *flattened* parameter (possibly empty), in
fp32 (the master weights) and in each optimizer moment (``exp_avg``, ``exp_avg_sq``, ...). A
checkpoint stores exactly those ranges, named by parameter, so that a rank of *another* world
size, or another stage, finds the bytes it needs by overlapping ranges: the layout of
DeepSpeed's "universal" checkpoint, without gathering at save time and without its offline
conversion.

A view translates between that layout and the optimizer's own flat buffers:

- :meth:`ZeroView.fragments` -- this rank's ranges, as live tensors (views into the flat fp32
  partition and the optimizer state), for the capture;
- :meth:`ZeroView.set_fragment` -- copy a restored range into the live buffers;
- :meth:`ZeroView.finish_load` -- *collective* (every rank of the data-parallel group): refresh
  the low-precision parameters from the restored fp32 masters, as DeepSpeed does after a step.

The stage-specific views (ZeRO 1-2's, ZeRO 3's) and :func:`~.stage_views.view_of`, which picks
one, are :mod:`.stage_views`'s. The few DeepSpeed objects involved (fragment addresses, the loss
scaler) are read attribute by attribute into JSON values, never pickled.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointMismatchError, UnsupportedStateError

FP32 = "fp32"  # the key of the master weights beside the optimizer's own state keys
FROZEN = "frozen"  # the key of a ZeRO-3 frozen parameter's range (in no optimizer)

# The loss scaler's attributes that make up its state (DeepSpeed's LossScaler and
# DynamicLossScaler). Read and written one by one: the object itself is never serialized.
SCALER_FIELDS = (
    "cur_scale",
    "cur_iter",
    "last_overflow_iter",
    "cur_hysteresis",
    "scale_factor",
    "scale_window",
    "min_scale",
    "delayed_shift",
    "consecutive_hysteresis",
    "dynamic",
)


@dataclass
class Fragment:
    """One parameter's range on this rank: ``start``/``numel`` in the flattened parameter,
    ``tensors`` the live fp32 and moment tensors of that range (1-D, ``numel`` long)."""

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    tensors: dict[str, torch.Tensor]


def _plain(value: Any) -> Any:
    """A JSON value of an optimizer hyper-parameter (tuples as lists), but a one-value tensor
    stays a tensor: its number is read from the snapshot's host copy in the background
    (``ZeroPart``), as an ``.item()`` here would make the training thread wait for the GPU."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise UnsupportedStateError(
        f"an optimizer hyper-parameter of type {type(value).__name__} cannot be saved as JSON"
    )


def _is_moment(v: Any, flat: torch.Tensor) -> bool:
    """An optimizer state entry that is a moment: one value per element of the partition."""
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == flat.shape


def _value(e: dict[str, Any], device: torch.device) -> Any:
    """A saved single value (:meth:`ZeroView.values`) as it was: a number, or a tensor of its
    dtype and shape, on the parameters' device where it was there (a capturable optimizer)."""
    if e.get("tensor_dtype") is None:
        return e["value"]
    dtype = getattr(torch, str(e["tensor_dtype"]))
    where = device if e.get("on_params_device") else torch.device("cpu")
    return torch.tensor(e["value"], dtype=dtype, device=where).reshape(e.get("shape") or [])


def _family(name: str) -> str:
    """The algorithm an optimizer class implements: ``FusedAdam``, ``DeepSpeedCPUAdam``,
    ``Adam`` and ``AdamW`` are all ``adam`` (one state layout); ``SGD`` is ``sgd``."""
    n = name.lower()
    for prefix in ("deepspeedcpu", "deepspeed", "fused", "cpu"):
        n = n.removeprefix(prefix)
    return "adam" if n in ("adam", "adamw") else n


def _restore_like(old: Any, new: Any) -> Any:
    """``new`` (from JSON) in the type of the value it replaces (betas stay a tuple)."""
    if isinstance(old, tuple) and isinstance(new, list):
        return tuple(new)
    if isinstance(old, torch.Tensor):
        return torch.tensor(new, dtype=old.dtype, device=old.device)
    return new


class ZeroView:
    """Base of the stage-specific views. ``optimizer`` is the engine's ZeRO optimizer."""

    stage: int

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        self.names: dict[int, str] = {id(p): n for n, p in engine.module.named_parameters()}

    # -- what the subclasses provide
    def fragments(self) -> Iterator[Fragment]:
        raise NotImplementedError

    def set_fragment(self, name: str, key: str, value: torch.Tensor) -> None:
        raise NotImplementedError

    def finish_load(self) -> None:
        raise NotImplementedError

    def _flat_partitions(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _flat_groups(self) -> list[int]:
        """The optimizer parameter group of each flat partition (ZeRO 1-2: one per group)."""
        return list(range(len(self._flat_partitions())))

    def layout(self) -> str | None:
        """A digest of what, besides the data-parallel size, decides which range of each
        parameter a rank holds, the same on every rank; None where nothing else does (ZeRO 3
        partitions each parameter on its own)."""
        return None

    def frozen_fragments(self) -> Iterator[Fragment]:
        """This rank's ranges of the frozen parameters where ZeRO partitions them (stage 3;
        at stages 1-2 they are replicated and saved with the module), under :data:`FROZEN`."""
        return iter(())

    def set_frozen(self, name: str, value: torch.Tensor) -> None:
        raise NotImplementedError

    # -- shared
    def needed(self) -> dict[str, tuple[tuple[int, ...], int, int]]:
        """Every parameter this rank holds: name -> (shape, start, numel)."""
        return {f.name: (f.shape, f.start, f.numel) for f in self.fragments()}

    def moment_keys(self) -> list[str]:
        keys: set[str] = set()
        for flat in self._flat_partitions():
            for k, v in self.optimizer.optimizer.state.get(flat, {}).items():
                if _is_moment(v, flat):
                    keys.add(k)
        return sorted(keys)

    def values(self) -> list[dict[str, Any]]:
        """Per flat partition: the optimizer's state entries that are neither a moment nor
        ``step``, each one value (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``), the same
        on every rank (they follow the step count and the hyper-parameters). Any other kind of
        entry cannot be saved by parameter range: refused, naming it."""
        inner = self.optimizer.optimizer
        out: list[dict[str, Any]] = []
        for flat in self._flat_partitions():
            entries: dict[str, Any] = {}
            for k, v in inner.state.get(flat, {}).items():
                if k == "step" or _is_moment(v, flat):
                    continue
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    entries[k] = {
                        "value": v.detach(),  # its number: see _plain
                        "tensor_dtype": str(v.dtype).replace("torch.", ""),
                        "shape": list(v.shape),
                        "on_params_device": v.device == flat.device and v.device.type != "cpu",
                    }
                elif isinstance(v, (bool, int, float)):
                    entries[k] = {"value": v, "tensor_dtype": None}
                else:
                    what = (
                        f"a tensor of shape {list(v.shape)}"
                        if isinstance(v, torch.Tensor)
                        else type(v).__name__
                    )
                    raise UnsupportedStateError(
                        f"{type(inner).__name__}'s state {k!r} is {what}: neither one value "
                        f"nor a tensor the length of the partition ({flat.numel()}), so it "
                        "cannot be saved by parameter range. Use an optimizer whose state is "
                        "moments and single values (Adam, AdamW, SGD, NAdam, ...)"
                    )
            out.append(entries)
        return out

    def ensure_moments(self, keys: list[str]) -> None:
        """Create the optimizer's moment tensors where it has none yet (torch optimizers make
        them at their first step; a restore comes before it)."""
        state = self.optimizer.optimizer.state
        for flat in self._flat_partitions():
            st = state.setdefault(flat, {})
            for k in keys:
                if k != FP32 and k not in st:
                    st[k] = torch.zeros_like(flat, memory_format=torch.contiguous_format)

    def scalars(self) -> dict[str, Any]:
        """The optimizer's step counts and hyper-parameters, and the loss scaler's state: JSON
        values, but one-value tensors as such (no device sync: :func:`_plain`)."""
        inner = self.optimizer.optimizer
        steps = []
        for flat in self._flat_partitions():
            s = inner.state.get(flat, {}).get("step")
            dtype = str(s.dtype).replace("torch.", "") if isinstance(s, torch.Tensor) else None
            steps.append(None if s is None else {"value": _plain(s), "tensor_dtype": dtype})
        groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in inner.param_groups]
        scaler = getattr(self.optimizer, "loss_scaler", None)
        scaler_state = {k: _plain(getattr(scaler, k)) for k in SCALER_FIELDS if hasattr(scaler, k)}
        return {
            "optimizer": type(inner).__name__,
            "steps": steps,
            "values": self.values(),
            "value_groups": self._flat_groups(),
            "param_groups": groups,
            "loss_scaler": scaler_state,
        }

    def check_optimizer(self, saved: dict[str, Any]) -> None:
        """Refuse a checkpoint another kind of optimizer wrote (its moments, values and
        hyper-parameters do not apply), or one with another number of parameter groups.
        DeepSpeed's and torch's implementations of one algorithm (``FusedAdam``,
        ``DeepSpeedCPUAdam``, ``AdamW``) are one kind: a run moved between a GPU and the CPU
        resumes."""
        was, now = saved.get("optimizer"), type(self.optimizer.optimizer).__name__
        if was is not None and _family(was) != _family(now):  # (None: a checkpoint of before
            raise CheckpointMismatchError(  # this record, not checked)
                f"the checkpoint's optimizer state was written by {was}; this engine's optimizer "
                f"is {now}: its moments, step counts and hyper-parameters do not apply. Resume "
                f"with the optimizer the run was started with ({was}), or start the new "
                "optimizer afresh from the trained weights: `resilient-ckpt export DIR OUT` "
                "writes them as consolidated safetensors to load into the model, then train in "
                "a new dirpath"
            )
        self._check_groups(saved.get("param_groups", []))

    def _check_groups(self, groups: list[Any]) -> None:
        """Refuse a checkpoint whose optimizer had another number of parameter groups: each
        group's hyper-parameters (lr, weight_decay, ...) are restored by position."""
        now = len(self.optimizer.optimizer.param_groups)
        if len(groups) != now:
            raise CheckpointMismatchError(
                f"the checkpoint's optimizer has {len(groups)} parameter group(s), this "
                f"engine's {now}: each group's hyper-parameters (lr, weight_decay, ...) are "
                "restored by position, so they do not fit. Give the optimizer the parameter "
                "groups the run that saved it had, or start a new run from the saved weights "
                "(`resilient-ckpt export DIR OUT` writes them whole)"
            )

    def load_scalars(self, saved: dict[str, Any], same_dtype: bool = True) -> None:
        """The step counts, values and hyper-parameters; the loss scaler's state where the
        checkpoint was trained in the engine's dtype (``same_dtype``), else the engine keeps
        its own (an fp16 scaler from a bf16 run's would start at a static scale of 1)."""
        inner = self.optimizer.optimizer
        flats = self._flat_partitions()
        steps = [s for s in saved.get("steps", []) if s is not None]
        if steps and any(s != steps[0] for s in steps):
            raise UnsupportedStateError(f"the saved optimizer step counts differ: {steps}")
        for flat in flats:
            st = inner.state.setdefault(flat, {})
            if steps:
                value, dtype = steps[0]["value"], steps[0]["tensor_dtype"]
                st["step"] = (
                    torch.tensor(value, dtype=getattr(torch, dtype)) if dtype is not None else value
                )
        groups = saved.get("param_groups", [])
        self._check_groups(groups)
        for live, g in zip(inner.param_groups, groups, strict=True):
            for k, v in g.items():
                live[k] = _restore_like(live.get(k), v)
        for flat, entries in zip(flats, self._values_by_flat(saved), strict=True):
            st = inner.state.setdefault(flat, {})
            for k, e in entries.items():
                st[k] = _value(e, flat.device)
        if not same_dtype:
            return
        scaler = getattr(self.optimizer, "loss_scaler", None)
        for k, v in saved.get("loss_scaler", {}).items():
            if scaler is not None and k in SCALER_FIELDS and hasattr(scaler, k):
                setattr(scaler, k, _restore_like(getattr(scaler, k), v))

    def _values_by_flat(self, saved: dict[str, Any]) -> list[dict[str, Any]]:
        """The saved single values for each live flat partition, by its parameter group: the
        partitions need not be the saved ones (ZeRO 2 -> 3 splits a group into sub-groups,
        and their number follows ``sub_group_size`` and the number of ranks)."""
        values, groups = saved.get("values") or [], saved.get("value_groups")
        live = self._flat_groups()
        if groups is None and len(values) == len(live):
            return list(values)  # (a checkpoint of before this record: by position)
        if groups is None:
            groups = [0] * len(values)
        by_group: dict[int, dict[str, Any]] = {}
        for g, entries in zip(groups, values, strict=True):
            by_group.setdefault(int(g), entries)
        keys = sorted({k for entries in values for k in entries})
        if keys and any(g not in by_group for g in live):
            raise UnsupportedStateError(
                f"the checkpoint holds the optimizer's single values {keys} for "
                f"parameter groups {sorted(by_group)}, not for every group the engine's "
                f"partitions belong to ({sorted(set(live))})"
            )
        return [by_group.get(g, {}) for g in live]


def overlap(a_start: int, a_numel: int, b_start: int, b_numel: int) -> tuple[int, int]:
    """The overlap of two ranges as (start, numel); numel 0 if they do not overlap."""
    lo, hi = max(a_start, b_start), min(a_start + a_numel, b_start + b_numel)
    return lo, max(0, hi - lo)


def numel_of(shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape) if shape else 1
