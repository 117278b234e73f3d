"""What a user marks in a training state: :class:`PerRank` (a part that differs between ranks,
saved by each rank into its own file) and :class:`OptionalKeys` (a dict some of whose keys a
checkpoint may lack); and what a restore on fewer ranks than the save says it does not load of
the ranks gone (``gone_state``, said by rank 0 once every rank restored). Moved from
``structure.py`` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class PerRank:
    """Marks a part of the state that differs between ranks (a data loader's position, a
    rank-local generator). It is written by every rank into its own file and restored on the
    same rank. Everything not marked is treated as replicated and written once, by rank 0.

    ``new_ranks``: what a rank the checkpoint has no files of (a resume on more ranks) loads:
    ``"refuse"`` (default: the resume is refused, nothing loaded) or ``"rank0"`` (rank 0's
    state, for an object that works out its own share from it, such as a sharded
    :class:`~resilient_callbacks.ResumableDataLoader`; a one-rank checkpoint acts so always).

    A restore on fewer ranks than the save says what of the ranks gone is not loaded
    (:func:`gone_state`). An object that knows better than its type what stands in for their
    state (an adapter's restore target, which learns what it holds only as it loads) defines
    ``stand_in_for_gone_ranks() -> (how, what)``: ``how`` one of :data:`RANK0`,
    :data:`LOADER` or :data:`DROPPED`, ``what`` the sentence that says it, asked once loaded."""

    def __init__(self, obj: Any, *, new_ranks: str = "refuse") -> None:
        if new_ranks not in ("refuse", "rank0"):
            raise ValueError(f"PerRank(new_ranks={new_ranks!r}): 'refuse' or 'rank0'")
        self.obj = obj
        self.new_ranks = new_ranks

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r})"


class OptionalKeys(dict[str, Any]):
    """A dict of the state some of whose keys (``optional``) a checkpoint may lack: entries
    added to a state after checkpoints of it were written. Such a key missing from the
    checkpoint keeps its live value on restore; any other missing key is refused, as in a
    plain dict. Saved as a plain dict (the format does not change). The check goes through
    :meth:`missing_allowed`, the hook ``fit.check_fits`` asks of any dict of the state."""

    def __init__(self, *args: Any, optional: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.optional = frozenset(optional)

    def missing_allowed(self, missing: list[str]) -> bool:
        """Whether the checkpoint may lack every one of ``missing``: all are ``optional``."""
        return set(missing) <= self.optional


def gone_ranks(world_size: int, saved_world_size: int) -> str:
    """The ranks of a checkpoint that a run on ``world_size`` ranks has no process for."""
    first, last = world_size, saved_world_size - 1
    return f"rank {first}" if first == last else f"ranks {first} to {last}"


#: how a restore on fewer ranks stands in for a ranks-gone ``PerRank`` part (:func:`gone_state`)
RANK0, LOADER, DROPPED = "rank0", "loader", "dropped"


def gone_state(
    world_size: int,
    saved_world_size: int,
    parts: dict[str, str],
    rng: bool,
    notes: Mapping[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """What rank 0 of a restore on fewer ranks than the save says is not loaded of the ranks
    gone: ``(warnings, infos)``. ``parts``: the checkpoint's ``PerRank`` part ids, each with
    what takes the gone ranks' state's place here: :data:`RANK0` (marked
    ``new_ranks="rank0"``: the object takes rank 0's), :data:`LOADER` (a
    :class:`~resilient_callbacks.ResumableDataLoader`, whose position is the same on every
    rank and is re-sharded from rank 0's) or :data:`DROPPED` (nothing: a warning). ``rng``:
    the checkpoint holds RNG states and they are restored (a warning: streams cannot go on).
    ``notes``: a part's own sentence (``stand_in_for_gone_ranks``), said in place of the
    general one."""
    if saved_world_size <= world_size:
        return [], []
    gone = gone_ranks(world_size, saved_world_size)
    said = f"the checkpoint was written by {saved_world_size} ranks, this run has {world_size}: "
    notes = notes or {}
    dropped = [p for p, how in sorted(parts.items()) if how == DROPPED and p not in notes]
    stood_in = [p for p, how in sorted(parts.items()) if how != DROPPED and p not in notes]
    warnings: list[str] = []
    infos: list[str] = []
    for p, note in sorted(notes.items()):
        lost = parts.get(p) == DROPPED
        (warnings if lost else infos).append(
            said + f"the PerRank state of {gone} in {p!r} is not loaded: {note}"
        )
    if dropped:
        warnings.append(
            said + f"the PerRank state of {gone} in {_ids(dropped)} is not loaded and nothing "
            f"takes its place: what those objects held for {gone} alone (a counter, a generator, "
            "a data position of their own) is dropped, and this run's ranks go on with their "
            f"own. If the run needs it, resume on {saved_world_size} ranks; if rank 0's state "
            "serves every rank (an object that works out its share from it), mark it "
            "PerRank(obj, new_ranks='rank0') and this is not said."
        )
    if stood_in:
        why = {
            RANK0: "is marked PerRank(new_ranks='rank0')",
            LOADER: "is a ResumableDataLoader: its position is the same on every rank, and the "
            "rest of its epoch is re-sharded over this run's ranks",
        }
        infos.append(
            said + f"the PerRank state of {gone} in {_ids(stood_in)} is not loaded, and rank 0's "
            "takes its place: "
            + "; ".join(f"{p!r} {why[parts[p]]}" for p in stood_in)
            + f". Nothing to do, unless those objects held values of {gone} alone (those are "
            "not kept)."
        )
    if rng:
        warnings.append(
            said + f"the RNG states of {gone} are not loaded: their random streams (Python, "
            "NumPy, torch, CUDA) cannot be continued, so the run does not go on exactly as it "
            f"would have on {saved_world_size} ranks (rank 0's streams go on)"
        )
    return warnings, infos


def _ids(ids: list[str]) -> str:
    return ", ".join(repr(i) for i in ids)
