"""Pick and open one committed checkpoint of a directory, verified.

The one selection of "the newest valid checkpoint, with fallback" that the CLI (``inspect``,
``export``) and the Transformers export share::

    sel = reader.select(dirpath)            # newest valid; or select(dirpath, step=200)
    for e in sel.skipped:                   # newer ones that could not be used, newest first
        print(f"skipped {e.name}: {e.problem}")
    opened = reader.open_checkpoint(sel.path)   # the manifest + rank 0's part, verified

Rules:

- Only committed checkpoints count (a ``manifest.json`` present); staging directories and
  directories without a manifest are never chosen nor reported.
- Without ``step``, the newest commit whose files pass the check at ``depth`` is chosen; every
  newer one that fails is in :attr:`Selection.skipped` with its ``problem``, and so is a
  checkpoint whose manifest cannot be read (its commit order is unknown) when its name's step
  is not older than the chosen one.
- A named ``step`` (or a ``dirpath`` that is one checkpoint) is never a fallback: missing is
  :class:`CheckpointNotFoundError`, corrupt is :class:`CheckpointCorruptError`.
- No committed checkpoint at all is :class:`CheckpointNotFoundError`; some, none valid, is
  :class:`NoValidCheckpointError` listing each with why.

Single process, reads only: nothing here takes the directory's lock or runs a collective.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import branches, catalog
from .catalog import Depth, Entry, Status
from .errors import CheckpointCorruptError, CheckpointNotFoundError, NoValidCheckpointError
from .manifest import MANIFEST_NAME, Manifest, read_manifest

if TYPE_CHECKING:  # layout imports torch: only open_checkpoint needs it (the CLI's verify not)
    from . import layout


@dataclass(frozen=True)
class Selection:
    """The chosen checkpoint and the newer ones skipped (newest first, each with ``problem``)."""

    root: str  # the checkpoint directory
    entry: Entry  # the chosen checkpoint, checked at ``depth``
    skipped: tuple[Entry, ...] = ()
    depth: Depth = Depth.FULL

    @property
    def path(self) -> str:
        return self.entry.path

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def step(self) -> int | None:
        return self.entry.step

    @property
    def manifest(self) -> Manifest:
        assert self.entry.manifest is not None  # a chosen entry always has one
        return self.entry.manifest


@dataclass(frozen=True)
class Opened:
    """One checkpoint opened: its manifest and one rank's part, read and verified."""

    path: str
    manifest: Manifest
    part: layout.LoadedPart


# ----------------------------------------------------------------------------- helpers


def describe(e: Entry) -> str:
    """``name (step N)`` of an entry, as messages name a checkpoint."""
    return f"{e.name} (step {e.step if e.step is not None else '?'})"


def committed(root: str) -> list[Entry]:
    """The committed checkpoints of ``root`` (sizes checked), oldest commit first; those whose
    manifest cannot be read come first."""
    return catalog.committed(catalog.scan(root, Depth.SIZE))


def check(e: Entry, depth: Depth = Depth.FULL) -> Entry:
    """Verify ``e`` (in place) at ``depth`` unless it is already known to be bad. A scan has
    checked sizes already, so only ``Depth.FULL`` reads anything more (every checksum)."""
    if depth is Depth.FULL and e.status is Status.VALID and e.manifest is not None:
        try:
            catalog.verify(e.path, e.manifest, Depth.FULL)
        except CheckpointCorruptError as err:
            if catalog.gone(e.path):  # retention of a run writing here deleted it meanwhile
                e.status, e.problem = Status.INCOMPLETE, "deleted while it was being read"
            else:
                e.status, e.problem = Status.CORRUPT, str(err)
        except OSError as err:  # unreadable: permissions, a directory where a file should be
            e.status, e.problem = Status.CORRUPT, catalog.unreadable(err)
    return e


def by_commit(entries: Iterable[Entry]) -> list[Entry]:
    """Entries with a readable manifest, newest commit first (the order restore tries them),
    those of a branch a roll-back abandoned after every one of the current lineage
    (:mod:`.branches`)."""
    known = [e for e in entries if e.manifest is not None]
    off = abandoned(known)
    return sorted(
        known, key=lambda e: (e.name not in off, e.seq, e.step or 0, e.name), reverse=True
    )


def abandoned(entries: Iterable[Entry]) -> set[str]:
    """The names of ``entries`` on a branch a roll-back abandoned (:mod:`.branches`)."""
    ms = {e.name: e.manifest for e in entries if e.manifest is not None}
    off = branches.off_lineage((m.run_id, m.seq, m.lineage) for m in ms.values())
    return {n for n, m in ms.items() if (m.run_id, m.seq) in off}


