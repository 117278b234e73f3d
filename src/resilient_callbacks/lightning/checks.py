"""Checks and small decisions of the Lightning adapter: options, strategy, signals, when a step
is final or followed by validation, whether a checkpoint fits the model."""

from __future__ import annotations

import logging
import os
import signal
import warnings
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.nn.parameter import is_lazy

from .. import dist, module_versions, notices, scheduler_settings
from ..config import CheckpointerConfig
from ..errors import CheckpointMismatchError, ConfigError, caller_stacklevel
from ..fit import its_own_shape, key_differences, warn_cast
from . import stages

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer

ADAPTER_OWNED = frozenset({"save_on_exception"})  # handled by the adapter, not by the core


def validate(dirpath: Any, kwargs: dict[str, Any]) -> None:
    """Validate the Checkpointer options now, so a typo fails before training starts."""
    config_fields = {f.name for f in fields(CheckpointerConfig)}
    opts = {k: v for k, v in kwargs.items() if k in config_fields and k not in ADAPTER_OWNED}
    if "signals" in opts:
        opts["signals"] = tuple(opts["signals"])
    try:
        CheckpointerConfig(dirpath=os.fspath(dirpath) if dirpath else ".", **opts)
    except ConfigError:
        raise
    except Exception:  # anything else is checked again by the Checkpointer itself
        pass


def own_options(*, data_seed: Any, **flags: Any) -> None:
    """The callback's own options: each of ``flags`` True or False, ``data_seed`` an int or
    None."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: must be True or False")
    if data_seed is not None and (isinstance(data_seed, bool) or not isinstance(data_seed, int)):
        raise ConfigError(f"data_seed={data_seed!r}: must be an int or None")


def check_strategy(trainer: pl.Trainer) -> None:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    strategy = trainer.strategy
    from . import deepspeed
    from .sharded import strategy_classes

    supported: list[type] = [SingleDeviceStrategy, DDPStrategy]
    supported += strategy_classes()  # sharded state through dcp.Sharded
    ds = deepspeed.strategy_class()  # the engine's state, as the DeepSpeed adapter's
    if ds is not None:
        supported.append(ds)
    if not isinstance(strategy, tuple(supported)):
        raise ConfigError(
            f"ResilientCheckpoint does not support {type(strategy).__name__} yet. Supported: "
            "one device, DDP, FSDPStrategy (FSDP1) and ModelParallelStrategy (FSDP2 "
            "fully_shard / tensor parallel): sharded checkpoints, and DeepSpeedStrategy "
            "(ZeRO 0-3)."
        )


def signals(trainer: pl.Trainer) -> tuple[str, ...]:
    """The core's default signals, plus Slurm's requeue signal when Lightning's
    ``SLURMEnvironment`` would handle one (we handle it instead: no second save)."""
    sigs = ["SIGTERM", "SIGUSR1"]
    try:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        env = trainer._accelerator_connector.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal:
            name = signal.Signals(env.requeue_signal).name
            if name not in sigs:
                sigs.append(name)
    except Exception:  # pragma: no cover - defensive: fall back to the defaults
        pass
    return tuple(sigs)


def stops(trainer: pl.Trainer) -> bool:
    """Whether ``trainer.should_stop`` ends the fit here: Lightning trains on, with the flag
    set, until ``min_epochs``/``min_steps`` are met."""
    return bool(trainer.should_stop) and bool(trainer.fit_loop._can_stop_early)


def is_final(trainer: pl.Trainer, epoch_end: bool) -> bool:
    """Whether training ends after this step (so it is saved whatever the schedule says).
    ``epoch_end``: asked after the end of the step's epoch (Lightning counted it)."""
    if stops(trainer):
        return True
    if trainer.max_steps not in (-1, None) and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs != -1 and epoch_end:
        return trainer.current_epoch >= max_epochs  # counts the epoch that just ended
    return False


