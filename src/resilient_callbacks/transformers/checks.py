"""What ``ResilientCheckpoint`` decides before training: which setups it refuses (and how early),
which save trigger it uses, and where its checkpoints go.

Refusals name the way forward. The training dataset is checked as soon as the callback sees the
Trainer: at ``Trainer(callbacks=[...])`` construction (``on_init_end``), and otherwise, for
``trainer.add_callback(cb)`` (a Trainer calls no event of a callback added after its
construction), at the start of ``train()``, before the data loader is iterated, before any
forward pass or optimizer step, and before any checkpoint is opened.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from typing import Any

import torch
import transformers
from accelerate.data_loader import DataLoaderDispatcher
from torch.utils.data import BatchSampler

from .. import notices
from ..errors import ConfigError, warn_and_log
from .peft_export import peft_info
from .under_fsdp import plain_class

log = logging.getLogger("resilient_callbacks")

TRIGGERS = ("every_n_steps", "every_seconds", "adaptive", "keep_every_n_steps")
# A directory name push_to_hub skips (Trainer.push_to_hub and its per-save pushes upload
# output_dir with ignore_patterns=["_*", "checkpoint-*"]).
DEFAULT_DIRNAME = "_resilient_checkpoints"
LEGACY_DIRNAME = "resilient_checkpoints"  # the default before 2026-12; uploaded by push_to_hub
HUB_IGNORED = ("_*", "checkpoint-*")


def value(option: Any) -> str:
    """The string of a TrainingArguments enum option (``SaveStrategy.STEPS`` -> ``"steps"``)."""
    return str(getattr(option, "value", option))


def check_train_dataset(dataset: Any) -> None:
    """Refuse a training dataset without batch indices (an ``IterableDataset``)."""
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        return
    raise ConfigError(
        f"ResilientCheckpoint needs a map-style train_dataset (with __len__ and __getitem__), "
        f"not a {type(dataset).__name__} (an IterableDataset): the position it saves and resumes "
        "inside an epoch is a batch index, which a stream does not have. Ways forward: use a "
        "map-style dataset (with Hugging Face datasets, load without streaming=True, or "
        "materialize the stream: datasets.Dataset.from_generator(...) or "
        "Dataset.from_list(list(stream.take(n)))); or train this dataset without "
        "ResilientCheckpoint, with the Trainer's own save_steps (its resume re-reads the "
        "skipped part of the stream). Nothing was trained or saved."
    )


def check_setup(trainer: Any, loader: Any) -> None:
    """Refuse setups the adapter cannot save or resume exactly (at ``on_train_begin``: nothing
    was iterated, computed or opened yet)."""
    if getattr(trainer, "is_fsdp_xla_enabled", False):
        raise ConfigError(
            "ResilientCheckpoint does not support the Trainer's FSDP on XLA (TPUs); the Trainer's "
            "FSDP through accelerate (FSDP2 or FSDP1, fsdp=True) is supported. Nothing was "
            "trained or saved."
        )
    from .callback import ResilientCheckpoint  # (it imports this module)

    cbs = trainer.callback_handler.callbacks
    mine = {id(c): c for c in cbs if isinstance(c, ResilientCheckpoint)}
    for c in mine.values():
        if (times := sum(x is c for x in cbs)) > 1:
            raise ConfigError(
                f"ResilientCheckpoint({c.dirpath!r}) was added {times} times to this Trainer "
                "(Trainer(callbacks=[...]) and trainer.add_callback(...), which only warns): "
                "every event would reach it that often, so it would count each step more than "
                "once and save other data positions than the run's. Add it once. Nothing was "
                "trained or saved."
            )
    if len(mine) > 1:
        raise ConfigError(
            f"the Trainer has {len(mine)} ResilientCheckpoint callbacks "
            f"({', '.join(sorted(str(c.dirpath) for c in mine.values()))}): each would restore "
            "and save the same training; keep one. Nothing was trained or saved."
        )
    check_train_dataset(getattr(trainer, "train_dataset", None))
    dataset = getattr(loader, "dataset", None)
    check_train_dataset(dataset)
    if loader is None or getattr(loader, "batch_sampler", None) is None:
        raise ConfigError(
            "ResilientCheckpoint needs a map-style train_dataset (with __len__ and "
            "__getitem__) and the Trainer's batched training data loader: its position inside "
            "an epoch is a batch index."
        )
    if isinstance(loader, DataLoaderDispatcher) or isinstance(loader.sampler, BatchSampler):
        raise ConfigError(
            "ResilientCheckpoint does not support this data loader layout "
            f"({type(loader).__name__} with sampler {type(loader.sampler).__name__}); use "
            "the Trainer's default training data loader (accelerator_config "
            "dispatch_batches=False)."
        )


def resolved_options(options: dict[str, Any], args: Any, state: Any) -> tuple[dict[str, Any], bool]:
    """The Checkpointer options, with the Trainer's save schedule when no trigger was given;
    and whether to save at every epoch end."""
    options = dict(options)
    _best_direction(options, args)
    if any(options.get(k) for k in TRIGGERS):
        return options, False
    strategy = value(args.save_strategy)
    if strategy == "steps" and state.save_steps and state.save_steps > 0:
        options["every_n_steps"] = int(state.save_steps)
        log.info(
            "ResilientCheckpoint: no save trigger given; saving every %d steps "
            "(the Trainer's save_steps)",
            options["every_n_steps"],
        )
        return options, False
    if strategy == "epoch":
        log.info("ResilientCheckpoint: no save trigger given; saving at every epoch end")
        return options, True
    notices.log_once(  # (the same on every rank: said once, on rank 0)
        log,
        "ResilientCheckpoint: no save trigger (every_n_steps, every_seconds, "
        "adaptive=True, ...) and save_strategy=%r; only the final step and "
        "emergency (preemption) saves are written",
        strategy,
    )
    return options, False


def _best_direction(options: dict[str, Any], args: Any) -> None:
    """``keep_best`` 0 and ``mode`` "min" where neither the callback nor a DeepSpeed section
    gave them; but for ``monitor`` the Trainer's ``metric_for_best_model``, ``mode`` follows its
    ``greater_is_better`` (an explicit ``mode`` against it is warned about)."""
    if options.get("keep_best") is None:
        options["keep_best"] = 0
    monitor, mode = options.get("monitor"), options.get("mode")
    metric, greater = getattr(args, "metric_for_best_model", None), args.greater_is_better
    trainer_mode = None
    name = metric if not metric or metric.startswith("eval_") else f"eval_{metric}"
    if monitor and monitor == name and greater is not None:
        trainer_mode = "max" if greater else "min"
    if mode is None:
        options["mode"] = trainer_mode or "min"
    elif trainer_mode is not None and mode != trainer_mode:
        notices.log_once(  # (the same on every rank: said once, on rank 0)
            log,
            "ResilientCheckpoint: monitor=%r with mode=%r, but the Trainer ranks that metric "
            "(metric_for_best_model=%r) with greater_is_better=%s: keep_best keeps the "
            "checkpoints the Trainer ranks worst. Leave mode out to follow the Trainer",
            monitor,
            mode,
            metric,
            greater,
        )


def save_on_evaluate(given: bool | None, options: dict[str, Any]) -> bool:
    """Whether to save after every evaluation that reports ``monitor``: as ``given``, or (None)
    when a ``monitor`` is set (the callback's or a DeepSpeed section's)."""
    return options.get("monitor") is not None if given is None else bool(given)


def warn_about_trainer_saves(args: Any, trainer_checkpoints: bool) -> None:
    """Say what becomes of the Trainer's own checkpoint-N saves. load_best_model_at_end is
    warned about only where they are switched off: save_strategy='best' keeps writing them
    (a callback cannot stop it), so the Trainer's best model is still loaded at the end."""
    strategy = value(args.save_strategy)
    if trainer_checkpoints or strategy == "no":
        return
    if strategy == "best":
        # Those checkpoint-N directories are what load_best_model_at_end loads: it works.
        notices.log_once(  # (the same on every rank: said once, on rank 0)
            log,
            "ResilientCheckpoint: save_strategy='best': the Trainer still writes its own "
            "checkpoint-N directories when the metric improves (that decision is made after "
            "every callback event); set save_strategy='no' and use keep_best/monitor instead",
        )
        return
    log.info(
        "ResilientCheckpoint replaces the Trainer's own checkpoints (save_strategy=%r): "
        "no checkpoint-N directories are written. Pass trainer_checkpoints=True to keep "
        "them.",
        strategy,
    )
    if args.load_best_model_at_end:
        msg = (
            "load_best_model_at_end=True loads one of the Trainer's own checkpoint-N "
            "directories, which ResilientCheckpoint switches off: no best model will be loaded "
            "at the end. Keep the best checkpoint with keep_best/monitor (and export it with "
            "resilient_callbacks.transformers.export_pretrained), or pass "
            "trainer_checkpoints=True."
        )
        warn_and_log(log, msg, UserWarning, stacklevel=5)