def current(entries: Iterable[Entry], only: bool = True) -> list[Entry]:
    """``entries`` less those of a branch a roll-back abandoned (``only=False``: all of them)."""
    entries = list(entries)
    off = abandoned(entries) if only else set()
    return [e for e in entries if e.name not in off]


def unordered(entries: Iterable[Entry], not_older_than: int | None) -> list[Entry]:
    """Committed entries whose manifest cannot be read (their commit order is unknown) and
    whose name's step is at least ``not_older_than``: they may be newer than the newest."""
    return [
        e
        for e in entries
        if e.status is Status.CORRUPT
        and e.manifest is None
        and (not_older_than is None or (e.step is not None and e.step >= not_older_than))
    ]


# ----------------------------------------------------------------------------- choosing


def find(
    entries: list[Entry], root: str, step: int | None = None, only: str | None = None
) -> Entry:
    """The newest commit among ``entries`` of ``step`` (any step when None), not verified;
    :class:`CheckpointNotFoundError` naming the steps there are when none has that step.
    ``only``: ``entries`` are the one checkpoint of that name in ``root`` the user gave."""
    chosen = [e for e in entries if step is None or e.step == step]
    if not chosen:
        steps = sorted({e.step for e in entries if e.step is not None})
        if only is not None:  # not "no checkpoint of step N in root": root may well hold one
            raise CheckpointNotFoundError(
                f"{os.path.join(root, only)} is one checkpoint, of step "
                f"{', '.join(map(str, steps)) or 'unknown'}, not of step {step}: give the "
                f"run's directory {root} with --step {step}"
            )
        raise CheckpointNotFoundError(
            f"no checkpoint of step {step} in {root} (its steps: {', '.join(map(str, steps))})"
        )
    ordered = by_commit(chosen)
    return ordered[0] if ordered else chosen[-1]


def newest_valid(entries: list[Entry], root: str, depth: Depth = Depth.FULL) -> Selection:
    """The newest commit among ``entries`` that passes the check at ``depth``, and the newer
    ones skipped; :class:`NoValidCheckpointError` listing each when none passes."""
    skipped: list[Entry] = []
    for e in by_commit(entries):
        if check(e, depth).status is Status.VALID:
            return Selection(root, e, tuple(skipped + unordered(entries, e.step)), depth)
        skipped.append(e)
    skipped += unordered(entries, None)
    from .blob_damage import damage_note

    note = damage_note(skipped, root)  # one damaged blob they share: which, and its repair
    raise NoValidCheckpointError(
        f"no valid checkpoint in {root}: all {len(entries)} are corrupt:\n  - "
        + "\n  - ".join(f"{describe(s)}: {s.problem}" for s in skipped)
        + (f"\n{note}" if note else "")
    )


def select(
    dirpath: str | os.PathLike[str], step: int | None = None, *, depth: Depth = Depth.FULL
) -> Selection:
    """The checkpoint to read from ``dirpath``: the newest valid one, or the one of ``step``.

    ``dirpath`` is a checkpoint directory (what ``Checkpointer(...)`` was given) or one
    checkpoint in it (a directory holding ``manifest.json``; ``step``, if given, must be its).
    ``depth``: ``Depth.FULL`` reads every checksum, ``Depth.SIZE`` only compares sizes."""
    path = os.fspath(dirpath)
    only: str | None = None
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        root = os.path.dirname(os.path.abspath(path))
        only = os.path.basename(os.path.abspath(path))
    elif os.path.isdir(path):
        root = path
    else:
        what = "not a directory" if os.path.exists(path) else "no such checkpoint directory"
        raise CheckpointNotFoundError(f"{path}: {what}")
    entries = committed(root)
    if only is not None:
        entries = [e for e in entries if e.name == only]
    if not entries:
        raise CheckpointNotFoundError(f"no checkpoints in {root}")
    if only is None and step is None:
        return newest_valid(entries, root, depth)
    e = check(find(entries, root, step, only), depth)
    if e.status is not Status.VALID:
        raise CheckpointCorruptError(f"checkpoint {e.path} (step {e.step}) is corrupt: {e.problem}")
    return Selection(root, e, (), depth)


def open_checkpoint(path: str | os.PathLike[str], rank: int = 0) -> Opened:
    """Read one committed checkpoint's manifest and ``rank``'s part, verified while read
    (:class:`CheckpointCorruptError` on a bad file)."""
    from . import layout

    p = os.path.abspath(os.fspath(path))
    manifest = read_manifest(p)
    return Opened(p, manifest, layout.read_part(p, manifest, rank))


__all__ = [
    "Opened",
    "Selection",
    "by_commit",
    "check",
    "committed",
    "describe",
    "find",
    "newest_valid",
    "open_checkpoint",
    "select",
    "unordered",
]
