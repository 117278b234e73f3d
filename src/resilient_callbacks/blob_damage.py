"""Which checkpoints a missing or damaged blob (``incremental=True``) makes corrupt, and how to
repair it, for the commands that judge a directory (``gc``, ``ls``, ``verify``).

A blob of the run's store is shared: the frozen base that every checkpoint names is one file.
When it is missing or damaged, every checkpoint naming it is corrupt, although each one's own
files are whole; and the blob can often be repaired, which makes them all valid again: a whole
copy on the remote tier (``resilient-ckpt pull URL DIR`` puts a verified copy back into the
store), or the run's next save, which writes a blob it finds missing or damaged again (the
same bytes, for a tensor that did not change). So such checkpoints are reported together with
the blob, and ``gc --remove-corrupt`` does not delete them unless told to
(``--remove-blob-corrupt``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .blobs import blob_path
from .catalog import Entry, Status
from .redact import command
from .verification import Depth, _problem

REMOTE_BLOB_PROBLEM = "the blob "  # how remote.py's scan says a blob is missing or torn


@dataclass
class DamagedBlob:
    """A blob that is missing or damaged, and the checkpoints that name it."""

    name: str
    problem: str  # as the check said it (the path, then what is wrong)
    checkpoints: list[str] = field(default_factory=list)  # names, oldest first


def caused_by_blob(e: Entry) -> bool:
    """``e`` is corrupt, and the first problem found is one of its blobs: its own files are
    whole (they are checked before the blobs)."""
    if e.status is not Status.CORRUPT or e.manifest is None or not e.problem:
        return False
    return any(e.problem.startswith(f"{blob_path(e.path, b.path)}:") for b in e.manifest.blobs)


def damaged_blobs(entries: Iterable[Entry]) -> dict[str, DamagedBlob]:
    """The blobs found missing or damaged among those of the checkpoints :func:`caused_by_blob`
    says are corrupt through one, each with every checkpoint of ``entries`` that names it (a
    blob is read once per size and checksum a manifest records for it)."""
    entries = [e for e in entries if e.manifest is not None]
    suspects = {b.path for e in entries if caused_by_blob(e) for b in e.manifest.blobs}  # type: ignore[union-attr]
    found: dict[str, DamagedBlob] = {}
    seen: dict[tuple[str, int, str], str | None] = {}
    for e in sorted(entries, key=lambda e: e.seq):
        assert e.manifest is not None
        for b in e.manifest.blobs:
            if b.path not in suspects:
                continue
            full = blob_path(e.path, b.path)
            key = (full, b.size, b.xxh3_64)
            if key not in seen:
                seen[key] = _problem(full, b, Depth.FULL)
            problem = seen[key]
            if problem is not None:
                d = found.setdefault(b.path, DamagedBlob(b.path, problem))
                if e.name not in d.checkpoints:
                    d.checkpoints.append(e.name)
    return found


def only_blobs(e: Entry, damaged: dict[str, DamagedBlob]) -> list[str]:
    """The damaged blobs that make ``e`` corrupt when nothing else does, else ``[]``."""
    if not caused_by_blob(e):
        return []
    return sorted(n for n, d in damaged.items() if e.name in d.checkpoints)


def repair_note(damaged: dict[str, DamagedBlob], where: str, total: int) -> str:
    """What each damaged blob makes corrupt, and how to repair it (``where``: the directory as
    the user named it; ``total``: how many checkpoints it holds)."""
    lines = []
    for d in sorted(damaged.values(), key=lambda d: d.name):
        n = len(d.checkpoints)
        every = " (every checkpoint)" if n == total else ""
        lines.append(
            f"blob {d.name} is damaged or missing ({d.problem}); the {n} checkpoint(s) "
            f"naming it{every} are corrupt through it: {', '.join(d.checkpoints)}"
        )
    lines.append(
        "repair the blob and they are valid again: with a remote tier, "
        f"{command('pull', 'URL', where)} puts a verified copy back into {where}/blobs; or a "
        "run resumed from a whole checkpoint writes a missing or damaged blob of a tensor that "
        f"did not change again at its next save. {command('verify', where, '--all')} shows "
        "what is whole"
    )
    return "\n".join(lines)


def damage_note(entries: list[Entry], where: str) -> str | None:
    """:func:`repair_note` for the damaged blobs among ``entries`` (checked), or None."""
    damaged = damaged_blobs(entries)
    if not damaged:
        return None
    return repair_note(damaged, where, sum(e.manifest is not None for e in entries))


def remote_keep_note(problem: str | None, args: Any) -> str | None:
    """Why ``gc --remote URL --remove-corrupt`` keeps a remote checkpoint whose only problem
    (``problem``, as :meth:`.remote.RemoteStore.scan` says it) is a missing or torn remote
    blob, which ``push`` repairs; None when it does not keep it for that reason
    (``--remove-blob-corrupt`` deletes it)."""
    if not problem or not problem.startswith(REMOTE_BLOB_PROBLEM) or not args.remove_corrupt:
        return None
    if getattr(args, "remove_blob_corrupt", False):
        return None
    return (
        f"corrupt only through a shared blob: {problem}; {command('push', args.dir, args.remote)}"
        " uploads a whole local copy again (--remove-blob-corrupt deletes it)"
    )