def check_model_fits(trainer: Any, saved: dict[str, Any], path: str) -> None:
    """A checkpoint of another model fails here, naming every key that does not fit, rather
    than deep inside ``load_state_dict``. Skipped for ``strict_loading=False`` modules, and left
    to Lightning's strict load for a module with an ``on_load_checkpoint`` hook. A
    tensor saved in another dtype than the one it has once the precision plugin has converted
    the module (after the restore) is cast: said with a warning, as the core says it."""
    module = trainer.lightning_module
    if module is None or not getattr(module, "strict_loading", True):
        return
    here = {k: v for k, v in module.state_dict().items() if torch.is_tensor(v)}
    live = {k: None if is_lazy(v) else list(v.shape) for k, v in here.items()}
    have = {k: list(v.shape) for k, v in saved.items() if torch.is_tensor(v)}
    upgraded = module_versions.upgraded(saved, module.state_dict())
    missing, unexpected, reshaped = key_differences(live, have, upgraded)
    reshaped = [k for k in reshaped if not its_own_shape(module, k, here[k])]
    problems = []
    if missing:
        problems.append(f"missing in the checkpoint: {', '.join(missing[:20])}")
    if unexpected:
        problems.append(f"not in the model: {', '.join(unexpected[:20])}")
    problems += [f"{k}: {have[k]} in the checkpoint, {live[k]} in the model" for k in reshaped[:20]]
    if problems and not is_overridden("on_load_checkpoint", module):
        # (a module's on_load_checkpoint, which Lightning calls before it loads the weights,
        # may make them fit: renamed layers; Lightning's strict load_state_dict then checks)
        raise CheckpointMismatchError(
            f"the checkpoint {path} does not fit this model:\n  - "
            + "\n  - ".join(problems)
            + "\nIf the directory belongs to another model or run, use a new dirpath (or "
            "resume='never' to start fresh and leave those checkpoints alone)."
        )
    to = _converted_to(trainer)
    final = {
        k: to if to is not None and t.is_floating_point() else t.dtype for k, t in here.items()
    }
    cast = [
        f"{k}: {str(v.dtype).removeprefix('torch.')} in checkpoint, "
        f"{str(final[k]).removeprefix('torch.')} here"
        for k, v in saved.items()
        if torch.is_tensor(v) and k in final and v.dtype != final[k]
    ]
    warn_cast(cast, os.path.dirname(os.path.dirname(pl.__file__)))  # at the user's fit() line


def accumulation(
    trainer: pl.Trainer, saved: Any, checkpoint: dict[str, Any], epoch_end: bool = False
) -> None:
    """Warn (at the user's ``fit()`` line) when ``accumulate_grad_batches`` differs from the
    checkpoint's: Lightning goes on silently, each optimizer step then taking another number of
    batches -- another global batch from the restored step on (the Transformers callback
    refuses that; the batch size, held by the data loader's position, is refused here too).
    With a ``GradientAccumulationScheduler``, the one it sets for the epoch of the step saved
    (in Lightning's restored ``checkpoint``). Resumed inside an epoch (not ``epoch_end``)
    whose trained batches are no multiple of the new value, the warning says that the first
    step takes fewer: Lightning steps where the epoch's batch count is a multiple of it."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    here = trainer.accumulate_grad_batches
    epoch = stages.epoch_counters(checkpoint).get("completed")
    for cb in callbacks(trainer):
        if isinstance(cb, GradientAccumulationScheduler) and isinstance(epoch, int):
            here = cb.get_accumulate_grad_batches(epoch)
    if isinstance(saved, int) and saved != here:
        done = batches_into_epoch(checkpoint)
        first = ""
        if not epoch_end and done and here > 1 and done % here:
            first = (
                f" (the first after the resume takes {here - done % here}: Lightning steps "
                f"where the epoch's batch count is a multiple of {here}, {done} batches were "
                "trained of the resumed epoch)"
            )
        notices.say_once(  # (the same on every rank: said once)
            log,
            f"accumulate_grad_batches={here} here, {saved} when the checkpoint was saved: each "
            f"optimizer step now takes {here} batch(es) instead of {saved}{first}, so the global "
            "batch changes from the restored step on and the run is not the one interrupted. "
            "Resume with the checkpoint's value to continue that run",
            UserWarning,
            stacklevel=caller_stacklevel(os.path.dirname(os.path.dirname(pl.__file__))),
        )


def batches_into_epoch(checkpoint: dict[str, Any]) -> int | None:
    """How many batches of its epoch a restored Lightning checkpoint had trained."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    done = loops.get("epoch_loop.batch_progress", {}).get("current", {}).get("processed")
    return done if isinstance(done, int) else None


