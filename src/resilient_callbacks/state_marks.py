"""What a user marks in a training state: :class:`PerRank` (a part that differs between ranks,
saved by each rank into its own file) and :class:`OptionalKeys` (a dict some of whose keys a
checkpoint may lack); and what a restore on fewer ranks than the save says it does not load of
the ranks gone (``gone_state``, said by rank 0 once every rank restored). Moved from
``structure.py`` unchanged.
"""

from __future__ import annotations

from typing import Any


class PerRank:
    """Marks a part of the state that differs between ranks (a data loader's position, a
    rank-local generator). It is written by every rank into its own file and restored on the
    same rank. Everything not marked is treated as replicated and written once, by rank 0.

    ``new_ranks``: what a rank the checkpoint has no files of (a resume on more ranks) loads:
    ``"refuse"`` (default: the resume is refused, nothing loaded) or ``"rank0"`` (rank 0's
    state, for an object that works out its own share from it, such as a sharded
    :class:`~resilient_callbacks.ResumableDataLoader`; a one-rank checkpoint acts so always)."""

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


def gone_state(world_size: int, saved_world_size: int, per_rank: bool, rng: bool) -> list[str]:
    """What rank 0 of a restore on fewer ranks than the save says is not loaded: the ranks
    gone's ``PerRank`` state (``per_rank``: the checkpoint holds some) and RNG states (``rng``:
    it holds them and they are restored)."""
    if saved_world_size <= world_size:
        return []
    gone = gone_ranks(world_size, saved_world_size)
    said = f"the checkpoint was written by {saved_world_size} ranks, this run has {world_size}: "
    return [said + f"the PerRank state of {gone} is not loaded"] * per_rank + [
        said + f"the RNG states of {gone} are not loaded: their random streams (Python, NumPy, "
        "torch, CUDA) cannot be continued, so the run does not go on exactly as it would have "
        f"on {saved_world_size} ranks (rank 0's streams go on)"
    ] * rng
