"""The Transformers callback under the Trainer's FSDP (accelerate's FSDP2 ``fully_shard``, the
default, or FSDP1): the model's and optimizer's shards in the checkpoint tree as one
:class:`~resilient_callbacks.dcp.Sharded` part, and the model's own class for the export record.

Under FSDP each rank holds a shard of every parameter and of its optimizer state. The Trainer's
own ``save_steps`` gathers or pickles them through accelerate's ``save_fsdp_model``; here every
rank writes its shards into its own files, in the background like any other save, and a resume
reshards them onto however many ranks the re-run has (see docs/fsdp.md). Every rank calls these
alike, at ``train()``'s start (after accelerate prepared the model and the optimizer)."""

from __future__ import annotations

from typing import Any

__all__ = ["plain_class", "sharded_tree"]


def sharded_tree(trainer: Any, tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with a :class:`Sharded` part (key ``"sharded"``) in place of the model and the
    optimizer. ``trainer.model_wrapped`` is the module accelerate sharded (FSDP2: the model
    itself, turned into an ``FSDPModule``; FSDP1: its ``FullyShardedDataParallel`` root)."""
    from ..dcp import Sharded

    out = {k: v for k, v in tree.items() if k not in ("model", "optimizer")}
    out["sharded"] = Sharded(trainer.model_wrapped, tree["optimizer"])
    return out


def plain_class(model: Any) -> tuple[Any, type]:
    """The module inside FSDP's wrapping and its own class: FSDP1 keeps the model as
    ``_fsdp_wrapped_module``; FSDP2 swaps the model's class for a subclass (``FSDP<Name>``,
    bases ``FSDPModule`` and the class), whose first non-FSDP base is the model's own."""
    model = getattr(model, "_fsdp_wrapped_module", model)
    cls = type(model)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return model, cls
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return model, cls
