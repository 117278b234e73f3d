"""Which checkpoints of a run descend from which: the run's *lineage* after a roll-back.

A run that resumes from an older checkpoint (``resume=40`` while 50 and 60 exist, a fallback
past a damaged newest one, a ``dcp.load`` of an older step) starts a new branch: its saves
(``step_000000050-1``, ...) continue 40, and 50 and 60 are *abandoned*. Commit order alone
("newest" = highest ``seq``) cannot tell them apart once the new branch is older than
``keep_last`` or its newest checkpoint is damaged: retention kept the abandoned 60 and deleted
40, and a fallback past a damaged ``50-1`` restored 60, a timeline the user threw away.

So every manifest written by a writer that knows where its state came from records
``"lineage": {"parent": P, "abandoned": [[lo, hi], ...]}``: ``P`` the commit number (``seq``)
of the checkpoint it continues (the one restored, or the previous save of the process; null
for a fresh start), and the ranges of commit numbers of its run below its own that it does
*not* descend from. The checkpoints of a run on its current lineage are then its newest commit
(the *head*) and every commit of the run below the head's ``seq`` outside those ranges.

A manifest without the field (written before it existed, or by a bare
:class:`~.session.CommitSession`) abandons what the newest commit of its run below it that
records the field abandons (:func:`inherited`): a version that writes no lineage resumes the
run's newest checkpoint, so its saves continue the lineage recorded before (an upgrade, a
downgrade and an upgrade again after a roll-back keep the abandoned branch abandoned). Where no
commit records one: nothing, commit order, as before. Readers that do not know the field
ignore it, so the format version is unchanged.

Pure functions and one small tracker (:class:`Tip`, coordinator only); no IO, no collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

KEY = "lineage"  # the manifest field
Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive [lo, hi] ranges of seq


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted, adjacent or overlapping ones joined, empty ones dropped."""
    out: list[list[int]] = []
    for lo, hi in sorted((int(a), int(b)) for a, b in ranges if a <= b):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def _within(seq: int, ranges: Ranges) -> bool:
    return any(lo <= seq <= hi for lo, hi in ranges)


@dataclass(frozen=True)
class Lineage:
    """A checkpoint's ``lineage`` field (see the module docstring)."""

    parent: int | None = None
    abandoned: Ranges = ()

    def to_json(self) -> dict[str, Any]:
        return {"parent": self.parent, "abandoned": [list(r) for r in self.abandoned]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Lineage:
        """The field as a manifest holds it; a ``TypeError`` or ``ValueError`` when malformed
        (the manifest is then corrupt, like any other field of the wrong type)."""
        parent = d.get("parent")
        if parent is not None and type(parent) is not int:
            raise TypeError(f"lineage parent {parent!r}: not a commit number")
        raw = d.get("abandoned") or []
        if not isinstance(raw, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in raw
        ):
            raise TypeError(f"lineage abandoned {raw!r:.200}: not a list of [lo, hi] ranges")
        if any(lo > hi for lo, hi in raw):
            raise ValueError(f"lineage abandoned {raw!r:.200}: a range with lo > hi")
        return cls(parent, merge((lo, hi) for lo, hi in raw))


def of(raw: Mapping[str, Any] | None) -> Lineage | None:
    """The lineage a manifest's field records; None when it has none (commit order)."""
    return Lineage.from_json(raw) if raw else None


def inherited(rows: Iterable[tuple[int, Mapping[str, Any] | None]], seq: int) -> Lineage | None:
    """The lineage of commit ``seq`` of a run whose commits are ``rows`` (``seq``, ``lineage``
    field): its own field; for a commit without one, that of the newest commit below it that
    has one (see the module docstring); None when none has. A malformed field counts as none
    (a manifest that parses has a valid one)."""
    for s, raw in sorted(rows, key=lambda r: r[0], reverse=True):
        if s > seq or not raw:
            continue
        try:
            return of(raw)
        except (TypeError, ValueError):
            continue
    return None


def off_lineage(items: Iterable[tuple[str, int, Mapping[str, Any] | None]]) -> set[tuple[str, int]]:
    """Of the committed checkpoints ``items`` (run id, ``seq``, their manifest's ``lineage``
    field), the keys (run id, ``seq``) of those a roll-back abandoned: not on the lineage of the
    newest commit of their run (for a head without the field: :func:`inherited`)."""
    runs: dict[str, list[tuple[int, Mapping[str, Any] | None]]] = {}
    for run, seq, raw in items:
        runs.setdefault(run, []).append((seq, raw))
    out: set[tuple[str, int]] = set()
    for run, rows in runs.items():
        head = max(s for s, _ in rows)
        line = inherited(rows, head)
        if line is None or not line.abandoned:
            continue
        out.update((run, s) for s, _ in rows if s < head and _within(s, line.abandoned))
    return out


@dataclass
class Tip:
    """Coordinator: where the next save of a writer descends from. ``rebase`` at a restore
    (the checkpoint loaded: its ``seq`` and lineage; ``None`` for a fresh start), ``planned``
    for each save once its ``seq`` is known, ``child`` for the lineage its manifest records.

    A save descends from the base, the base's own ancestors and the earlier saves of this
    writer since the base, committed or still in flight; every other commit number of the run
    between the base and it is abandoned (the newer checkpoints a roll-back left behind)."""

    base: int | None = None
    base_abandoned: Ranges = ()
    own: list[int] = field(default_factory=list)

    def rebase(self, seq: int | None, raw: Mapping[str, Any] | None = None) -> None:
        try:
            line = of(raw)
        except (TypeError, ValueError):
            line = None
        self.base = seq
        self.base_abandoned = line.abandoned if line is not None else ()
        self.own = []

    def planned(self, seq: int) -> None:
        if seq not in self.own:
            self.own.append(seq)

    def child(self, seq: int) -> Lineage:
        """The lineage of this writer's save numbered ``seq``."""
        earlier = sorted(s for s in self.own if s < seq)
        parent = earlier[-1] if earlier else self.base
        start = self.base + 1 if self.base is not None else (earlier[0] if earlier else seq)
        gaps: list[tuple[int, int]] = []
        lo = start
        for s in [*earlier, seq]:
            if s < lo:
                continue
            gaps.append((lo, s - 1))
            lo = s + 1
        return Lineage(parent, merge([*self.base_abandoned, *gaps]))
