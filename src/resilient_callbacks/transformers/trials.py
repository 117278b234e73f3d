"""Hyperparameter search (``trainer.hyperparameter_search``): each trial in a directory of its own.

The search calls ``trainer.train(trial=...)`` once per trial, on one Trainer that builds a new
model each time (``model_init``), and the Trainer writes each trial's own checkpoints into
``output_dir/run-<id>`` (``hp_name(trial)`` if given: ``Trainer._get_output_dir``). One
directory for every trial made each trial resume the one before it (finished: nothing left to
train, its objective reported again), so the callback refused the search. Now each trial saves
into the subdirectory of ``dirpath`` of the same name (and of ``remote``): its retention counts
its own checkpoints only, and a re-run of the search resumes each trial from its own.

Trial numbers start again at 0 in a new study (a search re-run after a crash, without a
persistent storage), and a sampler not seeded draws other hyperparameters for them. So the
trial's name and hyperparameters are saved with each checkpoint: a trial whose directory's
newest checkpoint is of another trial's hyperparameters starts fresh (``resume="never"``, with a
warning; those checkpoints are kept and not counted); a checkpoint of another trial met at the
restore all the same (a remote copy, a fallback) is refused.

Which ranks call what: every rank, at ``train()``'s start; rank 0 reads the directory ahead and
broadcasts what it found (a collective).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from .. import dist
from ..errors import CheckpointMismatchError
from .auto_batch import newest_values

log = logging.getLogger("resilient_callbacks")


def trial(trainer: Any) -> dict[str, Any] | None:
    """``{"name", "params"}`` of the search trial this ``train()`` runs, None outside a search.
    ``name``: the Trainer's run directory of the trial, relative to ``output_dir`` (``run-3``);
    ``params``: its hyperparameters as JSON values (``state.trial_params``; ``hp_params`` of
    the trial on a rank the search did not pass it to, as optuna under DDP)."""
    current = getattr(trainer, "_trial", None)
    if current is None or getattr(trainer, "hp_search_backend", None) is None:
        return None
    out = trainer.args.output_dir
    name = os.path.relpath(trainer._get_output_dir(current), out)
    params = getattr(trainer.state, "trial_params", None)
    if params is None:
        from transformers.integrations import hp_params

        params = hp_params(current)
    return {"name": name, "params": json.loads(json.dumps(params, sort_keys=True, default=str))}


def place(
    dirpath: str, options: dict[str, Any], this: dict[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    """Where trial ``this`` saves: ``dirpath/<name>`` (and ``remote``'s)."""
    if this is None:
        return dirpath, options
    name = this["name"]
    dirpath, options = os.path.join(dirpath, name), dict(options)
    if options.get("remote"):
        options["remote"] = f"{str(options['remote']).rstrip('/')}/{name}"
    return dirpath, options


def fresh_if_another(
    dirpath: str, options: dict[str, Any], this: dict[str, Any] | None
) -> dict[str, Any]:
    """``options`` with ``resume="never"`` where the newest checkpoint in ``dirpath`` (read by
    rank 0, every rank told) is of another trial than ``this``, or of none."""
    resume = options.get("resume", "auto")
    if this is None or str(resume) != "auto":
        return options
    seen = newest_values(dirpath, resume) if dist.rank() == 0 else None
    seen = dist.broadcast_json(seen) if dist.world_size() > 1 else seen
    if seen is None:
        return options
    step, values = seen
    saved = values.get("trial") if isinstance(values, dict) else None
    if saved == this:
        return options
    log.warning(
        "ResilientCheckpoint: %s holds checkpoints of another trial (the newest, step %d: %s); "
        "this trial (%s) starts at step 0 and saves there under a new run id (those are "
        "kept, not counted). A search re-run draws other hyperparameters for its trial "
        "numbers unless its sampler is seeded.",
        dirpath,
        step,
        _said(saved),
        _said(this),
    )
    return {**options, "resume": "never"}


def check_restored(saved: Any, this: dict[str, Any] | None, step: int) -> None:
    """After a restore: refuse a checkpoint of another trial (or of no trial) for trial
    ``this``; outside a search, nothing to check."""
    if this is not None and saved != this:
        raise CheckpointMismatchError(
            f"the checkpoint of step {step} is of {_said(saved)}, this train() runs "
            f"{_said(this)} of a hyperparameter search: resuming it would report another "
            "trial's training as this one's. Remove that checkpoint (or the trial's directory) "
            "from dirpath, or resume the search with the trials it was written by."
        )


def _said(t: Any) -> str:
    if not isinstance(t, dict):
        return "no hyperparameter search trial"
    return f"trial {t.get('name')!r} with {json.dumps(t.get('params'), sort_keys=True)}"
