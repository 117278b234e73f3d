"""Discovering the checkpoints in a directory and judging each one.

Discovery trusts manifests, never names or modification times: a directory is a checkpoint
only if its ``manifest.json`` parses, and its order is the manifest's commit sequence number.
Status of each entry:

- ``valid``: manifest present, every listed file present with the listed size (and, when
  verified deeply, the listed checksum);
- ``corrupt``: manifest present but a file is missing, has another size or another checksum, or
  the manifest itself is unreadable or unsafe;
- ``incomplete``: a checkpoint-shaped or staging directory without a manifest (being written
  right now, or left by a crash); never loaded, swept when the next writer starts.

A ``step_*`` folder that plain ``dcp.save`` wrote (its pickled ``.metadata``) is not ours: not
listed, never deleted; :func:`plain_dcp_note` says what it is where nothing of ours is found.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import Any

from .branches import inherited
from .commit import CKPT_RE, STAGING_PREFIX, TRASH_PREFIX
from .errors import CheckpointCorruptError
from .history import HISTORY_NAME
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .retention import Candidate
from .verification import (  # noqa: F401 (re-exported: their old home)
    Depth,
    blobs_read_once,
    read_blob_once,
    verify,
    verify_entries,
)

log = logging.getLogger(__name__)


class Status(StrEnum):
    VALID = "valid"
    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"


@dataclass
class Entry:
    name: str
    path: str
    status: Status
    manifest: Manifest | None = None
    problem: str | None = None
    problem_type: str | None = None  # the error's class name, where one said the problem

    @property
    def step(self) -> int | None:
        if self.manifest is not None:
            return self.manifest.step
        m = CKPT_RE.match(self.name) or CKPT_RE.match(_strip_staging(self.name))
        return int(m.group(1)) if m else None

    @property
    def seq(self) -> int:
        return self.manifest.seq if self.manifest is not None else -1


def _strip_staging(name: str) -> str:
    if name.startswith(STAGING_PREFIX):
        rest = name[len(STAGING_PREFIX) :]
        return rest.rsplit("-", 1)[0]
    return name


OURS_MARKERS = (HISTORY_NAME, "latest")  # what a writer of ours leaves in its directory


class ManifestCache:
    """The manifests one scanner (a directory's writer, at every retention) parsed, by
    checkpoint folder, each with the identity of its file (device, inode, size, modification
    and change times): a later :func:`scan` parses only the manifests that are new or
    changed. A writer's retention scanned every checkpoint at every save, so a run keeping
    archives (``keep_every_n_steps``) or the best ones parsed them all again each time, each
    naming a blob per tensor with ``incremental=True``. Committed manifests are never
    rewritten in place (a repair writes a new file), so a stale entry would need a rewrite of
    the same size within one timestamp tick. What a scan no longer finds is forgotten."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[tuple[int, ...], Manifest]] = {}
        self.parsed = 0  # manifests read from disk (tests count them)

    def read(self, path: str, st: os.stat_result) -> Manifest:
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = self._seen.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        manifest = read_manifest(path)
        self.parsed += 1
        self._seen[path] = (key, manifest)
        return manifest

    def keep_only(self, paths: set[str]) -> None:
        for gone_path in set(self._seen) - paths:
            del self._seen[gone_path]


def scan(root: str, depth: Depth = Depth.SIZE, cache: ManifestCache | None = None) -> list[Entry]:
    """Every checkpoint-like entry under ``root``: committed ones ordered by commit sequence
    (oldest first), then incomplete ones. ``cache``: the scanner's manifests parsed before
    (unchanged ones are not parsed again)."""
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    committed: list[Entry] = []
    incomplete: list[Entry] = []
    for name in names:
        ours = name.startswith((TRASH_PREFIX, STAGING_PREFIX)) or CKPT_RE.match(name)
        if not ours:  # a file or a folder of the user's (a copy, an export): not looked at
            continue
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if name.startswith(TRASH_PREFIX):
            incomplete.append(
                Entry(
                    name,
                    path,
                    Status.INCOMPLETE,
                    problem="being deleted, or left by a crash during deletion",
                )
            )
            continue
        if name.startswith(STAGING_PREFIX):
            incomplete.append(
                Entry(
                    name,
                    path,
                    Status.INCOMPLETE,
                    problem="staging directory: being written, or left by a crash",
                )
            )
            continue
        try:
            st = os.stat(os.path.join(path, MANIFEST_NAME))
        except FileNotFoundError:
            if os.path.isfile(os.path.join(path, PLAIN_DCP_METADATA)):
                continue  # plain dcp.save's checkpoint (step_100): not ours, never deleted
            incomplete.append(Entry(name, path, Status.INCOMPLETE, problem="no manifest"))
            continue
        except OSError as e:  # a folder this user cannot read: not known to be incomplete
            committed.append(Entry(name, path, Status.CORRUPT, problem=unreadable(e)))
            continue
        read = partial(cache.read, st=st) if cache is not None else read_manifest
        entry = check(name, path, depth, read)
        if entry is not None:  # None: it went away while it was read
            committed.append(entry)
    if cache is not None:
        cache.keep_only({e.path for e in committed})
    committed.sort(key=lambda e: (e.seq, e.step or 0, e.name))
    return committed + incomplete


def check(
    name: str, path: str, depth: Depth, read: Callable[[str], Manifest] = read_manifest
) -> Entry | None:
    """The entry of the checkpoint folder ``path`` (it has a manifest), checked to ``depth``;
    None when it went away while it was read. ``read``: how its manifest is read."""
    try:
        manifest = read(path)
    except (CheckpointCorruptError, FileNotFoundError) as e:
        if gone(path):
            return None
        return Entry(name, path, Status.CORRUPT, problem=str(e), problem_type=type(e).__name__)
    except OSError as e:
        return Entry(name, path, Status.CORRUPT, problem=unreadable(e))
    entry = Entry(name, path, Status.VALID, manifest)
    if depth is not Depth.NONE:
        try:
            verify(path, manifest, depth)
        except CheckpointCorruptError as e:
            if gone(path):
                return None
            entry.status, entry.problem = Status.CORRUPT, str(e)
        except OSError as e:  # permissions, a directory where a file should be
            entry.status, entry.problem = Status.CORRUPT, unreadable(e)
    return entry


def unreadable(e: OSError) -> str:
    """The problem of a checkpoint whose files this user cannot read."""
    return f"cannot read it ({type(e).__name__}: {e})"


def gone(path: str) -> bool:
    """Whether the checkpoint at ``path`` went away while it was read: retention of a run
    writing beside the reader renamed it out of sight to delete it. Not a corrupt checkpoint,
    no checkpoint at all."""
    return not os.path.isdir(path)


def committed(entries: Iterable[Entry]) -> list[Entry]:
    """Entries that have a manifest (valid, with bad files, or with an unreadable manifest),
    oldest first; those whose manifest cannot be read come first (no commit number)."""
    return [e for e in entries if e.status is not Status.INCOMPLETE]


def foreign_folders(root: str, entries: Iterable[Entry]) -> list[str]:
    """The ``step_<n>`` folders without a manifest among ``entries`` (those of ``root``) when
    nothing in ``root`` shows it is a checkpoint directory of ours (a ``history.jsonl``, a
    ``latest`` file, a checkpoint with a manifest): another tool's folders (``step_1000`` of a
    trainer of its own), never to be deleted. Empty when ``root`` is ours."""
    entries = list(entries)
    if any(e.status is not Status.INCOMPLETE for e in entries):
        return []
    if any(os.path.lexists(os.path.join(root, n)) for n in OURS_MARKERS):
        return []
    return [e.name for e in entries if CKPT_RE.match(e.name)]


def not_ours_note(root: str, names: list[str]) -> str:
    """Why ``gc`` leaves the folders ``names`` (:func:`foreign_folders`) alone."""
    return (
        f"left alone: {', '.join(names)} in {root} (no manifest.json); {root} shows no sign of "
        "being a checkpoint directory of resilient_callbacks (no history.jsonl, no latest file, "
        "no checkpoint with a manifest), so these are not ours to delete: remove them yourself "
        "if they are leftovers"
    )


def retention_candidates(entries: Iterable[Entry]) -> list[Candidate]:
    """The entries retention decides about: those with a readable manifest."""
    return [
        Candidate(
            e.name,
            e.manifest.step,
            e.manifest.seq,
            e.manifest.run_id,
            e.manifest.metrics,
            e.status is Status.VALID,
            archived=archived_point(e.manifest.step, e.manifest.retention),
            lineage=e.manifest.lineage,
        )
        for e in entries
        if e.manifest is not None
    ]


def archived(m: Manifest) -> bool:
    """Whether checkpoint ``m`` was an archive point of the remote tier when it was written
    (its remote retention policy, else its local one): kept remotely whatever the options now."""
    return archived_point(m.step, m.remote_retention or m.retention)


def archived_point(step: int, recorded: Mapping[str, Any]) -> bool:
    """Whether the retention policy recorded in a checkpoint made it an archive point."""
    n = recorded.get("keep_every_n_steps")
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and step % n == 0


def next_seq(root: str) -> int:
    """One more than the highest commit sequence number in ``root``. A manifest this library
    refuses (a newer format, a field it finds invalid) still gives its ``seq`` when the JSON
    has one, so commits made now are newer than it; one that cannot be read at all
    (permissions) is named in a warning: its commit order is unknown."""
    best = 0
    unknown: dict[str, list[str]] = {"unreadable": [], "damaged": []}
    for e in scan(root, Depth.NONE):
        if e.manifest is not None:
            best = max(best, e.manifest.seq)
        elif e.status is not Status.INCOMPLETE:
            seq = _raw_seq(e.path)
            if isinstance(seq, str):
                unknown[seq].append(e.name)
            elif seq is not None:
                best = max(best, seq)
    for why, names in unknown.items():
        if names:
            log.warning(
                "the commit order of %s in %s is unknown: %s %s",
                ", ".join(names),
                root,
                MANIFEST_NAME,
                _UNKNOWN_ORDER[why],
            )
    return best + 1


_UNKNOWN_ORDER = {
    "unreadable": "cannot be read (checkpoints committed now may be taken for older than it "
    "once it can be read again; fix its permissions, or remove the checkpoint if it is not "
    "needed)",
    "damaged": "is damaged: not JSON, torn or overwritten (it is no checkpoint; remove it if it "
    "is not needed: `resilient-ckpt ls` lists it)",
}


def _raw_seq(path: str) -> int | str | None:
    """The ``seq`` field of a checkpoint's manifest read as plain JSON, without validating the
    rest; None when it has none; ``"unreadable"`` when the file cannot be read (permissions),
    ``"damaged"`` when it is not JSON."""
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            raw = f.read()
    except OSError:
        return "unreadable"
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "damaged"
    seq = data.get("seq") if isinstance(data, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else None


HINT_MAX_DIRS = 500  # directories holders() looks into
HINT_MAX_ENTRIES = 2000  # entries of one directory holders() reads (a folder of data files)


def holders(path: str) -> list[tuple[str, int]]:
    """``(relative path, number of checkpoints)`` of the subdirectories of ``path`` (four
    levels down at most, ``HINT_MAX_DIRS`` directories looked at, the first
    ``HINT_MAX_ENTRIES`` entries of each) that hold checkpoints. A hint for messages: bounded,
    so a ``dirpath`` above a dataset costs little on a shared filesystem (the entries' types
    come from the directory listing, not a stat each)."""
    found: list[tuple[str, int]] = []
    looked = 0

    def visit(rel: str, level: int) -> None:
        nonlocal looked
        for name in _subdirs(os.path.join(path, rel)):
            if looked >= HINT_MAX_DIRS:
                return
            sub = os.path.join(rel, name) if rel else name
            full = os.path.join(path, sub)
            if os.path.exists(os.path.join(full, MANIFEST_NAME)):
                continue  # a checkpoint itself: its parent is the holder
            looked += 1
            n = len(committed(scan(full, Depth.NONE)))
            if n:
                found.append((sub, n))
            elif level < 4:  # demo_output/plain/interrupted/checkpoints
                visit(sub, level + 1)

    visit("", 1)
    return found


PLAIN_DCP_METADATA = ".metadata"  # plain dcp.save's (FileSystemWriter's) metadata, a pickle


def plain_dcp(path: str) -> list[str]:
    """Where ``path`` holds checkpoints written by plain ``dcp.save`` (``FileSystemWriter``: a
    pickled ``.metadata`` beside ``*.distcp`` files), which this library neither lists nor
    loads: ``["."]`` when ``path`` is one, else the names of its subdirectories that are
    (bounded like :func:`holders`). A hint for messages."""
    if os.path.isfile(os.path.join(path, PLAIN_DCP_METADATA)):
        return ["."]
    subs = _subdirs(path)[:HINT_MAX_DIRS]
    return [s for s in subs if os.path.isfile(os.path.join(path, s, PLAIN_DCP_METADATA))]


def plain_dcp_note(path: str, found: list[str] | None = None) -> str:
    """What to say of the plain ``dcp.save`` checkpoints in ``path`` (``found``: its
    :func:`plain_dcp`) where nothing of ours is: what they are and how to carry them over;
    ``""`` when there are none."""
    found = plain_dcp(path) if found is None else found
    if not found:
        return ""
    if found == ["."]:
        what, first = f"{path} is a checkpoint", path
    else:
        n = len(found)
        shown = ", ".join(found[:5]) + (f" and {n - 5} more" if n > 5 else "")
        are = "is a checkpoint" if n == 1 else "are checkpoints"
        what, first = f"{shown} in {path} {are}", os.path.join(path, found[0])
    return (
        f"{what} written by plain dcp.save (a pickled .metadata and *.distcp files), which "
        "resilient_callbacks neither lists nor loads; to carry it over, load it with "
        f"dcp.load(sd, storage_reader=plain_dcp_reader({first!r}, allow_pickle=True)) (from "
        "resilient_callbacks.dcp; it unpickles: only a checkpoint you trust) and save it again "
        "with ResilientStorageWriter or a Checkpointer"
    )


def _subdirs(path: str) -> list[str]:
    """The names of the directories among the first ``HINT_MAX_ENTRIES`` entries of ``path``
    (hidden ones left out), sorted."""
    names: list[str] = []
    try:
        with os.scandir(path) as entries:
            for i, entry in enumerate(entries):
                if i >= HINT_MAX_ENTRIES:
                    break
                with contextlib.suppress(OSError):
                    if not entry.name.startswith(".") and entry.is_dir():
                        names.append(entry.name)
    except OSError:
        return []
    return sorted(names)


def lineage_of(root: str, m: Manifest) -> dict[str, object]:
    """The ``lineage`` a save continuing ``m`` (a checkpoint of ``root``) builds on: its own
    field; for a manifest without one (written by a version before the field existed), what
    :func:`.branches.inherited` finds among the commits of its run in ``root`` (manifests
    only are read, and only then)."""
    if m.lineage:
        return m.lineage
    rows = [
        (e.manifest.seq, e.manifest.lineage)
        for e in scan(root, Depth.NONE)
        if e.manifest is not None and e.manifest.run_id == m.run_id
    ]
    line = inherited(rows, m.seq)
    return line.to_json() if line is not None else {}
