"""What the Transformers adapter records of a Trainer besides the model, optimizer and scheduler,
and how it checks and gives it back: the checkpoint's format and data settings, the callbacks'
exportable states, and the ``resilient/*`` values it adds to the Trainer's log. Functions of
plain values; every rank calls them alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.trainer_callback import ExportableState

from ..checkpointer import Checkpointer
from ..errors import CheckpointMismatchError

FORMAT = "resilient_callbacks.transformers/2"
METRIC_PREFIX = "resilient/"


def check_compatible(values: Mapping[str, Any], signature: Mapping[str, Any], step: int) -> None:
    """Refuse a checkpoint another adapter wrote, or one whose position in the epoch (a batch
    index) means something else with this run's data settings."""
    if values.get("format") != FORMAT:
        raise CheckpointMismatchError(
            f"the checkpoint of step {step} was not written by the Transformers adapter "
            f"(format {values.get('format')!r}, expected {FORMAT!r}); use another dirpath"
        )
    saved = values["data"]
    diff = [
        f"{k}: {saved.get(k)} in the checkpoint, {signature[k]} here"
        for k in signature
        if saved.get(k) != signature[k]
    ]
    if diff:
        raise CheckpointMismatchError(
            f"the checkpoint of step {step} was written with other data settings, so its "
            "position in the epoch (a batch index) means something else here: "
            + "; ".join(diff)
            + ". Resume with the same dataset, per_device_train_batch_size, "
            "gradient_accumulation_steps and number of processes, or start a new run "
            "(another dirpath, or resume='never')."
        )


def callback_states(trainer: Any, exclude: Any) -> dict[str, list[Any]]:
    """The exportable states of the Trainer's callbacks (as the Trainer's own checkpoints keep
    them), by class name."""
    out: dict[str, list[Any]] = {}
    for cb in trainer.callback_handler.callbacks:
        if cb is not exclude and isinstance(cb, ExportableState):
            out.setdefault(type(cb).__name__, []).append(cb.state())
    return out


def restore_callback_states(trainer: Any, saved: Mapping[str, list[Any]], exclude: Any) -> None:
    for name, states in saved.items():
        live = [
            cb
            for cb in trainer.callback_handler.callbacks
            if cb is not exclude and isinstance(cb, ExportableState) and type(cb).__name__ == name
        ]
        for cb, st in zip(live, states, strict=False):
            for attr, value in (st.get("attributes") or {}).items():
                setattr(cb, attr, value)


def scalar_metrics(values: Mapping[Any, Any] | None) -> dict[str, float]:
    """The numeric values of a log or evaluation dict (not ours, not flags), as floats."""
    out: dict[str, float] = {}
    for k, v in (values or {}).items():
        if str(k).startswith(METRIC_PREFIX) or isinstance(v, bool):
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float)):
            out[str(k)] = float(v)
    return out


def save_logs(ckpt: Checkpointer) -> dict[str, float]:
    """The ``resilient/*`` values logged after a save: what the loop waited, and the newest
    committed checkpoint's step, seconds and size."""
    logs: dict[str, float] = {}
    last = ckpt.last_save
    if ckpt.config.async_save and ckpt.blocking_seconds:
        logs[METRIC_PREFIX + "save_blocking_s"] = round(ckpt.blocking_seconds[-1], 6)
    elif last is not None:
        logs[METRIC_PREFIX + "save_blocking_s"] = round(last.seconds, 6)
    if last is not None:
        logs[METRIC_PREFIX + "last_committed_step"] = last.step
        logs[METRIC_PREFIX + "last_committed_s"] = round(last.seconds, 6)
        logs[METRIC_PREFIX + "last_committed_mb"] = round(last.bytes / 1e6, 3)
    return logs