def epoch_length(trainer: pl.Trainer, saved: Any, done: int | None, epoch_end: bool) -> None:
    """Every rank, after the train loaders are set up at a resume: ``limit_train_batches``
    other than the checkpoint's (``saved``) is taken as Lightning takes it, with a warning: the
    resumed epoch ends at the new length, counting the ``done`` batches it had trained, and so
    do the later ones. Refused (:class:`ConfigError`, on every rank) where the resumed epoch
    had trained that many batches already on any rank: Lightning would count it from 0 again
    and train up to that many more in it (its own ``ckpt_path`` resume does), where a user
    expects it over. Each rank's loaders give its own length (a fraction of a loader of its
    own): the ranks compare theirs, and a length that differs between them is said per rank."""
    here = trainer.limit_train_batches
    if saved is None or (saved == here and type(saved) is type(here)):
        return
    n = trainer.fit_loop.max_batches
    ns = dist.all_gather_json(None if n == float("inf") else int(n))  # (a collective)
    epoch = trainer.current_epoch
    length = _lengths(ns)
    change = f"limit_train_batches={here!r} here, {saved!r} when the checkpoint was saved"
    past = [r for r, k in enumerate(ns) if k is not None and done and k <= done]
    if not epoch_end and past:
        at = f"an epoch {length}"
        if len(past) < len(ns):
            at = f"the epoch on {notices.ranks_named(past)} (an epoch {length})"
        raise ConfigError(
            f"{change}: the checkpoint is {done} batch(es) into epoch {epoch}, already at or "
            f"past the end of {at}, and Lightning would train that epoch again from its "
            f"batch 0. Resume with limit_train_batches={saved!r} (or more than "
            f"{done} batches) until epoch {epoch} ends, then change it; or resume from a "
            "checkpoint at an epoch's end (resume=<its step>)"
        )
    if epoch_end:
        what = f"epochs from {epoch + 1} on are epochs {length}"
    else:
        what = (
            f"the resumed epoch {epoch}, {done} batch(es) into it, ends as an epoch {length} "
            "(as with Lightning's own ckpt_path resume), and so do the later ones"
        )
    notices.say_once(  # (the same on every rank once compared: said once, naming the ranks)
        log,
        f"{change}: {what}; the run is not the one interrupted. Resume with the checkpoint's "
        "value to continue that run",
        UserWarning,
        stacklevel=caller_stacklevel(os.path.dirname(os.path.dirname(pl.__file__))),
    )


def _lengths(ns: list[int | None]) -> str:
    """``"of 5 batch(es)"`` where every rank's epoch is as long (``ns``: each rank's, None:
    unknown), else each length naming its ranks: ``"of 5 batch(es) on rank 0, 10 batch(es) on
    rank 1"``."""
    by: dict[int | None, list[int]] = {}
    for r, k in enumerate(ns):
        by.setdefault(k, []).append(r)

    def one(k: int | None) -> str:
        return "unknown length" if k is None else f"{k} batch(es)"

    if len(by) == 1:
        return f"of {one(ns[0])}"
    return "of " + ", ".join(f"{one(k)} on {notices.ranks_named(rs)}" for k, rs in by.items())


def saved_counts(checkpoint: dict[str, Any]) -> dict[str, int]:
    """How many optimizers and schedulers a restored Lightning checkpoint holds states of (the
    optimizers only where it has their states: under FSDP, tensor parallelism and DeepSpeed a
    sharded part loads them and the list is empty)."""
    return {
        k: len(checkpoint[k])
        for k in ("optimizer_states", "lr_schedulers")
        if isinstance(checkpoint.get(k), list) and (checkpoint[k] or k == "lr_schedulers")
    }