def warn_about_monitor(options: dict[str, Any], args: Any) -> None:
    """keep_best on an evaluation metric while the Trainer never evaluates during training:
    no checkpoint will carry the metric, so none is kept as the best."""
    monitor = options.get("monitor")
    if not options.get("keep_best") or not monitor or not str(monitor).startswith("eval_"):
        return
    if value(getattr(args, "eval_strategy", "no")) == "no":
        msg = (
            f"ResilientCheckpoint(keep_best={options['keep_best']}, monitor={monitor!r}): "
            "eval_strategy='no', so the Trainer does not evaluate during training and no "
            f"checkpoint will carry {monitor!r}: none is kept as the best. Set "
            "eval_strategy='steps' (with eval_steps) or 'epoch'."
        )
        warn_and_log(log, msg, UserWarning, stacklevel=5)


def checkpoint_dir(dirpath: str | None, args: Any) -> str:
    """Where the checkpoints go: ``dirpath``, else ``<output_dir>/_resilient_checkpoints`` (a
    name ``push_to_hub`` does not upload). A run that began under the old default name keeps
    using it (with a warning), so upgrading never starts a run afresh."""
    if dirpath is None:
        dirpath = os.path.join(args.output_dir, DEFAULT_DIRNAME)
        legacy = os.path.join(args.output_dir, LEGACY_DIRNAME)
        if not os.path.isdir(dirpath) and os.path.isdir(legacy) and os.listdir(legacy):
            notices.log_once(  # (the same on every rank: said once, on rank 0)
                log,
                "ResilientCheckpoint: using the checkpoints in %s (the default directory of "
                "earlier versions); push_to_hub uploads that directory. Move it to %s, or pass "
                "dirpath=, to keep checkpoints out of the Hub upload.",
                legacy,
                dirpath,
            )
            dirpath = legacy
    if getattr(args, "push_to_hub", False):
        rel = os.path.relpath(os.path.abspath(dirpath), os.path.abspath(args.output_dir))
        inside = not (rel == os.pardir or rel.startswith(os.pardir + os.sep))
        if inside and not any(fnmatch.fnmatchcase(rel, p) for p in HUB_IGNORED):
            msg = (
                f"ResilientCheckpoint writes its checkpoints to {dirpath}, inside output_dir, and "
                "push_to_hub=True uploads output_dir except names matching "
                f"{list(HUB_IGNORED)}: the checkpoints would be uploaded. Use a dirpath outside "
                f"output_dir or whose first component starts with '_' (the default, "
                f"<output_dir>/{DEFAULT_DIRNAME}, is skipped)."
            )
            warn_and_log(log, msg, UserWarning, stacklevel=5)
    return dirpath


