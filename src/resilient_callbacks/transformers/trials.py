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
from ..errors import CheckpointMismatchError, ConfigError
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
    name = _name(trainer, current)
    params = getattr(trainer.state, "trial_params", None)
    if params is None:
        from transformers.integrations import hp_params

        params = hp_params(current)
    return {"name": name, "params": json.loads(json.dumps(params, sort_keys=True, default=str))}


def _name(trainer: Any, current: Any) -> str:
    """The trial's run directory relative to ``output_dir``, a folder inside it: refused where
    ``hp_name`` puts it elsewhere (an absolute path outside, ``..``: the trial would save
    outside ``dirpath``, ``..`` in its remote keys) or in ``output_dir`` itself (``""``: every
    trial in one directory). An absolute path inside ``output_dir`` is taken as relative."""
    out = trainer.args.output_dir
    run_dir = trainer._get_output_dir(current)
    name = os.path.relpath(run_dir, out)
    parts = name.split(os.sep)
    if name != os.curdir and not os.path.isabs(name) and os.pardir not in parts:
        return name
    hp_name = getattr(trainer, "hp_name", None)
    said = (
        f"hp_name returned {hp_name(current)!r}" if hp_name else f"its run directory is {run_dir!r}"
    )
    raise ConfigError(
        f"ResilientCheckpoint: hyperparameter search trial {getattr(current, 'number', current)!r}: "
        f"{said}, which is not a folder inside output_dir ({out!r}). Each trial saves into a "
        "folder of that name under the checkpoint directory (and under remote=), which must "
        "stay inside it: give hp_name a relative name without '..' parts, one per trial (such "
        "as f'run-{trial.number}' or f'lr-{lr}/run-{trial.number}'), or leave hp_name out "
        "(run-<trial id>)."
    )


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
    rank 0, every rank told) is of another trial than ``this``, or of none; where ``dirpath``
    holds none, the newest in ``remote`` (:func:`_remote_values`)."""
    resume = options.get("resume", "auto")
    if this is None or str(resume) != "auto":
        return options
    found: Any = None
    if dist.rank() == 0:
        found = [dirpath, newest_values(dirpath, resume)]
        if found[1] is None and options.get("remote"):  # (a new node: what the restore loads)
            found = [str(options["remote"]), _remote_values(options)]
    if dist.world_size() > 1:
        found = dist.broadcast_json(found)
    where, seen = found
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
        where,
        step,
        _said(saved),
        _said(this),
    )
    return {**options, "resume": "never"}


def _remote_values(options: dict[str, Any]) -> tuple[int, Any] | None:
    """(step, the Trainer values) of the newest checkpoint committed in the trial's ``remote``
    store: what a restore of a ``dirpath`` that holds none loads first (a search run again on
    a new node). Without it the restore loaded another trial's checkpoint there and
    :func:`check_restored` refused it: the search stopped where the same search with the local
    disk went on. None where none, or it cannot be read (the restore reads it again)."""
    try:
        from ..config_remote import as_url
        from ..layout import SHARED_STRUCTURE
        from ..remote import RemoteStore

        store = RemoteStore(as_url(str(options["remote"])), options.get("remote_options") or {})
        committed = [e for e in store.scan() if e.manifest is not None and e.problem is None]
        if not committed:
            return None
        newest = max(committed, key=lambda e: e.manifest.seq if e.manifest else 0)
        assert newest.manifest is not None
        raw = store.read_file(newest.name, SHARED_STRUCTURE)
        return newest.manifest.step, json.loads(raw)["structure"]["trainer"]
    except Exception as e:  # (the restore reads it again, and says what is wrong)
        log.debug("could not read ahead in the remote store: %s", e)
        return None


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
