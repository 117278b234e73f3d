"""What of a ``DeepSpeedEngine`` goes into a checkpoint, as a Checkpointer state.

- ZeRO stage 0: the engine is replicated like DDP. The module and the optimizer (a torch
  optimizer, or DeepSpeed's bf16/fp16 wrapper whose ``state_dict`` holds only tensors and
  numbers: fp32 master copies, moments, loss scale) are written once, by rank 0.
- ZeRO stages 1-3: the partitioned fp32 masters and moments are a :class:`~.zero_part.ZeroPart`
  (each rank writes its own ranges), and so, at stage 3, are the frozen parameters' partitions;
  at stages 1-2 the frozen parameters (replicated) are written once.
- Always: the module's persistent buffers, by every rank (:class:`RankBuffers`): unlike DDP,
  DeepSpeed does not broadcast buffers after it starts, so a BatchNorm's running statistics or
  a running normaliser differ between ranks, and each rank must get its own back.
- Always: the engine's counters (optimizer steps, samples, micro-steps, skipped steps) and its
  learning-rate scheduler, if any; and its Random-LTD scheduler, if Random-LTD is on.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import (
    CheckpointMismatchError,
    UnsupportedStateError,
)
from ..inplace import Advice
from ..state_marks import PerRank
from .counters import EngineCounters
from .zero_part import ZeroPart, warn_untrained_absent

log = logging.getLogger("resilient_callbacks")


def _unsupported(engine: Any) -> str | None:
    """Why ``engine`` cannot be checkpointed by us, or None."""
    if getattr(engine, "mpu", None) is not None:
        return (
            "model (tensor/pipeline) parallelism through an mpu is not supported yet: only data "
            "parallelism (ZeRO 0-3 over all ranks)"
        )
    if type(engine).__name__ == "PipelineEngine":
        return "DeepSpeed's PipelineEngine is not supported yet"
    experts = _expert_parallel(engine)
    if experts:
        return (
            f"MoE expert parallelism ({experts}) is not supported yet: each rank holds other "
            "experts under the same parameter names, so one rank's would overwrite another's. "
            "MoE layers with ep_size=1 (every rank holds every expert) are not refused"
        )
    zero = engine.zero_optimization_stage()
    problem = _offload_problem(zero, _offload_devices(engine), _partial_offload(engine))
    if problem is not None:
        return problem
    if engine.optimizer is None:
        return "the engine has no optimizer (an inference-only engine has nothing to resume)"
    return None


def _expert_parallel(engine: Any) -> str | None:
    """The MoE layers of ``engine`` that split their experts over ranks (``ep_size`` > 1), as
    text, or None."""
    if not getattr(engine, "has_moe_layers", False):
        return None
    split = sorted(
        {
            f"ep_size={m.ep_size}"
            for m in engine.module.modules()
            if type(m).__name__ == "MoE" and int(getattr(m, "ep_size", 1) or 1) > 1
        }
    )
    return ", ".join(split) or None


def _offload_problem(stage: int, devices: dict[str, str], partial: bool) -> str | None:
    """Why this ZeRO offload setting cannot be checkpointed by us, or None. Offload to the CPU
    is supported: the fp32 masters and moments are then ordinary host tensors."""
    if not stage or not devices:
        return None
    if "nvme" in devices.values():
        where = ", ".join(f"{k} to {v}" for k, v in devices.items())
        return (
            f"ZeRO NVMe offload ({where}) is not supported yet: the optimizer state or the "
            "parameters then live in DeepSpeed's swap files. Offload to the CPU "
            '("device": "cpu") is supported'
        )
    if partial:
        return (
            "partial ZeRO offload (offload_optimizer.ratio < 1, or super_offload) is not "
            'supported yet; offload all of the optimizer state ("ratio": 1.0) or none of it'
        )
    return None


def check_config(config: Any) -> None:
    """Refuse, before DeepSpeed builds anything, a config whose ZeRO offload we cannot
    checkpoint (:func:`engine_state` checks the engine again, for engines made elsewhere)."""
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if not isinstance(zero, dict):
        return
    devices: dict[str, str] = {}
    for key in ("offload_optimizer", "offload_param"):
        sub = zero.get(key)
        name = str(sub.get("device", "none")).lower() if isinstance(sub, dict) else "none"
        if name not in ("none", ""):
            devices[key] = name
    opt = zero.get("offload_optimizer")
    try:  # values DeepSpeed itself would reject, or "auto": left to the engine check
        stage = int(zero.get("stage", 0))
        partial = isinstance(opt, dict) and (
            float(opt.get("ratio", 1.0)) < 1.0 or bool(opt.get("super_offload", False))
        )
    except (TypeError, ValueError):
        return
    problem = _offload_problem(stage, devices, partial) or _bf16_optimizer_problem(
        config, stage, bool(devices)
    )
    if problem is not None:
        raise UnsupportedStateError(f"resilient_callbacks.deepspeed: {problem}")


def _bf16_optimizer_problem(config: dict[str, Any], stage: int, offload: bool) -> str | None:
    """ZeRO 1 with bf16 weights and fp32 gradient accumulation: DeepSpeed then trains with its
    BF16_Optimizer (not its ZeRO optimizer), whose state we do not read yet."""
    bf16 = config.get("bf16") or config.get("bfloat16")
    types = config.get("data_types")
    accum = types.get("grad_accum_dtype") if isinstance(types, dict) else None
    if (
        stage == 1
        and not offload
        and isinstance(bf16, dict)
        and bf16.get("enabled") is True
        and str(accum).lower() in ("fp32", "float32", "float", "torch.float32")
    ):
        return (
            'ZeRO stage 1 with bf16 and "data_types": {"grad_accum_dtype": "fp32"} (DeepSpeed\'s '
            "BF16_Optimizer) is not supported yet. ZeRO stage 2 with the same settings, or stage "
            "1 without grad_accum_dtype, is"
        )
    return None


def _offload_devices(engine: Any) -> dict[str, str]:
    """Where ZeRO offloads to, by config key (``{"offload_optimizer": "cpu"}``); empty without
    offload. ``device: none`` counts as no offload."""
    out: dict[str, str] = {}
    for key, getter in (
        ("offload_optimizer", "zero_offload_optimizer"),
        ("offload_param", "zero_offload_param"),
    ):
        cfg = getattr(engine, getter, lambda: None)()
        device = getattr(cfg, "device", None)
        name = str(getattr(device, "value", device)).lower()
        if cfg is not None and name not in ("none", ""):
            out[key] = name
    return out


def _partial_offload(engine: Any) -> bool:
    ratio = getattr(engine, "zero_partial_offload", lambda: 1.0)()
    return float(ratio) < 1.0 or bool(getattr(engine, "super_offload", lambda: False)())


class RankBuffers:
    """This rank's persistent module buffers (each rank's own: see the module docstring); a
    rank the checkpoint did not have takes rank 0's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, torch.Tensor]:
        return persistent_buffers(self.engine.module)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        live = persistent_buffers(self.engine.module)
        if set(state) != set(live):
            raise CheckpointMismatchError(
                f"the module's buffers differ from the checkpoint's: missing "
                f"{sorted(set(live) - set(state))[:10]}, unexpected {sorted(set(state) - set(live))[:10]}"
            )
        for name, t in state.items():
            live[name].copy_(t)


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's persistent buffers, by their state-dict names."""
    out: dict[str, torch.Tensor] = {}
    for name, buf in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if buf is not None and leaf not in sub._non_persistent_buffers_set:
            out[name] = buf
    return out


