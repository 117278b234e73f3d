"""The engine's counters in a checkpoint (``global_steps``, ``global_samples``,
``micro_steps``, ``skipped_steps``), with what a resume checks first, before anything else of
the engine is loaded: the dtype at ZeRO 0, the LR scheduler's kind, and the hyper-parameters
the run was configured with. Part of :func:`.engine_state.engine_state`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import CheckpointMismatchError, caller_stacklevel, warn_and_log
from .zero_part import configured_hyperparameters, warn_changed_hyperparameters

log = logging.getLogger("resilient_callbacks")

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


class EngineCounters:
    """The engine's step and sample counters (what ``engine.global_steps`` reports).
    ``caller_sets_boundaries``: the caller calls ``step()`` once per optimizer step and tells
    the engine where each accumulation boundary is (accelerate does, for the Trainer), so
    ``micro_steps`` counts optimizer steps and needs no aligning."""

    def __init__(self, engine: Any, caller_sets_boundaries: bool = False) -> None:
        self.engine = engine
        self.caller_sets_boundaries = caller_sets_boundaries
        # ZeRO 0 (the ZeroPart records them at 1-3): the optimizer's hyper-parameters as this
        # run configured them, for warn_changed_hyperparameters at a resume
        zero0 = int(engine.zero_optimization_stage()) == 0
        self._configured = configured_hyperparameters(engine) if zero0 else None

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: int(getattr(self.engine, k)) for k in COUNTERS if hasattr(self.engine, k)
        }
        out["dtype"] = _dtype(self.engine)  # (read by a ZeRO 0 restore: _refuse_a_dtype_change)
        out["lr_scheduler"] = _scheduler_class(self.engine)  # (_refuse_a_scheduler_change)
        if self._configured is not None:
            out["configured_param_groups"] = self._configured
        return out

    def refuse_saved(self, saved: dict[str, Any]) -> None:
        """Every rank, at restore, before anything loads or any other problem is listed
        (``fit.check_fits``): a dtype change at ZeRO 0, which the optimizer's class (DeepSpeed's
        wrapper for fp16 and bf16, the torch optimizer for fp32) would report otherwise, and an
        LR scheduler of another kind, whatever key of the state comes first."""
        dtype, scheduler = saved.get("dtype"), saved.get("lr_scheduler")
        self._refuse_a_dtype_change(dtype if isinstance(dtype, str) else None)
        self._refuse_a_scheduler_change(scheduler if isinstance(scheduler, str) else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (refuse_saved did both, at a Checkpointer's restore; again for other callers)
        self._refuse_a_dtype_change(state.get("dtype"))
        self._refuse_a_scheduler_change(state.get("lr_scheduler"))
        if self._configured is not None:  # (before the optimizer's own load restores them)
            warn_changed_hyperparameters(
                state.get("configured_param_groups"), self._configured, self.engine
            )
        for k, v in state.items():
            if k in COUNTERS:
                setattr(self.engine, k, int(v))
        self._align_micro_steps()

    def _refuse_a_dtype_change(self, saved: str | None) -> None:
        """ZeRO 0: refuse a checkpoint trained in another dtype. The optimizer is saved whole,
        as DeepSpeed made it for that dtype (fp16 and bf16: a wrapper holding fp32 master
        weights and a loss scaler; fp32: the torch optimizer), so its state does not fit:
        loaded, a bf16 engine took an fp16 run's dynamic loss scaler, and an fp32 checkpoint
        failed inside the wrapper's load_state_dict (KeyError: 'dynamic_loss_scale') with the
        module already loaded; fp16 or bf16 -> fp32 was refused as another optimizer class,
        with no word of the dtype. Checked by :meth:`refuse_saved` before anything is loaded.
        (ZeRO 1-3 resume across dtypes; a checkpoint of before the dtype was recorded is not
        checked.)"""
        now = _dtype(self.engine)
        if saved is None or saved == now or int(self.engine.zero_optimization_stage()) != 0:
            return
        raise CheckpointMismatchError(
            f"the checkpoint was trained in {saved} and this engine trains in {now}, at ZeRO "
            "stage 0, where the optimizer is saved whole as DeepSpeed builds it for one dtype "
            "(for fp16 and bf16 a wrapper with fp32 master weights and a loss scaler): its state "
            f'does not fit. Resume in {saved} (the config\'s "fp16"/"bf16" sections as the '
            "run that saved it had them), or start a new run from the saved weights "
            "(`resilient-ckpt export DIR OUT` writes them whole; train in a new dirpath). ZeRO "
            "stages 1-3 resume across dtypes"
        )

    def _refuse_a_scheduler_change(self, saved: str | None) -> None:
        """Refuse an LR scheduler of another kind than the checkpoint's, whose saved state does
        not fit it: torch's keep their rates and epoch, DeepSpeed's only their iteration (a
        change between those failed in the scheduler's load_state_dict, KeyError
        'last_batch_iteration' or 'lr_lambdas', with the rest already loaded; between two
        torch schedulers, one took the other's attributes). Between DeepSpeed's schedulers
        (WarmupLR, WarmupDecayLR, OneCycle, ...) the restored iteration enters the new schedule.
        A scheduler in one run only is a key mismatch, refused before this (explain_key_mismatch).
        Checked by :meth:`refuse_saved` before anything is loaded: it ran only in
        load_state_dict, before the rest only while "counters" was the state's first key."""
        now = _scheduler_class(self.engine)
        if saved is None or now is None or saved == now:
            return
        if all(c.startswith("deepspeed.runtime.lr_schedules.") for c in (saved, now)):
            return
        raise CheckpointMismatchError(
            f"the checkpoint's LR scheduler is {saved}, this engine's {now}: the saved state of "
            "one does not fit the other. Configure the scheduler the run that saved it had (the "
            'config\'s "scheduler", or lr_scheduler= to initialize), or start a new run from the '
            "saved weights (`resilient-ckpt export DIR OUT` writes them whole; train in a new "
            "dirpath). DeepSpeed's own schedulers may replace each other: the restored iteration "
            "goes on in the new schedule"
        )

    def _align_micro_steps(self) -> None:
        """A checkpoint is saved at a gradient-accumulation boundary, so its micro-step count is
        a multiple of the run's ``gradient_accumulation_steps``. If it is not one of this run's
        (the value was changed between the runs), DeepSpeed would take the next optimizer step
        after fewer micro-batches than configured, each scaled for the full count: count on
        from the next multiple instead, and say so."""
        e = self.engine
        gas = int(e.gradient_accumulation_steps())
        managed = (
            e.managed_gradient_accumulation()
            if hasattr(e, "managed_gradient_accumulation")
            else True
        )
        if self.caller_sets_boundaries or not managed or getattr(e, "zenflow", False):
            return
        if gas <= 0 or e.micro_steps % gas == 0:
            return
        was = int(e.micro_steps)
        e.micro_steps = was + gas - was % gas
        msg = (
            f"the checkpoint's micro-step count ({was}) is not a multiple of "
            f"gradient_accumulation_steps={gas} (it was saved with another value): counting on "
            f"from {e.micro_steps}, so the next optimizer step accumulates {gas} micro-batches"
        )
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            log.info(msg)
        else:
            warn_and_log(log, msg, UserWarning, stacklevel=caller_stacklevel())


def _scheduler_class(engine: Any) -> str | None:
    """The class of the engine's LR scheduler, by module and name, or None without one."""
    s = getattr(engine, "lr_scheduler", None)
    return None if s is None else f"{type(s).__module__}.{type(s).__qualname__}"


def _dtype(engine: Any) -> str | None:
    """The dtype the engine trains its module in (``"bfloat16"``), as the manifest names it."""
    p = next(engine.module.parameters(), None)
    return None if p is None else str(p.dtype).replace("torch.", "")
