"""The best checkpoints reach the remote tier, whatever ``remote_every_n_saves`` says.

With ``remote_every_n_saves=N`` only every Nth commit is uploaded; the remote retention keeps
the ``remote_keep_best`` (by default ``keep_best``) best of what it was given. A best
checkpoint that was not an Nth save lay on the local disk only (in node-local mode lost with a
node), and the remote kept the best of the others. So a save that is one of the best the
remote retention keeps, among the run's checkpoints in the directory as it is committed, is
uploaded as well (a later, better save makes it an ordinary one that the remote retention
deletes). The test is :func:`~.retention.best_names` under the remote policy over the local
checkpoints: the local tier keeps its ``keep_best`` best too with such an interval
(:meth:`~.config.CheckpointerConfig.local_retention_policy`), so none of the run's best is missed;
where ``remote_keep_best`` is larger, one ranked below them may be uploaded needlessly (the
remote retention deletes it), never one of them skipped.

The same test at a restart (:mod:`.node_recovery`, :func:`~.restore_remote.reconcile_uploads`)
makes a best checkpoint the store lacks due, as an archive point (one the run's history records
as uploaded was deleted from the store on purpose since: not uploaded again).

Which ranks call what: the coordinator at each commit (shared mode: the one writer; node-local
mode: rank 0, on its node's directory, broadcasting the decision with the commit's outcome so
every node uploads its part or none does); each leader at a restart, on its own directory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from . import catalog
from .catalog import Depth, Entry
from .retention import RetentionPolicy, best_names

log = logging.getLogger("resilient_callbacks")


def best(entries: Iterable[Entry], policy: RetentionPolicy, run_id: str | None) -> set[str]:
    """Of a directory's checkpoints ``entries``, the names of run ``run_id``'s that
    ``policy`` (the remote retention) keeps as its best; none without ``keep_best``."""
    if not policy.keep_best:
        return set()
    return best_names(catalog.retention_candidates(entries), policy, run_id)


def is_best(
    root: str,
    name: str,
    policy: RetentionPolicy,
    run_id: str | None,
    manifests: catalog.ManifestCache | None = None,
) -> bool:
    """Whether checkpoint ``name`` of ``root``, just committed, is one of run ``run_id``'s best
    under ``policy`` (the remote retention): uploaded whatever ``remote_every_n_saves`` says.
    ``manifests``: those the directory's writer parsed before. Never raises (node-local: the
    coordinator decides for every node, which wait for its answer): a directory it cannot
    read counts it as best, said at WARNING (one upload too many is harmless; the best
    missing from the store is not)."""
    if not policy.keep_best:  # (no scan)
        return False
    try:
        return name in best(catalog.scan(root, Depth.SIZE, manifests), policy, run_id)
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