def optimizers_and_schedulers(trainer: pl.Trainer, saved: dict[str, int]) -> None:
    """Warn (at the user's ``fit()`` line) when the run has another number of optimizers or
    LR schedulers than the checkpoint has states of: Lightning pairs them in order and drops
    the rest silently, so one added starts from its initial state (a scheduler from its first
    step's learning rate) and one removed loses its state."""
    here = {
        "optimizer_states": len(trainer.optimizers),
        "lr_schedulers": len(trainer.lr_scheduler_configs),
    }
    what = {"optimizer_states": "optimizer(s)", "lr_schedulers": "LR scheduler(s)"}
    for key, n in saved.items():
        if here[key] != n:
            notices.say_once(  # (the same on every rank: said once, on rank 0)
                log,
                f"{here[key]} {what[key]} here, {n} when the checkpoint was saved: Lightning "
                f"restores the first {min(n, here[key])} in order; "
                + (
                    f"the {here[key] - n} added start(s) from the initial state (a scheduler "
                    "from its first learning rate)"
                    if here[key] > n
                    else f"the state of the {n - here[key]} removed is dropped"
                )
                + ". Resume with the checkpoint's optimizers and schedulers to continue that run",
                UserWarning,
                stacklevel=caller_stacklevel(os.path.dirname(os.path.dirname(pl.__file__))),
            )


def scheduler_settings_changed(trainer: pl.Trainer) -> None:
    """Warn (at the user's ``fit()`` line) before Lightning loads the restored LR schedulers'
    states into those ``configure_optimizers`` built, where that replaces settings the new code
    passed (``CosineAnnealingLR``'s ``T_max``, ...): Lightning's ``load_state_dict`` takes the
    checkpoint's without a word. Nothing is refused (:mod:`..scheduler_settings`)."""
    loaded = trainer._checkpoint_connector._loaded_checkpoint or {}
    saved = loaded.get("lr_schedulers")
    if not isinstance(saved, list):
        return
    pairs = zip(trainer.lr_scheduler_configs, saved, strict=False)  # (another count: above)
    found = [
        said
        for i, (config, state) in enumerate(pairs)
        for said in scheduler_settings.described(f"lr_schedulers[{i}]", config.scheduler, state)
    ]
    if found:
        how = (
            "set them on the scheduler in your LightningModule's on_train_start, which runs "
            "after Lightning's restore (`self.lr_schedulers().T_max = 100`; see docs/lightning.md)"
        )
        scheduler_settings.say(  # once: on rank 0, as Lightning's rank_zero_warn
            "ResilientCheckpoint: "
            + scheduler_settings.message(found, how, "Lightning's own ckpt_path resume does"),
            trainer.is_global_zero,
            (os.path.dirname(os.path.dirname(pl.__file__)),),
        )


def _converted_to(trainer: Any) -> torch.dtype | None:
    """The dtype the precision plugin converts the module's floating-point tensors to when the
    strategy is set up, after the restore ("bf16-true", "16-true", "64-true"); ``None`` for a
    plugin that leaves them as they are (fp32 and the mixed precisions)."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision

    plugin = getattr(trainer, "precision_plugin", None)
    if isinstance(plugin, HalfPrecision):
        return plugin._desired_input_dtype
    return torch.float64 if isinstance(plugin, DoublePrecision) else None


def migrate(checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    """Lightning's own upgrade of checkpoints written by older Lightning versions."""
    try:
        from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
    except ImportError:  # pragma: no cover
        return checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _pl_migrate_checkpoint(checkpoint, path)


def callbacks(trainer: Any) -> list[Any]:
    return list(getattr(trainer, "callbacks", None) or [])


def say_when_it_saves(ckpt: Checkpointer) -> None:
    """Without a schedule the callback saves the last step of ``fit()`` and on preemption:
    say so once, as the Checkpointer is opened (not the core's words about ``step()``)."""
    if ckpt.has_schedule:
        return
    when = "at the last step of fit() and on preemption"
    ckpt.saves_on_caller_schedule(when)
    rank_zero_info(
        f"ResilientCheckpoint: no every_n_steps, every_seconds, adaptive or loss_jump given: "
        f"it saves {when} only"
    )
