"""The Transformers callback under ``TrainingArguments(deepspeed=...)``: the engine's state in
the checkpoint tree, and the options of the DeepSpeed config's ``"resilient_checkpoint"``
section (see docs/deepspeed.md). Imports DeepSpeed-side modules only when DeepSpeed is on."""

from __future__ import annotations

from typing import Any

from ..adapter import with_section

__all__ = ["continue_flos", "engine_tree", "take_section", "with_section"]


def take_section(trainer: Any, args: Any) -> dict[str, Any] | None:
    """Under DeepSpeed: the ``"resilient_checkpoint"`` section of the Trainer's DeepSpeed config
    (validated), removed from every copy of the config DeepSpeed keeps, so that DeepSpeed never
    writes it into a checkpoint of its own. None without DeepSpeed or without a section."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    from ..deepspeed.section import SECTION, validate

    found = None
    hf_config = getattr(args, "hf_deepspeed_config", None)
    engine = getattr(trainer, "model_wrapped", None)
    holders = [
        getattr(hf_config, "config", None),
        getattr(engine, "config", None),
        getattr(getattr(engine, "_config", None), "_param_dict", None),
    ]
    for holder in holders:
        if isinstance(holder, dict) and SECTION in holder:
            found = holder.pop(SECTION)
    if found is None:  # removed on our behalf before DeepSpeed saw it (see claim())
        import resilient_callbacks_ds_guard

        found = resilient_callbacks_ds_guard.take()
    if found is None:
        return None
    options = validate(found, "the Trainer's DeepSpeed config")
    return options


def engine_tree(trainer: Any, tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with the engine's state in place of the model, optimizer and scheduler: the
    engine owns the (ZeRO-partitioned) model and optimizer state, and holds the scheduler the
    Trainer made unless accelerate kept it outside (in a DeepSpeedSchedulerWrapper)."""
    from ..deepspeed.engine_state import engine_state

    engine = trainer.model_wrapped
    out = {k: v for k, v in tree.items() if k not in ("model", "optimizer", "scheduler")}
    out["engine"] = engine_state(engine, caller_sets_boundaries=_accelerate_sets_boundaries())
    sched = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
    if sched is not None and sched is not getattr(engine, "lr_scheduler", None):
        out["scheduler"] = sched
    return out


def _accelerate_sets_boundaries() -> bool:
    """Does accelerate call ``engine.step()`` once per optimizer step, telling the engine where
    each accumulation boundary is (its wrapper's ``backward(loss, sync_gradients=...)``)?
    Versions without that argument called it at every micro-batch and let DeepSpeed count."""
    import inspect

    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    return "sync_gradients" in inspect.signature(DeepSpeedEngineWrapper.backward).parameters


def continue_flos(trainer: Any) -> None:
    """After a restore under ZeRO-3: count the resumed run's first micro-batch as the
    uninterrupted run counted it. The Trainer adds ``floating_point_ops(inputs)`` after each
    micro-batch, from ``model.num_parameters()``, which counts a partitioned parameter as 0;
    a new engine's first micro-batch leaves every parameter partitioned, where the
    uninterrupted run's engine held its persistent ones, so ``total_flos`` came out lower.
    The first call's inputs are counted again at the second call (the engine as the
    uninterrupted run's was), and the difference added. Every rank (each counts its own);
    the Trainer's code is untouched: one instance attribute, removed after the second call."""
    engine = getattr(trainer, "model_wrapped", None)
    stage = getattr(engine, "zero_optimization_stage", None)
    if not getattr(trainer, "is_deepspeed_enabled", False) or stage is None or stage() != 3:
        return
    count = trainer.floating_point_ops
    first: list[tuple[Any, float]] = []

    def counted(inputs: Any) -> Any:
        value = count(inputs)
        if not first:
            first.append((inputs, float(value)))
            return value
        again = float(count(first[0][0])) - first[0][1]
        if trainer.__dict__.get("floating_point_ops") is counted:
            del trainer.__dict__["floating_point_ops"]
        return value + again

    trainer.floating_point_ops = counted
