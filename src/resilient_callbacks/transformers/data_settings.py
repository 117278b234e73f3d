"""What a re-run may change of the training data settings a checkpoint of the Transformers
adapter recorded (``SavedState.signature``: processes, per-device batch, accumulation, batches
an epoch, samples), and what it is told. Every rank calls :func:`check` alike, after the restore.

- Another number of processes, per-device batch or accumulation with the same global batch
  (processes x per-device batch x accumulation): resumed, with a warning. The saved position
  (optimizer steps into the epoch) names the same samples of the epoch's order.
- Another global batch: refused, at an epoch's end too, as the plain loop's
  ``ResumableDataLoader`` and the Lightning adapter refuse another batch size: a run keeps the
  global batch its learning rate and schedule were set for.
- Another dataset length (data added or removed between runs): at an epoch's end (or start)
  the next epoch goes over the new data, with a warning saying what the rest of the run trains,
  as the plain loop and the Lightning adapter take it. Inside an epoch the saved position means
  nothing in the new data: refused, naming the checkpoints at an epoch's end to resume from.
- Another way of drawing an epoch's order (the sampler's class: ``use_seedable_sampler``
  changed; or the seed of accelerate's ``SeedableRandomSampler``: ``seed``/``data_seed``
  changed), :func:`check_order`: inside an epoch the rest of it would be drawn in another order
  (samples repeated, others skipped): refused; at an epoch's end the next epochs are drawn the
  new way, with a warning.
- Another number of batches an epoch alone (``dataloader_drop_last`` changed): resumed, with a
  warning; the position names the same samples of the order, only the short last batch of an
  epoch is kept or dropped from here on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .. import dist
from ..errors import CheckpointMismatchError, warn_and_log

log = logging.getLogger("resilient_callbacks")

#: the settings that may change together when the global batch they make stays the same
LAYOUT = ("world_size", "per_device_batch_size", "gradient_accumulation_steps")


def global_batch(data: Mapping[str, Any]) -> int:
    """Samples per optimizer step: processes x per-device batch x accumulation."""
    n = 1
    for k in LAYOUT:
        n *= int(data.get(k) or 0)
    return n


def updates_per_epoch(data: Mapping[str, Any]) -> int:
    """Optimizer steps an epoch, as the Trainer counts them (the last may take fewer batches)."""
    gas = max(int(data.get("gradient_accumulation_steps") or 1), 1)
    return max(-(-int(data.get("steps_in_epoch") or 0) // gas), 1)


def check(
    saved: Mapping[str, Any],
    now: Mapping[str, Any],
    loop: Mapping[str, Any],
    step: int,
    state: Any,
    by_steps: bool,
) -> None:
    """Refuse, or warn about, the data settings ``now`` of this run against those ``saved``
    with the checkpoint of ``step`` (``loop``: its position, ``state``: this run's
    ``TrainerState``, with the Trainer's ``max_steps`` and ``num_train_epochs`` for this data;
    ``by_steps``: the run is driven by ``max_steps``, not ``num_train_epochs``)."""
    changed = {k for k in now if saved.get(k) != now[k]}
    if not changed:
        return
    updates = int(loop["updates"])
    new_data = "num_samples" in changed
    unknown = changed - {*LAYOUT, "steps_in_epoch", "num_samples"}
    if unknown or global_batch(saved) != global_batch(now) or (new_data and updates):
        raise _refusal(saved, now, changed, updates, step)
    if changed & set(LAYOUT):
        _say_resharded(saved, now, step)
    if new_data:
        _say_new_data(saved, now, int(loop["epoch"]), step, state, by_steps)
    elif not changed & set(LAYOUT):  # only the number of batches an epoch
        _say(
            f"ResilientCheckpoint: an epoch has {now['steps_in_epoch']} batches here but "
            f"{saved['steps_in_epoch']} in the checkpoint of step {step}, with the same "
            "dataset and batch (dataloader_drop_last changed?): the epoch's order goes on from "
            f"the saved step; from here an epoch has {updates_per_epoch(now)} optimizer steps "
            f"({updates_per_epoch(saved)} before), its short last batch kept or dropped."
        )


def order(batch_sampler: Any) -> dict[str, Any]:
    """What decides an epoch's order of samples on this rank: the sampler's class and, for one
    drawing from a seed and the epoch alone (accelerate's ``SeedableRandomSampler``: the
    Trainer's ``data_seed`` or ``seed``), that seed."""
    inner = getattr(batch_sampler, "batch_sampler", batch_sampler)  # (accelerate's shard)
    sampler = getattr(inner, "sampler", None)
    out: dict[str, Any] = {"sampler": type(sampler if sampler is not None else inner).__name__}
    seed = getattr(sampler, "initial_seed", None)
    if isinstance(seed, int):
        out["seed"] = seed
    return out


def check_order(saved: Any, now: Mapping[str, Any], loop: Mapping[str, Any], step: int) -> None:
    """Refuse, or warn about, another way of drawing the epochs' order than the checkpoint's
    (``saved``: :func:`order` at the save; None or empty in checkpoints written before
    2026-12-07, which do not record it: not checked).
    Found 2026-12-07: resumed inside an epoch with ``use_seedable_sampler=False`` (or another
    ``seed``), the rest of the epoch was drawn in another order, silently, as the Trainer's own
    resume does."""
    if not isinstance(saved, Mapping) or not saved or dict(saved) == dict(now):
        return
    keys = sorted({*saved, *now})
    diff = "; ".join(f"{k}: {saved.get(k)} in the checkpoint, {now.get(k)} here" for k in keys
                     if saved.get(k) != now.get(k))  # fmt: skip
    epoch, updates = int(loop["epoch"]), int(loop["updates"])
    what = (
        "the training data's order is drawn otherwise here than in the checkpoint of step "
        f"{step} ({diff}: accelerator_config.use_seedable_sampler, seed or data_seed changed?)"
    )
    if updates:
        raise CheckpointMismatchError(
            f"{what}, and step {step} is {updates} optimizer step(s) into epoch {epoch}: the "
            "rest of that epoch would be drawn in another order, training some of its samples "
            "twice and others not at all. Resume with the checkpoint's settings until the "
            "epoch ends, then change them; or resume from a checkpoint at an epoch's end "
            "(ResilientCheckpoint(..., resume=<its step>))."
        )
    _say(
        f"ResilientCheckpoint: {what}, saved at an epoch's end ({epoch} epoch(s) done): the "
        "next epoch and the later ones are drawn in the new order."
    )


def _refusal(
    saved: Mapping[str, Any], now: Mapping[str, Any], changed: set[str], updates: int, step: int
) -> CheckpointMismatchError:
    diff = [f"{k}: {saved.get(k)} in the checkpoint, {now[k]} here" for k in now if k in changed]
    was, here = global_batch(saved), global_batch(now)
    why = []
    if changed & set(LAYOUT) and was != here:
        why.append(
            f"Another number of processes, per_device_train_batch_size or "
            f"gradient_accumulation_steps resumes when the global batch (processes x per-device "
            f"batch x accumulation) stays {was}, as in the checkpoint ({here} here): e.g. half "
            "the processes with twice the gradient_accumulation_steps"
            + (
                ""
                if updates
                else "; at an epoch's end too, since the learning rate and its schedule were "
                "set for that global batch (to train on with another one, start a new run "
                "from this checkpoint's weights: resilient-ckpt export)"
            )
            + "."
        )
    if "num_samples" in changed and updates:
        began, end = step - updates, step - updates + updates_per_epoch(saved)
        why.append(
            f"The training dataset has another length, and step {step} is inside an epoch "
            f"({updates} optimizer steps into it): the saved position means nothing in the new "
            "data. To go on with the new data, resume from a checkpoint at an epoch's end, where "
            "the next epoch goes over the new data: "
            + (
                f"step {began} (ResilientCheckpoint(..., resume={began}), if the directory "
                "still holds it), or "
                if began > 0
                else ""
            )
            + f"train this epoch to its end (step {end}) with the checkpoint's data, saved "
            "there (save_strategy='epoch' saves at every epoch's end), then change the data."
        )
    return CheckpointMismatchError(
        f"the checkpoint of step {step} was written with other data settings, "
        + ("so its position in the epoch means something else here: " if updates else "")
        + ("" if updates else "at an epoch's end: ")
        + "; ".join(diff)
        + ". "
        + " ".join(why)
        + (" " if why else "")
        + "Resume with the checkpoint's settings, or start a new run (another dirpath, or "
        "resume='never')."
    )


def _say_new_data(
    saved: Mapping[str, Any],
    now: Mapping[str, Any],
    epoch: int,
    step: int,
    state: Any,
    by_steps: bool,
) -> None:
    """What the rest of the run trains after a resume at an epoch's end over other data."""
    per_epoch, max_steps = updates_per_epoch(now), int(state.max_steps)
    epochs = int(state.num_train_epochs)
    # a max_steps run goes to max_steps; a num_train_epochs run to whichever comes first
    epochs_end = max_steps if by_steps else step + max(epochs - epoch, 0) * per_epoch
    end = min(epochs_end, max_steps)
    if step >= max_steps:
        plan = f"nothing is left to train: max_steps={max_steps} here (raise it to train on)"
    elif end <= step:
        plan = "nothing is left to train: num_train_epochs is done (raise it to train on)"
    elif by_steps:
        plan = f"the run trains to step {end} (max_steps)"
    elif end == max_steps:
        plan = f"the run trains to step {end}, the end of epoch {epochs} (num_train_epochs) and "
        plan += "max_steps" if epochs_end == max_steps else "max_steps, inside an epoch"
    else:
        plan = (
            f"the run trains to step {end}, the end of epoch {epochs} (num_train_epochs), "
            f"before the Trainer's max_steps={max_steps}, num_train_epochs x {per_epoch}, where "
            "its learning-rate schedule ends (as for a fresh run on this data)"
        )
    _say(
        f"ResilientCheckpoint: the training dataset has {now['num_samples']} samples here but "
        f"{saved['num_samples']} in the checkpoint of step {step}, saved at an epoch's end "
        f"({epoch} epoch(s) done): the next epoch and the later ones go over the new data, "
        f"{per_epoch} optimizer steps an epoch ({updates_per_epoch(saved)} before); {plan}."
    )


def _say_resharded(saved: Mapping[str, Any], now: Mapping[str, Any], step: int) -> None:
    def layout(d: Mapping[str, Any]) -> str:
        return (
            f"{d['world_size']} process(es) x {d['per_device_batch_size']} x "
            f"{d['gradient_accumulation_steps']} accumulated"
        )

    _say(
        f"ResilientCheckpoint: resuming step {step}, written by {layout(saved)}, on "
        f"{layout(now)}: the same global batch of {global_batch(now)}. The model, optimizer, "
        "scheduler and the epoch's data order go on from the saved step; the run is not "
        "bit-identical to one that kept its layout (another summation order, and the random "
        "streams and the not-yet-logged loss of processes that are new or gone)."
    )


def _say(msg: str) -> None:
    warn_and_log(log, msg, UserWarning, warn=dist.rank() == 0)