def model_info(model: Any) -> dict[str, Any]:
    """What export needs to rebuild the model: its class and configuration (JSON text)."""
    model, cls = plain_class(model)  # the class under FSDP's wrapping
    config = getattr(model, "config", None)
    gen = getattr(model, "generation_config", None)
    return {
        "class": cls.__name__,
        "module": cls.__module__,
        "config": config.to_json_string(use_diff=False) if config is not None else None,
        "generation_config": gen.to_json_string(use_diff=False) if gen is not None else None,
        "transformers": transformers.__version__,
    } | peft_info(model)


def nothing_left(state: Any, *, stopped: bool) -> str:
    """What the resume message adds when the restored run has nothing left to train."""
    if state.global_step > state.max_steps:  # a lowered max_steps cannot go back
        return (
            f"; it is past max_steps={state.max_steps} here: nothing to train, the model "
            f"stays at step {state.global_step} (resume=<step> picks an older checkpoint)"
        )
    if state.global_step == state.max_steps:
        return (
            f"; it reached step {state.global_step}, max_steps={state.max_steps} here: "
            "nothing to train, its final metrics are restored"
        )
    if stopped:
        return (
            "; the run had stopped there (should_training_stop: early stopping): "
            "nothing to train, its final metrics are restored"
        )
    return ""
