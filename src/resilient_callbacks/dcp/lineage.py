"""The step of a :class:`~.storage_writer.ResilientStorageWriter` save given none: one after the
step the directory's *current lineage* reached, never after a step it abandoned.

A run that resumed from an older step (``ResilientStorageReader(d, step=2)``, or a fallback
past a damaged newest checkpoint) and trains on is a new lineage; the newer steps of the old
one (3, 4) stay in the directory until retention removes them. Numbering the next save after
the highest step there (5) labelled the state of step 3 as step 5, and the next resume said
``loaded_step == 5``: a loop that goes on from ``loaded_step`` skipped two steps. Instead:

- right after a ``dcp.load`` through :class:`~.storage_reader.ResilientStorageReader` in this
  process, with nothing committed to the directory since: one after the step it loaded;
- otherwise: one after the step of the newest commit (the highest ``seq``, as restore orders
  them), so that after the first save of the new lineage the old one's steps count no more;
- and after any save of this writer still in flight.

Every rank records its loads (:func:`loaded`); the coordinator numbers the save
(:func:`next_step`, which lists the directory). :func:`step_of_id` reads the step a
``checkpoint_id`` names. Nothing here is collective or writes anything.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

from ..branches import Tip
from ..catalog import Entry, lineage_of
from ..errors import ConfigError
from ..manifest import Manifest
from ..reader import by_commit, committed

_lock = threading.Lock()
# realpath of a checkpoint directory -> (step loaded from it, its newest commit's seq then,
# the seq and the lineage field of the checkpoint loaded)
_loads: dict[str, tuple[int, int, int | None, dict[str, Any] | None]] = {}


def newest_seq(entries: Iterable[Entry]) -> int:
    """The ``seq`` of the newest commit among ``entries`` (0 when none has a manifest)."""
    ordered = by_commit(entries)
    return ordered[0].seq if ordered else 0


def loaded(root: str, step: int, seq: int, manifest: Manifest | None = None) -> None:
    """Every rank, after choosing a checkpoint of step ``step`` (``manifest``) in the directory
    ``root`` whose newest commit then had ``seq``: the next unnumbered save there continues
    ``step``, and descends from that checkpoint (its manifest's ``lineage``)."""
    own = (manifest.seq, lineage_of(root, manifest)) if manifest is not None else (None, None)
    with _lock:
        _loads[os.path.realpath(root)] = (step, seq, *own)


def _current_load(root: str, entries: list[Entry], newest: int) -> Any:
    """The load this process recorded for ``root`` (:func:`loaded`), while it still holds: no
    commit there since (``newest``: the newest commit's seq) and the checkpoint it loaded still
    committed there. A directory deleted and made again in this process (a notebook starting
    over) starts its seqs again: the record of the old one's load would count for it."""
    with _lock:
        load = _loads.get(os.path.realpath(root))
    if load is None or load[1] < newest:
        return None
    if load[2] is not None and not any(e.seq == load[2] for e in entries):
        return None
    return load


def rebase(tip: Tip, root: str, seen: object) -> object:
    """Coordinator, as a save into ``root`` is planned: point ``tip`` (where the writer's saves
    descend from) at the checkpoint a ``dcp.load`` in this process took, if one did since
    anything was committed there and it is not ``seen`` (what the last call returned); at the
    first call (``seen`` None) without one, at the newest commit. Returns what to pass next."""
    entries = committed(root)
    ordered = by_commit(entries)
    load = _current_load(root, entries, ordered[0].seq if ordered else 0)
    if load is not None and load != seen:
        tip.rebase(load[2], load[3])
        return load
    if seen is None:
        newest = ordered[0].manifest if ordered else None
        tip.rebase(*((newest.seq, lineage_of(root, newest)) if newest is not None else (None,)))
        return ()
    return seen


def next_step(root: str, in_flight: Iterable[int]) -> int:
    """Coordinator: the step of the next save into ``root``, after the steps of this writer's
    saves still in flight (``in_flight``)."""
    entries = committed(root)
    ordered = by_commit(entries)
    load = _current_load(root, entries, ordered[0].seq if ordered else 0)
    if load is not None:
        base = load[0]  # nothing committed since this process loaded that step
    elif ordered:
        base = ordered[0].step or 0
    else:  # no manifest can be read: the highest step a name gives
        base = max((e.step for e in entries if e.step is not None), default=0)
    return max([base, *in_flight]) + 1


def step_of_id(checkpoint_id: str | os.PathLike[str] | int | None, dirpath: str) -> int | None:
    """The step a ``dcp.save(..., checkpoint_id=...)`` names: an int (or its digits); ``None``
    for none or for the writer's own ``dirpath`` (DCP's habit of passing the directory as
    ``checkpoint_id`` beside ``storage_writer=``). Another path is a :class:`ConfigError`."""
    if checkpoint_id is None or isinstance(checkpoint_id, int):
        return checkpoint_id  # True stays True: refused when the save is planned
    try:
        value = os.fspath(checkpoint_id)
        path = value.removeprefix("file://")  # (a file:// URL names a path, as for dirpath)
        if os.path.realpath(os.path.expanduser(path)) == os.path.realpath(dirpath):
            return None
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"checkpoint_id={checkpoint_id!r}: with ResilientStorageWriter, checkpoint_id is the "
            f"step to save (an int >= 0) or the writer's own directory ({dirpath}): every save "
            "is a new step_* checkpoint in it"
        ) from None