class ModuleExtras(dict[str, torch.Tensor]):
    """The parameters in no optimizer group, by ``frozen/<name>``. ``untrained``: those of them
    that require grad (not given to the optimizer), saved only since 2026-12-06: a checkpoint
    written before holds none of them, and may lack them (:meth:`missing_allowed`)."""

    def __init__(self) -> None:
        super().__init__()
        self.untrained: set[str] = set()

    def missing_allowed(self, missing: list[str]) -> bool:
        """Every rank, at restore (``fit.check_fits``): a checkpoint that lacks only
        ``untrained`` entries was written before they were saved; they keep this run's values,
        with a warning (the optimizer never changes them: seeded alike, they are the saved
        run's, as the version that wrote the checkpoint resumed them)."""
        if not missing or not set(missing) <= self.untrained:
            return False
        warn_untrained_absent([k.removeprefix("frozen/") for k in sorted(missing)])
        return True


def module_extras(engine: Any) -> ModuleExtras:
    """The parameters in no optimizer group at stages 1-2, replicated, not partitioned (at
    ZeRO 3 they are the ZeroPart's): the frozen ones, and those that require grad but were not
    given to the optimizer (which never changes them: the engine's ZeRO state lacks them)."""
    module = engine.module
    out = ModuleExtras()
    if engine.zero_optimization_stage() < 3:
        groups = getattr(engine.optimizer, "bit16_groups", None)
        trained = {id(p) for g in groups or () for p in g}
        for name, p in module.named_parameters():
            if id(p) not in trained if groups is not None else not p.requires_grad:
                out[f"frozen/{name}"] = p.data
                if p.requires_grad:
                    out.untrained.add(f"frozen/{name}")
    return out


