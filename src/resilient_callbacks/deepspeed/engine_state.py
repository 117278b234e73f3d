"""What of a ``DeepSpeedEngine`` goes into a checkpoint, as a Checkpointer state.

- ZeRO stage 0: the engine is replicated like DDP. The module and the optimizer (a torch
  optimizer, or DeepSpeed's bf16/fp16 wrapper whose ``state_dict`` holds only tensors and
  numbers: fp32 master copies, moments, loss scale) are written once, by rank 0.
- ZeRO stages 1-3: the partitioned fp32 masters and moments are a :class:`~.zero_part.ZeroPart`
  (each rank writes its own ranges); the module's persistent buffers and, at stages 1-2, its
  frozen parameters (replicated) are written once.
- Always: the engine's counters (optimizer steps, samples, micro-steps, skipped steps) and its
  learning-rate scheduler, if any.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedStateError
from .zero_part import ZeroPart

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


class EngineCounters:
    """The engine's step and sample counters (what ``engine.global_steps`` reports)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, int]:
        return {k: int(getattr(self.engine, k)) for k in COUNTERS if hasattr(self.engine, k)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k, v in state.items():
            if k in COUNTERS:
                setattr(self.engine, k, int(v))


def _unsupported(engine: Any) -> str | None:
    """Why ``engine`` cannot be checkpointed by us, or None."""
    if getattr(engine, "mpu", None) is not None:
        return (
            "model (tensor/pipeline) parallelism through an mpu is not supported yet: only data "
            "parallelism (ZeRO 0-3 over all ranks)"
        )
    if type(engine).__name__ == "PipelineEngine":
        return "DeepSpeed's PipelineEngine is not supported yet"
    zero = engine.zero_optimization_stage()
    if zero and (engine.zero_cpu_offload() or _offload_param(engine)):
        return (
            "ZeRO CPU/NVMe offload is not supported yet (the optimizer state then lives in "
            "DeepSpeed's swap buffers); remove offload_optimizer/offload_param from the config"
        )
    if engine.optimizer is None:
        return "the engine has no optimizer (an inference-only engine has nothing to resume)"
    if zero == 3 and any(not p.requires_grad for p in engine.module.parameters()):
        return (
            "ZeRO stage 3 with frozen parameters is not supported yet (they are partitioned "
            "outside the optimizer)"
        )
    return None


def _offload_param(engine: Any) -> bool:
    try:
        return bool(engine.zero_offload_param())
    except AttributeError:
        return False


def module_extras(engine: Any) -> dict[str, torch.Tensor]:
    """The persistent buffers and (stages 1-2) frozen parameters: replicated, not partitioned."""
    module = engine.module
    out: dict[str, torch.Tensor] = {}
    for name, buf in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if buf is not None and leaf not in sub._non_persistent_buffers_set:
            out[f"buffer/{name}"] = buf
    for name, p in module.named_parameters():
        if not p.requires_grad:
            out[f"frozen/{name}"] = p.data
    return out


def engine_state(engine: Any) -> dict[str, Any]:
    """The Checkpointer state of ``engine``; raises :class:`UnsupportedStateError` for what is
    not supported, saying what is."""
    why = _unsupported(engine)
    if why is not None:
        raise UnsupportedStateError(f"resilient_callbacks.deepspeed: {why}")
    state: dict[str, Any] = {"counters": EngineCounters(engine)}
    if engine.zero_optimization_stage() == 0:
        state["module"] = engine.module
        state["optimizer"] = engine.optimizer
    else:
        state["zero"] = ZeroPart(engine)
        extras = module_extras(engine)
        if extras:
            state["module_extras"] = extras
    if engine.lr_scheduler is not None:
        state["lr_scheduler"] = engine.lr_scheduler
    return state
