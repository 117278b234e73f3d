"""What a save checks of what the caller hands it: the metrics, and the state's optimizers.

:func:`check_metrics` runs at every ``Checkpointer.step``/``save`` and refuses at once a metric
that is no number (without reading a tensor: no device synchronization); :func:`clean_metrics`
turns them into JSON numbers when a save writes its manifest; :func:`warn_unsaved_params`
warns, at a Checkpointer's first save, when an optimizer of the state steps tensors the state
does not hold. Every rank calls them on the training thread, with the same arguments (no
collectives). Moved from ``saving.py``, which imports them from here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from . import statetree, structure
from .errors import AT_CALLER
from .notices import say_once
from .optim import two_pass_base, unsaved_inner_optimizers, unsaved_params

__all__ = ["check_metrics", "clean_metrics", "warn_unsaved_params"]

log = logging.getLogger(__name__)


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Metrics as JSON numbers (tensors read, non-finite values as None)."""
    out: dict[str, float | None] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor):
            v = v.detach().float().item()
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r}={v!r} is not a number") from None
        out[str(k)] = f if math.isfinite(f) else None
    return out


def check_metrics(metrics: Mapping[str, Any] | None) -> None:
    """Every step(): refuse at once what :func:`clean_metrics` could not turn into a number at
    the next save, hours later perhaps, without reading a tensor (no device synchronization)."""
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor):
            if v.numel() == 1:
                continue
            what = f"a tensor of shape {tuple(v.shape)}"
        else:
            try:
                float(v)
                continue
            except (TypeError, ValueError):
                what = f"{v!r:.80}"
        raise TypeError(
            f"metric {k!r} is {what}: metrics are numbers, a Python number or a one-element "
            "tensor (e.g. loss.detach() or loss.mean())"
        )


def warn_unsaved_params(state: Any, saved: list[torch.Tensor]) -> None:
    """Warn, once per Checkpointer, when an optimizer of ``state`` steps tensors that the
    state does not hold (:func:`.optim.unsaved_params`), or holds an optimizer whose state the
    state does not hold (:func:`.optim.unsaved_inner_optimizers`)."""
    inner = unsaved_inner_optimizers(
        [
            (structure.path_str(path), opt)
            for path, opt in statetree.leaves(state)
            if isinstance(opt, torch.optim.Optimizer) or two_pass_base(opt) is not None
        ],
        saved,
    )
    if inner:
        say_once(  # (the state's structure: the same on every rank)
            log,
            f"{inner[0]} is an optimizer that {inner[0].rsplit('.', 1)[0]} holds and steps; its "
            "state (momentum, moments) is in no state_dict() the state saves, so a resume "
            "would start it afresh. Put it into the state too (e.g. {'opt': sam, "
            "'base_opt': sam.base_optimizer})",
            stacklevel=AT_CALLER,
        )
    missing = unsaved_params(statetree.optimizers(state), saved)
    if missing:
        e = missing[0]
        say_once(
            log,
            f"the state's optimizer(s) step {len(missing)} tensor(s) that the state does not "
            f"hold (e.g. {str(e.dtype).removeprefix('torch.')} {list(e.shape)}): a resume "
            "restores the optimizer's moments for them but not their values. Put what the "
            "optimizer updates -- fp32 master weights kept apart from the model, say -- into "
            "the state",
            stacklevel=AT_CALLER,
        )
