"""What the Transformers adapter records of a Trainer besides the model, optimizer and scheduler,
and how it checks and gives it back: :class:`SavedState` (the tree handed to the Checkpointer
and the plain values it points at: the ``TrainerState`` progress fields, the loop's counters,
the callbacks' exportable states, the data settings, per-rank RNG states), the checkpoint's
format check, and the ``resilient/*`` values it adds to the Trainer's log. Every rank calls
them alike."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist, notices, sinks
from ..checkpointer import Checkpointer
from ..errors import CheckpointMismatchError
from ..optim import hookable
from ..state_marks import OptionalKeys, PerRank
from . import collator_rng, data_settings, under_deepspeed, under_fsdp

log = logging.getLogger("resilient_callbacks")

TRAINER_STATE_NAME = "trainer_state.json"  # (transformers.trainer's name for it)
FORMAT = "resilient_callbacks.transformers/2"
METRIC_PREFIX = "resilient/"
# TrainerState fields that describe progress (restored); the others follow the current arguments.
STATE_FIELDS = (
    "epoch",
    "global_step",
    "num_input_tokens_seen",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)
_RNG_BYTES = torch.get_rng_state().numel()


class SavedState:
    """The state one callback saves of its Trainer: :attr:`tree` is what the Checkpointer saves
    and restores (model, optimizer, scheduler, scaler or DeepSpeed engine, the plain
    :attr:`values` and the per-rank :attr:`rank_values`). Built at each ``train()``'s start,
    refreshed before every step is handed to the Checkpointer, given back after a restore.
    ``exclude``: the callback itself (its own state is not one of the callbacks' states)."""

    def __init__(self, exclude: Any) -> None:
        self.exclude = exclude
        # "order": checkpoints written before 2026-12-07 lack it (kept live, {}: not checked);
        # "trial" (the hyperparameter search trial, trials.py) too: kept live, None
        self.values: dict[str, Any] = OptionalKeys(optional=("order", "trial"))
        self.rank_values: dict[str, Any] = {}
        self.tree: dict[str, Any] = {}
        self.epoch_rng = torch.zeros(_RNG_BYTES, dtype=torch.uint8)  # when the order was drawn
        self.epoch_start = torch.zeros(_RNG_BYTES, dtype=torch.uint8)  # when the epoch began
        self.epoch_start_live: torch.Tensor | None = None  # this epoch's, set by the loop
        self.model_info: dict[str, Any] = {}
        self.best_gone = False  # the restore found the best checkpoint gone (load_notices)
        self.signature: dict[str, int] = {}  # the data settings a position in an epoch needs
        self.batches: Any = None  # the training data's resumable batch sampler (build())
        self.order: dict[str, Any] = {}  # what draws an epoch's order (data_settings.order)
        self.trial: dict[str, Any] | None = None  # the search trial of this train() (trials.py)

    def build(self, trainer: Any, batches: Any) -> dict[str, Any]:
        """Every rank, at ``train()``'s start (the objects exist): the tree, pointing at the
        Trainer's live objects. ``batches``: the resumable batch sampler of its training data
        (:mod:`.data`), or None."""
        self.batches = batches
        self.order = data_settings.order(batches) if batches is not None else {}
        opt = hookable(trainer.optimizer)  # the torch optimizer itself (its step hooks fire)
        self.rank_values = OptionalKeys(
            {
                "tr_loss": trainer._tr_loss,
                "current_flos": float(trainer.current_flos),
                "epoch_rng": self.epoch_rng,
                "epoch_start_rng": self.epoch_start,
                # the CPU random states the next batch, fetched ahead of the save, was
                # collated from (data.encode_cpu_rng), or None; checkpoints written before
                # 2026-12-06 lack it
                "next_batch_rng": None,
                # the data collator's own generator now (collator_rng.py), or None
                "collator_rng": None,
            },
            optional=("next_batch_rng", "collator_rng"),
        )
        tree: dict[str, Any] = {
            "model": trainer.model,
            "optimizer": opt,
            "scheduler": trainer.lr_scheduler,
            "trainer": self.values,
            # a process the checkpoint has none of (more processes now) takes rank 0's
            "rank": PerRank(self.rank_values, new_ranks="rank0")
            if dist.world_size() > 1
            else self.rank_values,
        }
        if getattr(trainer, "is_deepspeed_enabled", False):
            tree = under_deepspeed.engine_tree(trainer, tree)
        elif getattr(trainer, "is_fsdp_enabled", False):
            tree = under_fsdp.sharded_tree(trainer, tree)
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            tree["scaler"] = scaler
        self.values.clear()
        self.refresh(trainer, (0, 0), batches.epoch_rng if batches is not None else None)
        # empty until a restore fills it with the checkpoint's order (restored into this run's,
        # a key the checkpoint lacks, "seed" of an unseeded sampler, was warned about as
        # removed); refresh() sets it before every save
        self.values["order"] = {}
        self.values["trial"] = None  # (likewise: the checkpoint's trial, None if it has none)
        self.tree = tree
        return tree

    def refresh(
        self,
        trainer: Any,
        position: tuple[int, int],
        epoch_rng: torch.Tensor | None,
        next_batch_rng: dict[str, Any] | None = None,
    ) -> None:
        """Point the plain part of the saved state at the Trainer's current values (cheap: the
        log history is referenced, not copied; it is encoded only when a save happens).
        ``position``: (epoch, optimizer steps into it); ``epoch_rng``: the RNG state the
        epoch's order was drawn from, if known; ``next_batch_rng``: the random states the
        batch at ``position``, already fetched, was collated from, if it was."""
        st = trainer.state
        self.values.update(
            {
                "format": FORMAT,
                "state": {k: getattr(st, k) for k in STATE_FIELDS},
                "callbacks": callback_states(trainer, exclude=self.exclude),
                "loop": {
                    "globalstep_last_logged": int(trainer._globalstep_last_logged),
                    "total_loss": float(trainer._total_loss_scalar),
                    "epoch": int(position[0]),
                    "updates": int(position[1]),
                    # stopped after this step before the planned end (EarlyStoppingCallback,
                    # should_training_stop set by other code): a re-run trains nothing
                    "stopped": bool(trainer.control.should_training_stop)
                    and st.global_step < st.max_steps,
                },
                "data": dict(self.signature),
                "order": dict(self.order),
                "trial": self.trial,
                # a sampler's own generator, at the epoch's start and now (data.py)
                "sampler_generator": (
                    self.batches.generator_states() if self.batches is not None else None
                ),
                "model": self.model_info,
            }
        )
        self.rank_values["tr_loss"] = trainer._tr_loss
        self.rank_values["current_flos"] = float(trainer.current_flos)
        self.rank_values["next_batch_rng"] = next_batch_rng
        collator = getattr(self.batches, "collator", None)
        if collator is not None:
            self.rank_values["collator_rng"] = collator_rng.encode(collator_rng.get(collator))
        if epoch_rng is not None:
            self.epoch_rng.copy_(epoch_rng)
        if self.epoch_start_live is not None:
            self.epoch_start.copy_(self.epoch_start_live)

    def load_notices(self, args: Any) -> list[str]:
        """Every rank, as the Checkpointer's ``load_notices`` once the restore loaded
        :attr:`tree`, before the ranks compare their outcomes: whether the Trainer's best
        checkpoint it names is gone from this machine (:attr:`best_gone`, forgotten by
        :meth:`apply`); the warning that says so, said after the ranks agree. Under ``-W
        error`` it stops every rank: said later, in :meth:`apply`, it raised on this rank alone
        (a node whose disk lacks it) while the others went on into their next collective."""
        values = self.values.get("state")
        self.best_gone = False
        if self.values.get("format") != FORMAT or not isinstance(values, dict):
            return []  # (refused by apply)
        st = SimpleNamespace(**values)
        said = forget_a_best_checkpoint_that_is_gone(st, args)
        self.best_gone = st.best_model_checkpoint != values.get("best_model_checkpoint")
        return [said] if said else []

    def apply(
        self, trainer: Any, state: Any, step: int
    ) -> tuple[int, int, torch.Tensor, torch.Tensor, bool]:
        """Every rank, after the Checkpointer restored ``step`` into :attr:`tree`: refuse a
        checkpoint of another adapter or data settings it cannot resume with
        (:mod:`.data_settings`), then give the ``TrainerState`` fields, the callbacks' states
        and the loop's counters back. Returns where to resume:
        (epoch, optimizer steps into it, the RNG state of its order, of its start, whether the
        run had stopped there before its planned end)."""
        v = self.values
        if v.get("format") != FORMAT:
            raise CheckpointMismatchError(
                f"the checkpoint of step {step} was not written by the Transformers adapter "
                f"(format {v.get('format')!r}, expected {FORMAT!r}); use another dirpath"
            )
        by_steps = trainer.args.max_steps > 0
        data_settings.check(v["data"], self.signature, v["loop"], step, state, by_steps)
        if self.batches is not None:
            data_settings.check_order(v.get("order"), self.order, v["loop"], step)
        for name, value in v["state"].items():
            setattr(state, name, value)
        if self.best_gone:  # (found by the restore: :meth:`load_notices`)
            state.best_model_checkpoint = None
        restore_callback_states(trainer, v["callbacks"], exclude=self.exclude)
        loop = v["loop"]
        if self.batches is not None:
            self.batches.resume_generator(v.get("sampler_generator"))
            saved_collator = self.rank_values.get("collator_rng")
            if self.batches.collator is not None and isinstance(saved_collator, dict):
                collator_rng.put(self.batches.collator, collator_rng.decode(saved_collator))
        trainer._globalstep_last_logged = int(loop["globalstep_last_logged"])
        # The running loss total (what train_loss averages) and, per rank, the loss not yet
        # logged: the final train_loss is the uninterrupted run's, also for a finished run.
        trainer._total_loss_scalar = float(loop["total_loss"])
        trainer._initial_num_input_tokens_seen = state.num_input_tokens_seen
        trainer.current_flos = float(self.rank_values["current_flos"])
        under_deepspeed.continue_flos(trainer)  # (a ZeRO-3 engine's first count)
        return (
            int(loop["epoch"]),
            int(loop["updates"]),
            self.epoch_rng.clone(),
            self.epoch_start.clone(),
            bool(loop.get("stopped", False)),
        )


def forget_a_best_checkpoint_that_is_gone(state: Any, args: Any) -> str | None:
    """The Trainer's best ``checkpoint-N`` (``trainer_checkpoints=True``), as restored, is not
    on this machine (a resume from the remote copy on a new node, an ``output_dir`` cleaned,
    ``save_total_limit``): forget it, as the Trainer's own resume does (the same cwd-relative
    check), so that ``load_best_model_at_end`` does not try to load it at the end (a later,
    better evaluation sets a new one). Said at INFO where nothing is lost: the stopped run's
    rotation removed it after a better evaluation this run repeats, or the end loads no best;
    else a warning, returned (this rank's: said by the restore, :meth:`SavedState.load_notices`):
    ``load_best_model_at_end`` would not load that best."""
    best = state.best_model_checkpoint
    if best is None or os.path.isdir(best):
        return None
    state.best_model_checkpoint = None
    what = (
        f"ResilientCheckpoint: the Trainer's best checkpoint {best} (step "
        f"{state.best_global_step}, {state.best_metric}) recorded in the checkpoint restored "
        "does not exist on this machine"
    )
    later = _best_moved_after(args.output_dir, state.global_step, state.log_history or [])
    if args.save_total_limit and later is not None:
        log.info(
            "%s: save_total_limit removed it after the better evaluation of step %d, which this "
            "run repeats from step %d; forgotten until then, as the Trainer's own resume does",
            what,
            later,
            state.global_step,
        )
        return None
    if not args.load_best_model_at_end:
        log.info("%s: forgotten, as the Trainer's own resume does", what)
        return None
    msg = (
        f"{what} (another machine's output_dir, a directory cleaned): forgotten, as the "
        "Trainer's own resume does; load_best_model_at_end=True loads a best found from here "
        "on, if any, not that one. To keep the best with the run's checkpoints (and their "
        "remote copy), pass ResilientCheckpoint(keep_best=1, monitor=...) and export it with "
        "resilient_callbacks.transformers.export_pretrained."
    )
    return notices.on_this_rank(msg)


def _best_moved_after(output_dir: str, step: int, history: list[Any]) -> int | None:
    """The step of the best that a ``checkpoint-N`` newer than ``step`` in ``output_dir`` (the
    Trainer's run directory, as it resolves it) records, if later than ``step``: the stopped
    run found a better evaluation after the step restored. Only a ``checkpoint-N`` of the run
    restored counts: its ``log_history`` begins with ``history``, the one restored (another
    run's left in the same ``output_dir`` says nothing of this one's best). None: no such
    record."""
    newer = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        digits = name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if digits != name and digits.isdigit() and int(digits) > step:
            newer.append(int(digits))
    for n in sorted(newer, reverse=True):
        path = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{n}", TRAINER_STATE_NAME)
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
            best, logged = doc.get("best_global_step"), doc.get("log_history")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(logged, list) or not _same_logs(logged[: len(history)], history):
            continue  # another run's (or a branch this run abandoned)
        return best if isinstance(best, int) and best > step else None
    return None


def _same_logs(a: list[Any], b: list[Any]) -> bool:
    """Whether two log histories hold the same entries, compared as JSON (a NaN loss, which
    is no float equal to itself, is the same entry in both)."""
    try:
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    except (TypeError, ValueError):
        return False


def callback_states(trainer: Any, exclude: Any) -> dict[str, list[Any]]:
    """The exportable states of the Trainer's callbacks (as the Trainer's own checkpoints keep
    them), by class name. A checkpoint may lack any of them (:class:`~..state_marks.OptionalKeys`):
    a callback added for the resumed run (an ``EarlyStoppingCallback``) starts from its own
    state, as under the Trainer's own resume, without a "removed" warning."""
    out: dict[str, list[Any]] = {}
    for cb in trainer.callback_handler.callbacks:
        if cb is not exclude and isinstance(cb, ExportableState):
            out.setdefault(type(cb).__name__, []).append(cb.state())
    return OptionalKeys(out, optional=tuple(out))


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


def save_logs(ckpt: Checkpointer, *, committed_only: bool = False) -> dict[str, float]:
    """The ``resilient/*`` values logged after a save: what the loop waited (not with
    ``committed_only``), and the newest committed checkpoint's step, seconds and size."""
    logs: dict[str, float] = {}
    last = ckpt.last_save
    if not committed_only:
        if ckpt.config.async_save and ckpt.blocking_seconds:
            logs[METRIC_PREFIX + "save_blocking_s"] = round(ckpt.blocking_seconds[-1], 6)
        elif last is not None:
            logs[METRIC_PREFIX + "save_blocking_s"] = round(last.seconds, 6)
    if last is not None:
        logs[METRIC_PREFIX + "last_committed_step"] = last.step
        logs[METRIC_PREFIX + "last_committed_s"] = round(last.seconds, 6)
        logs[METRIC_PREFIX + "last_committed_mb"] = round(last.bytes / 1e6, 3)
    return logs


def log_final(trainer: Any, ckpt: Checkpointer, save_metrics: bool, logged: int | None) -> None:
    """At the end of ``train()``: wait for the last saves to commit in the background, then log
    the newest committed checkpoint (unless step ``logged``'s was logged already) and, with
    ``telemetry="logger"``, the metrics."""
    ckpt.flush()
    last = ckpt.last_save
    if save_metrics and last is not None and last.step != logged:
        trainer.log(save_logs(ckpt, committed_only=True))
    sinks.to_framework(ckpt, trainer.log, final=True)
