"""The saves the remote retention keeps reach the remote tier, whatever ``remote_every_n_saves``
says: the run's best checkpoints and its archive points.

With ``remote_every_n_saves=N`` only every Nth commit is uploaded; the remote retention keeps
the ``remote_keep_best`` (by default ``keep_best``) best of what it was given, and the archive
points (``keep_every_n_steps``) of what it was given forever. A best checkpoint or an archive
point that was not an Nth save lay on the local disk only (in node-local mode lost with a
node): the remote kept the best of the others, and archive points only by chance. So
:func:`why_due`, the one decision every commit and restart asks, uploads a save that is due by
the interval, an archive point under the remote retention's policy (:func:`~.retention.
kept_as_archive`, what the remote retention then keeps: never one it deletes), or one of the
best the remote retention keeps, among the run's checkpoints in the directory as it is
committed (a later, better save makes it an ordinary one that the remote retention deletes).
The best test is :func:`~.retention.best_names` under the remote policy over the local
checkpoints: the local tier keeps its ``keep_best`` best too with such an interval
(:meth:`~.config.CheckpointerConfig.local_retention_policy`), so none of the run's best is missed;
where ``remote_keep_best`` is larger, one ranked below them may be uploaded needlessly (the
remote retention deletes it), never one of them skipped.

The same tests at a restart (:mod:`.node_recovery`, :func:`~.restore_remote.reconcile_uploads`,
through :func:`kept`) make a best checkpoint or an archive point the store lacks due (one the
run's history records as uploaded was deleted from the store since: not uploaded again).

Which ranks call what: the coordinator at each commit (shared mode: the one writer; node-local
mode: rank 0, on its node's directory, broadcasting the decision with the commit's outcome so
every node uploads its part or none does); each leader at a restart, on its own directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from . import catalog
from .catalog import Entry
from .known import KnownCheckpoints
from .retention import RetentionPolicy, best_names, found_corrupt, kept_as_archive

if TYPE_CHECKING:
    from .config import CheckpointerConfig

log = logging.getLogger("resilient_callbacks")

#: why a save is uploaded (:func:`why_due`), as the logs name it
INTERVAL = "due by remote_every_n_saves"
ARCHIVE = "an archive point"
BEST = "a best checkpoint (keep_best)"


def why_due(
    interval_due: bool,
    step: int,
    policy: RetentionPolicy,
    ranks_best: Callable[[], bool],
    archived: bool = False,
) -> str | None:
    """Why a save of ``step`` is uploaded (:data:`INTERVAL`, :data:`ARCHIVE`, :data:`BEST`), or
    None: not due. ``interval_due``: by ``remote_every_n_saves`` (a final, emergency or
    exception save too: :meth:`~.config.CheckpointerConfig.remote_due`); ``policy``: the
    remote retention's; ``ranks_best``: whether it ranks among the best ``policy`` keeps, asked
    last (it reads the directory); ``archived``: it was an archive point under the remote
    policy it was written with (:func:`~.catalog.archived`; at a commit, ``policy`` is that)."""
    if interval_due:
        return INTERVAL
    return kept(step, policy, ranks_best, archived)


def kept(
    step: int, policy: RetentionPolicy, ranks_best: Callable[[], bool], archived: bool = False
) -> str | None:
    """Whether the remote retention ``policy`` keeps a save of ``step`` beyond its
    ``keep_last``, so it is uploaded whatever the interval: :data:`ARCHIVE` (forever),
    :data:`BEST`, or None. :func:`why_due` without the interval; a restart asks it of a
    checkpoint older than the store's newest commit of the run, which the store lacks."""
    if kept_as_archive(step, archived, policy):
        return ARCHIVE
    return BEST if ranks_best() else None


def every_save_uploaded(config: CheckpointerConfig) -> str | None:
    """The warning a writer of ``config`` gives where every save of its ``every_n_steps``
    schedule is an archive point (``keep_every_n_steps`` divides ``every_n_steps``), so
    :func:`why_due` uploads each and ``remote_every_n_saves`` uploads nothing less (a run set
    up to upload every Nth save uploads every one, kept forever remotely); None otherwise."""
    k, n, e = config.remote_every_n_saves, config.keep_every_n_steps, config.every_n_steps
    if config.read_only or not k or k == 1 or not n or not e or e % n:
        return None
    if config.every_seconds is not None or config.adaptive:  # (saves at other steps too)
        return None
    return (
        f"keep_every_n_steps={n} divides every_n_steps={e}: every save is an archive point, "
        f"which the remote retention keeps forever, and is uploaded as it is saved, so "
        f"remote_every_n_saves={k} uploads nothing less than every save (until 2026-12-07 "
        f"every {k}th alone). To upload about every {k}th save, make keep_every_n_steps a "
        f"multiple of {e * k} (every_n_steps x remote_every_n_saves); to upload and keep every "
        "save, drop remote_every_n_saves"
    )


def best(
    entries: Iterable[Entry],
    policy: RetentionPolicy,
    run_id: str | None,
    corrupt: Iterable[str] = (),
) -> set[str]:
    """Of a directory's checkpoints ``entries``, the names of run ``run_id``'s that
    ``policy`` (the remote retention) keeps as its best; none without ``keep_best``.
    ``corrupt``: names a restore found corrupt (checksums; their sizes right), never counted
    (:func:`~.retention.found_corrupt`, as the retention pass counts them): a restart ranked
    the corrupt newest checkpoint it fell back from above the valid best, which stayed local."""
    if not policy.keep_best:
        return set()
    return best_names(found_corrupt(catalog.retention_candidates(entries), corrupt), policy, run_id)


def is_best(
    root: str,
    name: str,
    policy: RetentionPolicy,
    run_id: str | None,
    ranked: KnownCheckpoints | None = None,
    corrupt: Iterable[str] = (),
) -> bool:
    """Whether checkpoint ``name`` of ``root``, just committed, is one of run ``run_id``'s best
    under ``policy`` (the remote retention): uploaded whatever ``remote_every_n_saves`` says.
    ``ranked``: the directory's writer's, from its commits before; ``corrupt``: names a
    restore found corrupt, never counted (as in :func:`best`). Never raises (node-local: the
    coordinator decides for every node, which wait for its answer): a directory it cannot
    read counts it as best, said at WARNING (one upload too many is harmless; the best
    missing from the store is not).

    Its files' sizes are checked (as a retention pass checks them: one with a file missing or
    of another size is corrupt, never one of the best) only for the checkpoints ranked above
    it, best first, until ``keep_best`` are found intact. A run keeping hundreds of
    checkpoints (archive points) had every manifest looked at and every file of each checked
    at every commit, while node-local ranks waited for the answer (25 ms at 500 kept
    checkpoints of 5 files: docs/performance.md).
    """
    if not policy.keep_best:  # (no scan)
        return False
    try:
        known = ranked or KnownCheckpoints()
        candidates = found_corrupt((c for _, c in known.entries(root)), corrupt)
        return name in best_names(candidates, policy, run_id, known.valid)
    except Exception as e:
        log.warning(
            "remote: uploading %s, as it may be one of the run's best (keep_best): %s could not "
            "be read to tell (%s: %s)",
            name,
            root,
            type(e).__name__,
            e,
        )
        return True