class EngineState(dict[str, Any]):
    """The state of one engine, a dict that says which ZeRO stages a layout mismatch is about
    (stage 0 saves the whole module and optimizer, stages 1-3 the partitions)."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def missing_allowed(self, missing: list[str]) -> bool:
        """A checkpoint of before 2026-12-06 without ``module_extras``: allowed where all this
        engine's are parameters not given to the optimizer (:class:`ModuleExtras`)."""
        extras = self.get("module_extras")
        return (
            missing == ["module_extras"]
            and isinstance(extras, ModuleExtras)
            and extras.missing_allowed(list(extras))
        )

    def explain_key_mismatch(
        self,
        missing: list[str],
        unexpected: list[str],
        saved_keys: dict[str, list[str]] | None = None,
    ) -> str | None:
        frozen_then, frozen_now = "module_extras" in unexpected, "module_extras" in missing
        then = ", ".join((saved_keys or {}).get("module_extras", [])[:5]).replace("frozen/", "")
        now = ", ".join(sorted(self.get("module_extras", {}))[:5]).replace("frozen/", "")
        fix = (
            "so the saved state does not fit. Freeze the same parameters as the run that saved "
            "it, or start a new run from the saved weights (`resilient-ckpt export DIR OUT` "
            "writes them whole)"
        )
        zero = self.get("zero")
        zero3_frozen = self.stage == 3 and zero is not None and any(zero.view.frozen_fragments())
        if frozen_then and zero3_frozen:  # saved at ZeRO 1-2, frozen now too, at ZeRO 3
            return (
                f"the checkpoint was saved at ZeRO 1 or 2 with {then or 'some parameters'} "
                "frozen (requires_grad=False), which those stages save whole; this engine is "
                "ZeRO 3, which saves frozen parameters by partition: a stage change between 1-2 "
                "and 3 with frozen parameters is not supported yet. Resume at ZeRO 1 or 2, or "
                "start a new run from the saved weights (`resilient-ckpt export DIR OUT`)"
            )
        if frozen_then != frozen_now:
            change = (
                f"the checkpoint was saved with {then or 'some parameters'} frozen "
                "(requires_grad=False), and this engine trains every one"
                if frozen_then
                else f"this engine freezes {now} (requires_grad=False), and the checkpoint "
                "holds no frozen parameters saved whole: it was saved with every parameter "
                "trained, or at ZeRO 3, which saves frozen parameters by partition (a stage "
                "change between 3 and 1-2 with frozen parameters is not supported yet: resume "
                "at ZeRO 3)"
            )
            return (
                f"{change}. At ZeRO {self.stage} frozen parameters are saved apart from the "
                f"optimizer's partitions, {fix}"
            )
        saved_stage0 = "zero" in missing and "optimizer" in unexpected
        if not (saved_stage0 or ("optimizer" in missing and "zero" in unexpected)):
            return _scheduler_change(missing, unexpected)
        saved = (
            "the whole module and optimizer of a ZeRO stage 0 engine"
            if saved_stage0
            else "the optimizer partitions of a ZeRO stage 1, 2 or 3 engine"
        )
        return (
            f"the checkpoint holds {saved}; this engine is ZeRO stage "
            f"{self.stage}. Stages 1, 2 and 3 resume one another's checkpoints, stage 0 only "
            f'its own: set "zero_optimization": {{"stage": ...}} back, or start a new run '
            f"from the saved weights (`resilient-ckpt export DIR OUT` writes them whole)"
        )


def _scheduler_change(missing: list[str], unexpected: list[str]) -> str | None:
    """The words for an LR scheduler that one run had and the other not, or None."""
    if "lr_scheduler" not in missing + unexpected:
        return None
    had, has = ("no", "one") if "lr_scheduler" in missing else ("one", "none")
    return (
        f"the checkpoint was saved by an engine with {had} LR scheduler; this engine has {has} "
        '(the config\'s "scheduler", or lr_scheduler= to initialize): its position cannot be '
        "restored. Configure the scheduler as the run that saved it did, or start a new run "
        "(a new dirpath) from the saved weights (`resilient-ckpt export DIR OUT`)"
    )


