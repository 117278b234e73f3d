"""Several trainings of one model in one process.

A second ``trainer.train()`` of a model -- by the same Trainer, or by a new one (a fine-tuning
stage after pre-training) -- starts a new training at step 0 from the weights in memory, with a
fresh optimizer and schedule. Resumed from the directory, it would instead load the first
training's last checkpoint over that: nothing left to train, or the first training's optimizer
and schedule. So the trainings of a model that finished in this process are counted per
directory, and each later training of that model saves into a subdirectory of its own,
``train-2``, ``train-3``, ... (its remote copy likewise under ``<remote>/train-N``).

The same script, run again after a crash, makes the same calls in the same order: the first
training, finished, restores its last checkpoint and trains nothing (as for any finished run);
the second resumes from ``train-2``. A ``train()`` that raised is not counted: calling it
again goes on from its newest checkpoint. A new model (a notebook cell or a script run again
in the same process) resumes from the directory as usual. A Trainer with ``model_init`` builds
a new model at every ``train()`` (a sweep over settings by hand, as ``hyperparameter_search``
does): its trainings are counted by the Trainer, so its second ``train()`` is another training
too, not a resume of the first, finished one.

Every rank counts alike (each runs the same calls on its own copy of the model).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

from .. import notices

log = logging.getLogger("resilient_callbacks")

# realpath of a dirpath -> (trainings of the model that finished there, the model)
_FINISHED: dict[str, tuple[int, weakref.ref[Any]]] = {}


def _trained(trainer: Any) -> Any:
    """What a training is counted by: the Trainer's model, or the Trainer itself where it
    builds a new model at every ``train()`` (``model_init``)."""
    return trainer if getattr(trainer, "model_init", None) is not None else trainer.model


def _done(dirpath: str, trainer: Any) -> int:
    count, ref = _FINISHED.get(os.path.realpath(dirpath), (0, None))
    return count if ref is not None and ref() is _trained(trainer) else 0


def place(dirpath: str, trainer: Any, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Where this training of ``trainer``'s model saves: ``dirpath`` for its first, else the
    ``train-N`` subdirectory (and ``remote``'s)."""
    done = _done(dirpath, trainer)
    if done == 0:
        return dirpath, options
    name = f"train-{done + 1}"
    notices.log_once(  # (the same on every rank: said once, on rank 0)
        log,
        "ResilientCheckpoint: %d training(s) of this model finished in %s in this process; "
        "this train() is another training, with its checkpoints in %s/ (it resumes from there "
        "if they exist, else starts at step 0 with a fresh optimizer, as without the callback)",
        done,
        dirpath,
        name,
    )
    options = dict(options)
    if options.get("remote"):
        options["remote"] = f"{str(options['remote']).rstrip('/')}/{name}"
    return os.path.join(dirpath, name), options


def finished(dirpath: str, trainer: Any) -> None:
    """A training of ``trainer``'s model placed by :func:`place` from ``dirpath`` ended without
    error."""
    done = _done(dirpath, trainer) + 1
    # (the entries of models gone: one a training of a sweep otherwise stayed)
    for gone in [k for k, (_, ref) in _FINISHED.items() if ref() is None]:
        del _FINISHED[gone]
    _FINISHED[os.path.realpath(dirpath)] = (done, weakref.ref(_trained(trainer)))
