"""Several ``fit()`` calls in one process.

Lightning's second ``fit()`` of a Trainer goes on from the live state (the weights in memory,
``global_step``; ``configure_optimizers`` gives fresh optimizers). The callback, which resumes
from the newest checkpoint at every ``fit()``, would load the first fit's last checkpoint over
that: its optimizer and scheduler states, its RNG. So a ``fit()`` finished in this process is
remembered by the directory it saved into:

- the same Trainer fits again: it goes on from the live state, as the same run, with the
  callback's ``resume=`` as without it (an explicit step or path applies to the first
  ``fit()`` only; ``fit(ckpt_path=...)`` of ours, given to that ``fit()``, is loaded);
- another Trainer fitting the same LightningModule (a fine-tuning stage after pre-training)
  with that directory: refused, since it would resume the finished run and train nothing. An
  explicit ``resume=`` passes;
- another Trainer with a new module (a notebook cell or a script run again) resumes as usual.

Every rank records and decides alike (each holds the same Trainer).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from ..errors import ConfigError

# realpath of dirpath -> the Trainer and the module of the last fit() that finished there
_FINISHED: dict[str, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}


def finished(trainer: Any, dirpath: str) -> None:
    """A ``fit()`` of ``trainer`` that saved into ``dirpath`` ended without an error."""
    refs = (weakref.ref(trainer), weakref.ref(trainer.lightning_module))
    # (the entries of Trainers and modules gone: one a fit of a sweep otherwise stayed)
    for gone in [k for k, (t, m) in _FINISHED.items() if t() is None and m() is None]:
        del _FINISHED[gone]
    _FINISHED[os.path.realpath(dirpath)] = refs


def fitted_here(trainer: Any, dirpath: str) -> bool:
    """Whether a ``fit()`` of this Trainer, or of its LightningModule, finished in ``dirpath``
    in this process."""
    refs = _FINISHED.get(os.path.realpath(dirpath))
    return refs is not None and (refs[0]() is trainer or refs[1]() is trainer.lightning_module)


def goes_on_live(trainer: Any, dirpath: str, resume: Any = "auto", ckpt_path: bool = False) -> bool:
    """At a ``fit()``'s start, resuming from ``dirpath`` as ``resume`` says (the callback's
    option, or ``fit(ckpt_path=...)``'s choice when ``ckpt_path``): True if this Trainer's
    earlier ``fit()`` in this process finished there (go on from the live state: the callback's
    explicit ``resume=`` applies to the first ``fit()`` only; a ``ckpt_path`` given to this one
    wins); raise :class:`ConfigError` if another Trainer's fit of the same module did and
    ``resume`` is "auto"; False otherwise (resume as ``resume`` says)."""
    if ckpt_path and resume != "auto":
        return False
    trainer_ref, module_ref = _FINISHED.get(os.path.realpath(dirpath), (None, None))
    if trainer_ref is not None and trainer_ref() is trainer:
        return True
    if resume != "auto" or module_ref is None or module_ref() is not trainer.lightning_module:
        return False
    raise ConfigError(
        f"a fit() of this LightningModule by another Trainer finished in {dirpath}: this "
        "Trainer would resume that finished run and train nothing. Give each Trainer (each stage: "
        "pre-training, fine-tuning) its own dirpath, e.g. ResilientCheckpoint(dirpath=...), "
        "or pass resume=<step or path> to resume that run on purpose"
    )