def engine_state(engine: Any, caller_sets_boundaries: bool = False) -> dict[str, Any]:
    """The Checkpointer state of ``engine``; raises :class:`UnsupportedStateError` for what is
    not supported, saying what is. ``caller_sets_boundaries``: see :class:`EngineCounters`."""
    why = _unsupported(engine)
    if why is not None:
        raise UnsupportedStateError(f"resilient_callbacks.deepspeed: {why}")
    state = EngineState(engine.zero_optimization_stage())
    state["counters"] = EngineCounters(engine, caller_sets_boundaries)
    if engine.zero_optimization_stage() == 0:
        state["module"] = engine.module
        state["optimizer"] = engine.optimizer
    else:
        state["zero"] = ZeroPart(engine)
        extras = module_extras(engine)
        if extras:
            state["module_extras"] = extras
    if persistent_buffers(engine.module):  # after "module": each rank's own wins over rank 0's
        state["buffers"] = PerRank(RankBuffers(engine), new_ranks="rank0")
    if engine.lr_scheduler is not None:
        state["lr_scheduler"] = SchedulerState(engine.lr_scheduler)
    if _random_ltd_enabled(engine):
        state["random_ltd"] = engine.random_ltd_scheduler
    return state


def _random_ltd_enabled(engine: Any) -> bool:
    """Whether the engine runs DeepSpeed's Random-LTD (``data_efficiency.data_routing.
    random_ltd``): its scheduler counts the layer tokens consumed and the kept sequence length
    (numbers, the same on every rank), which DeepSpeed's own checkpoints hold as
    ``random_ltd``; ours hold them too, so a resume goes on counting where the run stopped."""
    enabled = getattr(engine, "random_ltd_enabled", None)
    return (
        callable(enabled)
        and bool(enabled())
        and getattr(engine, "random_ltd_scheduler", None) is not None
    )


def advice() -> Advice:
    """The restore's warnings in a DeepSpeed user's words: they never call ``restore()``; the
    checkpoint is loaded inside ``rcds.initialize`` (``deepspeed.initialize`` under our
    launcher) or ``rcds.attach``, so what to change is changed once that call returned."""
    after = (
        "once rcds.initialize (deepspeed.initialize under the resilient_callbacks.deepspeed.run "
        "launcher, or rcds.attach) has returned: it loaded the checkpoint"
    )
    return Advice(
        new_key=f"set it in the state you passed to rcds.attach {after}",
        new_settings=(
            f"set them on engine.lr_scheduler {after}, before the first engine.step() "
            "(`engine.lr_scheduler.T_max = 100`; see docs/deepspeed.md)"
        ),
        like="DeepSpeed's own load_checkpoint does",
    )


class SchedulerState:
    """The engine's LR scheduler, saved by its own ``state_dict``. DeepSpeed's schedulers
    (``WarmupLR``, ``WarmupDecayLR``, ``OneCycle``, ...) keep only ``last_batch_iteration``
    there: loaded, their ``get_last_lr()`` went on answering the value set when they were
    built (0.0 for a warm-up) until the next optimizer step, while the optimizer trained with
    the restored rate. After the load it answers the rate of the restored iteration, as after
    a step. Other schedulers (torch's save their last rates) are loaded as they are; a torch
    scheduler's settings (``T_max``, ...) come from the checkpoint, as with DeepSpeed's
    ``load_checkpoint``, and the restore names those that differ from the new code's
    (``HOLDS_SCHEDULER``: :func:`..inplace.apply` compares them, in the words of the
    Checkpointer's ``restore_advice``, :func:`advice`; DeepSpeed's keep only their iteration:
    the new config's settings apply)."""

    HOLDS_SCHEDULER = True  # its load_state_dict loads the whole state dict into .scheduler
    settings_name = "engine.lr_scheduler"  # what the restore's warning calls it

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> Any:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Any) -> None:
        s = self.scheduler
        s.load_state_dict(state)
        ours = type(s).__module__.startswith("deepspeed.") and hasattr(s, "_last_lr")
        if ours and getattr(s, "last_batch_iteration", -1) >= 0 and hasattr(s, "get_lr"):
            s._last_lr = list(s.get_lr())
