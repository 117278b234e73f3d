"""Uploads a close gives up on: a directory's close without a Checkpointer, and the error that
names the checkpoints that never reached the remote.

:func:`close_directory` closes a directory opened without a Checkpointer (the DCP writer's):
it waits for the uploads and retention's deletions, then releases the directory.
:func:`not_uploaded_error` is the :class:`~.errors.UploadIncompleteError` of a close that gave
up on uploads during an outage of the store (``Checkpointer.close`` through :mod:`.closing`, and
:func:`close_directory`); in node-local mode it says what each node still holds. Which ranks
call what: the coordinator (the rank that opened the directory, the only one with a remote
tier) calls both; in node-local mode also each node's leader, for its node's parts. Moved from
``closing.py``, which re-exports ``close_directory``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import UploadIncompleteError
from .nodelocal import NodeDirectory
from .preemption import pending
from .redact import push_command
from .upload_thread import EXIT_MARGIN_S
from .upload_wait import finish_uploads

if TYPE_CHECKING:
    from .directory import Directory
    from .preemption import PreemptionWatcher

__all__ = ["close_directory", "not_uploaded_error"]


def close_directory(d: Directory, outage_s: float, watcher: PreemptionWatcher | None) -> None:
    """Close a directory opened without a Checkpointer (the DCP writer's): wait for its
    uploads and for retention's deletions, then release it. As ``Checkpointer.close``: the
    uploads are given up after ``outage_s`` of an outage, and :class:`UploadIncompleteError`
    names them, unless the process is being preempted (a request pending on ``watcher`` or on
    any watcher installed in this process, also one arriving meanwhile): then both waits end
    :data:`EXIT_MARGIN_S` before its grace period does, and what is left stays local, said
    in a warning. Coordinator only (the rank that opened ``d``)."""
    left: list[str] = []
    try:
        if d.sync is not None:
            left = finish_uploads(d, None, outage_s, lambda: pending.remaining_grace_s(watcher))
        grace = pending.remaining_grace_s(watcher)
        d.trash.wait(None if grace is None else max(0.0, grace - EXIT_MARGIN_S))
    finally:
        d.release()
    if left and not pending.requests(watcher):
        raise not_uploaded_error(d, left, outage_s)


def not_uploaded_error(d: Directory, pending: list[str], outage_s: float) -> UploadIncompleteError:
    """The error of a close that gave up on ``pending``'s uploads during an outage of the store
    (``Checkpointer.close``, the DCP writer's; node-local mode: :func:`_nodes_error`)."""
    if isinstance(d, NodeDirectory):
        return _nodes_error(d, pending, outage_s)
    assert d.sync is not None and d.remote is not None
    url = d.remote.url
    error = d.sync.status().last_error or f"no byte moved for {outage_s:g} s"
    return UploadIncompleteError(
        f"close(): {len(pending)} checkpoint(s) never reached {url}: {', '.join(pending)}. The "
        f"store failed or stopped answering for more than {outage_s:g} s (last error: "
        f"{error}), so close() gave up on them. They are committed and kept in {d.dirpath}; "
        f"upload them with {push_command(d.dirpath, url, d.remote.options)} once the store "
        "answers (a run resumed with the same dirpath and remote uploads them too). Raised so "
        "that the job does not end as a success with its newest checkpoints on this machine's "
        "disk only",
        tuple(pending),
        d.dirpath,
        url,
    )


def _nodes_error(d: NodeDirectory, pending: list[str], outage_s: float) -> UploadIncompleteError:
    """Node-local mode's: raised by the coordinator for every checkpoint not committed remotely,
    by another node's leader for those whose part of its node did not upload
    (:meth:`NodeDirectory.finish_nodes`). No ``push`` can help: the parts lie on several nodes'
    disks, and only a run started again with the same directories uploads and commits them."""
    assert d.remote is not None
    url = d.remote.url
    c, u = d.committer, d.uploader
    error = (c.last_error if c is not None else None) or (u.counters.last_error if u else None)
    what = f"{len(pending)} checkpoint(s) never committed remotely at"
    if c is None:
        what = f"node {d.topology.node}'s part of {len(pending)} checkpoint(s) never reached"
    given = [n for n in c.given_up() if n in pending] if c is not None else []
    # (the store may have answered every request: say whose part did not come)
    missing = [n for n in c.missing() if n in pending] if c is not None else []
    rest = [n for n in pending if n not in given and n not in missing]
    clauses = []
    if rest:
        of = f" ({', '.join(rest)})" if given or missing else ""
        clauses.append(
            f"the store failed or stopped answering for more than {outage_s:g} s{of} (last "
            f"error: {error or f'no byte moved for {outage_s:g} s'})"
        )
    if c is not None and given:  # (attempts that fail in seconds: no outage was waited out)
        # (each one's own error: a commit that succeeded since cleared the committer's last)
        last = c.abandoned_why.get(given[-1]) or error
        clauses.append(
            f"the remote commit of {', '.join(given)} failed {c.max_attempts} time(s), given "
            f"up (last error: {last})"
        )
    if missing:  # (named one by one: beside the others' reasons, "their" named none)
        clauses.append(f"not every node's part arrived: {missing_parts(d, missing)}")
    why = "; ".join(clauses)
    why = why[:1].upper() + why[1:]
    return UploadIncompleteError(
        f"close(): {what} {url}: "
        f"{', '.join(pending)}. {why}, so close() "
        f"gave up on them. Each node's part is committed and kept on its disk ({d.dirpath} "
        "here); run the job again with the same directories and remote once the store answers: "
        "its leaders upload the parts and its coordinator commits them. Raised so that the job "
        "does not end as a success with its newest checkpoints on the nodes' disks only",
        tuple(pending),
        d.dirpath,
        url,
    )


def missing_parts(d: NodeDirectory, names: list[str]) -> str:
    """The coordinator, at close: which node's part of each of ``names`` (checkpoints waiting
    for their parts) never arrived, and why, as that node's leader said in its last report
    (:meth:`~.node_upload.NodeUploader.left`)."""
    assert d.committer is not None
    missing, said = d.committer.missing(), []
    for name in names:
        for node in missing.get(name, []):
            why = d.nodes_left.get(node, {}).get(name) or (
                "that node's leader never reported it uploaded (see its log)"
                if node in d.nodes_left
                else "that node's leader sent no last report"
            )
            said.append(f"node {node}'s part of {name} never arrived: {why}")
    return "; ".join(said) or "a node's part is missing: " + ", ".join(names)
