"""One retention pass over a checkpoint directory: delete the checkpoints the policy does not
keep (renamed to the trash and the directory fsynced first), then the blobs no remaining
checkpoint refers to.

Which ranks call what: only the coordinator (the directory's writer, who holds its lock).
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Callable, Iterable

from . import catalog
from .blobs import BlobStore
from .commit import remove_checkpoints
from .known import KnownCheckpoints
from .redact import command
from .repeats import Repeats, again, reason
from .retention import RetentionPolicy, found_corrupt, plan_checking

log = logging.getLogger("resilient_callbacks")


def apply_retention(
    root: str,
    policy: RetentionPolicy,
    run_id: str | None,
    protected: Iterable[str] = (),
    blobs: BlobStore | None = None,
    discard: Callable[[str], None] | None = None,
    corrupt: Iterable[str] = (),
    known: KnownCheckpoints | None = None,
    said: Repeats | None = None,
) -> None:
    """Coordinator: delete what ``policy`` does not keep among the committed checkpoints of
    ``root``. Never deletes a ``protected`` name, the newest valid checkpoint, or another run's.
    With ``blobs`` (the store of the directory's writer, which knows the saves in flight), the
    blobs no remaining checkpoint refers to are deleted after the checkpoints. ``discard``: who
    deletes the files of a checkpoint once it is renamed out of sight (a
    :class:`~.trash.TrashBin`, in the background); here, without one. ``corrupt``: names known
    corrupt though their sizes are right (a restore read them): kept, as corrupt. ``known``: the
    checkpoints the writer read at its commits before (the manifests of new folders only are
    read; the files' sizes are checked of those the decision depends on only:
    :func:`~.retention.plan_checking`). ``said``: the failures to delete said before (a checkpoint that cannot be
    deleted is said once, not after every save: :mod:`.repeats`). ``keep_last=None`` deletes
    nothing (:func:`~.retention.plan`): no scan."""
    if policy.keep_last is None:  # (each save read every manifest and listed file's size)
        return
    known = known or KnownCheckpoints()
    try:
        rows = known.entries(root)
    except FileNotFoundError:  # (no directory: nothing to delete)
        return
    cands = found_corrupt((c for _, c in rows), corrupt)
    with catalog.blobs_read_once():  # a blob many checkpoints name: its size checked once
        p = plan_checking(cands, policy, run_id, protected, known.valid)

    def failed(name: str, e: OSError) -> None:
        path = os.path.join(root, name)
        n = said.due(path, reason(e)) if said is not None else 1
        if n is None:  # said before, for this reason: each pass tries again, quietly
            log.debug("retention: could not delete %s (again): %s", path, e)
            return
        log.error(
            "retention: could not delete %s: %s. It stays on the disk (the next retention pass "
            "tries again); fix the cause (permissions, a read-only mount), or delete it by hand "
            "once the job ended: rm -r %s (or %s)%s",
            path,
            e,
            shlex.quote(path),
            command("gc", root),
            again(n),
        )

    # renamed to the trash and the directory fsynced before a file goes; blobs only then
    for name in (gone := remove_checkpoints(root, list(p.delete), discard, failed)):
        log.info("retention: deleted %s", name)
        if said is not None:
            said.cleared(os.path.join(root, name))
    if gone and blobs is not None:  # (none if the sync failed: the renames may be undone)
        collect_blobs(blobs)


def collect_blobs(blobs: BlobStore) -> None:
    """Delete the blobs no committed checkpoint refers to (never one a save in flight uses)."""
    try:
        gone = blobs.collect()
    except OSError as e:
        log.warning("could not delete unused blobs in %s: %s", blobs.dir, e)
        return
    if gone:
        log.info("deleted %d unused blob(s) in %s", len(gone), blobs.dir)
