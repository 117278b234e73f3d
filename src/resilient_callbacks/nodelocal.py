"""Node-local mode: ``dirpath`` on each node's own disk, no filesystem shared between nodes.

Which ranks share a disk is detected at construction (:func:`.topology.detect`). This module
holds the node's directory (:class:`NodeDirectory`, opened by
:func:`.directory_open.open_directory`); which files of a checkpoint a node holds and needs is
:mod:`.node_files`, the commit of one checkpoint :class:`.node_session.NodeLocalSession`, the
restore :mod:`.node_restore` (the uploads it queues again: :mod:`.node_recovery`), the uploads
and the remote commit :mod:`.remote_commit`, the replicas :mod:`.peers`.

Which ranks call what in node-local mode (the rank contract of :mod:`.session` still holds for
every call below; *leader* = the lowest rank of a node, *coordinator* = rank 0):

- open (:class:`NodeDirectory`): each leader makes, locks and sweeps its node's ``dirpath`` and
  connects to the remote tier (:func:`.remote_open.preflight`: a store it cannot reach is a warning
  where its disk holds checkpoints; a failure on any node raises on every rank); the
  coordinator also owns the remote committer.
- save (:class:`NodeLocalSession`): rank 0 broadcasts the commit number, the remote name and a
  staging token; every rank writes its files into its node's staging directory (each leader also
  writes the replicated ``shared.*`` files, as rank 0 does); the reports are gathered to each
  leader (node group), each leader commits its node's part locally (a manifest listing the
  node's files, written last, then rename); the leaders' results and the uploads they finished
  since the last save are gathered to the coordinator (leaders group), which broadcasts the
  outcome. A failure on any rank: nothing stays committed on any node, every rank raises.
- after the local commit each leader uploads its node's files in the background
  (:class:`~.remote_commit.NodeUploader`); the coordinator writes the remote manifest once every
  node reported its part uploaded and verified (:class:`~.remote_commit.RemoteCommitter`), from
  the reports that ride on the next save's gather (or close's): training never waits for it.
- close (:meth:`NodeDirectory.finish_nodes`): each leader waits for its uploads, the reports
  are gathered to the coordinator (leaders group), which waits for its remote commits (at most
  half the process group's timeout) and broadcasts which checkpoints are not settled remotely
  (leaders group): each node stops holding its uploaded parts of the others.
- ``replicas=1``: each leader also sends its node's committed files to the next node's leader,
  which keeps them under ``.replicas/`` (:mod:`.peers`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import catalog, dist
from .commit import open_dir, sweep_staging
from .directory import Directory
from .errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointWriteError,
    RemoteUnavailableError,
)
from .lock import COMMAND_WAIT_S, claim_remote
from .manifest import Manifest
from .redact import command
from .remote_open import open_listing, preflight
from .repeats import again, reason
from .retention_pass import apply_retention
from .sync import SyncStatus
from .topology import Topology

if TYPE_CHECKING:
    from .config import CheckpointerConfig
    from .node_upload import NodeUploader
    from .remote_commit import PendingCommit, RemoteCommitter
    from .retention import RetentionPolicy

log = logging.getLogger("resilient_callbacks")
# a leader's errors at open that every rank raises as that class, not as CheckpointWriteError
_OPEN_ERRORS: dict[type[CheckpointError], str] = {
    RemoteUnavailableError: "unreachable",
    CheckpointLockedError: "locked",
}


class NodeDirectory(Directory):
    """The node's ``dirpath`` as its leader sees it, and (coordinator) the remote commit. See the
    module docstring for the rank contract."""

    def __init__(
        self,
        dirpath: str,
        retention: RetentionPolicy,
        world_size: int,
        topology: Topology,
        config: CheckpointerConfig,
    ) -> None:
        super().__init__(dirpath, retention, world_size)
        self.topology = topology
        self.config = config
        self.is_coordinator = topology.is_leader  # of this node's directory
        self.uploader: NodeUploader | None = None
        self.committer: RemoteCommitter | None = None
        self.nodes_left: dict[int, dict[str, str]] = {}  # coordinator: NodeUploader.left()

    def open(self, config: CheckpointerConfig) -> None:
        """Every rank: each leader opens its node's directory and connects to the remote tier;
        every rank learns the first failure, and the commit number every tier is past."""
        error, seq, why = None, 0, ""
        if self.topology.is_leader:
            try:
                self._open_leader(config)
                seq = self.seq
            except (CheckpointError, OSError) as e:
                error = f"{type(e).__name__} on rank {self.topology.rank}: {e}"
                why = next((w for k, w in _OPEN_ERRORS.items() if isinstance(e, k)), "")
                self.release()
        results = dist.all_gather_json([error, seq, why])
        errors = [e for e, _, _ in results if e]
        if errors:
            self.release()
            # as in shared mode, on every rank: the remote's preflight failing is
            # RemoteUnavailableError (a ConnectionError a launcher may retry on); another
            # writer of this process holding the directory or the remote, CheckpointLockedError
            whys = {w for *_, w in results}
            kind = next((k for k, w in _OPEN_ERRORS.items() if w in whys), CheckpointWriteError)
            raise kind(
                f"node-local checkpoint directory {self.dirpath} could not be opened: "
                + "; ".join(errors)
            )
        self.seq = max(s for _, s, _ in results)

    def _open_leader(self, config: CheckpointerConfig) -> None:
        from .remote import RemoteStore
        from .remote_commit import NodeUploader, RemoteCommitter

        open_dir(self.dirpath)  # (its name durable: a power loss keeps what it holds)
        # (the other ranks wait in open()'s all-gather meanwhile)
        self.lock.acquire(wait_s=dist.wait_before_collective(COMMAND_WAIT_S))
        sweep_staging(self.dirpath)  # (logs what it removed)
        self.seq = catalog.next_seq(self.dirpath) - 1
        assert config.remote is not None
        self.remote = RemoteStore(config.remote, config.remote_options)
        # one writer per store in this process, as in shared mode (two writers of one prefix
        # upload over each other's checkpoints, and each one's retention deletes the other's)
        st = self.remote
        claim_remote(st.key, st.url, self.lock)
        # as in shared mode: a store that cannot be reached while this node's disk holds
        # checkpoints is a warning (the restore falls back to the disks, loudly); otherwise
        # raised, and open() makes every rank raise it (a node with an empty disk cannot go on)
        reachable = preflight(st, config.remote_timeout, self.dirpath, self.topology.node)
        self.uploader = NodeUploader(
            self.remote,
            self.dirpath,
            self.topology.node,
            on_uploaded=lambda: self.retention_or_say("after an upload"),
        )
        if self.topology.rank == 0:
            self.committer = RemoteCommitter(
                self.remote,
                len(self.topology.nodes),
                config.remote_retention_policy(),
                held=self.restored_copy,
                writer=self.dirpath,
                on_committed=self._record_commit,
            )
            if reachable:  # (else the restore lists the remote, if it answers by then)
                listed = open_listing(self.committer.refresh_max_seq, st.url, self.dirpath)
                self.seq = max(self.seq, listed)

    def _record_commit(self, p: PendingCommit) -> None:
        """The committer, after each remote commit: an ``upload`` record in the coordinator's
        history (its commit number: a restart uploads an archive point the store lacks only
        where none records it, :mod:`.node_recovery`; the report's upload lag)."""
        m = Manifest.from_json(json.loads(p.manifest), p.name)
        lag = max(0.0, time.time() - m.created)
        self.record(
            "upload", m.step, sync=False, name=p.local or p.name, seq=m.seq,
            bytes=m.total_bytes, lag_s=round(lag, 3),
        )  # fmt: skip

    def after_commit_worker(self) -> tuple[str, Any]:
        return f"node {self.topology.node}", self.uploader

    def release(self) -> None:
        if self.uploader is not None:
            self.uploader.stop()
        if self.committer is not None:
            self.committer.stop()
        self.lock.release()

    def apply_retention(self, protect: str | None, policy: RetentionPolicy | None = None) -> None:
        """Leader: the local retention of this node's directory (``policy``: another one); a
        checkpoint whose part this node has not uploaded yet is kept, and on the coordinator's
        node one not committed remotely yet; so is the one restored from, until the first
        commit (:meth:`~.directory.Directory.protected`)."""
        if not self.topology.is_leader:
            return
        with self._retention_lock:
            protected = self.protected(protect)
            if protect:  # (just committed: maybe with the name and inode of one deleted)
                self.known.forget(protect)
            if self.uploader is not None:
                protected += self.uploader.held()
            if self.committer is not None:
                protected += self.committer.held_locally()
            apply_retention(
                self.dirpath,
                policy or self.retention,
                self.run_id,
                protected,
                blobs=self.blobs,  # (those a restore of an incremental checkpoint fetched)
                discard=self.trash.put,
                corrupt=self.found_corrupt,
                known=self.known,
                said=self.said,
            )

    def retention_or_say(self, when: str) -> None:
        """Leader: :meth:`apply_retention` after an upload or at close, whose failure (a
        directory it cannot list) must fail neither the upload nor close(): every checkpoint
        is committed and, once uploaded, counted so; an ERROR names what it did not delete
        and how to delete it. (A checkpoint it cannot delete is named by the pass itself.)"""
        key = f"retention pass {self.dirpath}"
        try:
            self.apply_retention(None)
        except Exception as e:
            n = self.said.due(key, reason(e))  # (after every upload: said once, not each time)
            if n is None:
                return
            log.error(
                "node %d: the retention pass of %s %s failed: %s: %s. Every checkpoint stays "
                "committed (and uploaded, once its upload ends); the older ones that "
                "keep_last=%s would delete stay in %s. Fix the cause, then delete them by "
                "hand once the job ended: %s deletes what the retention does not keep (or "
                "the next save's, or the next run's, retention pass does)%s",
                self.topology.node,
                self.dirpath,
                when,
                type(e).__name__,
                e,
                self.retention.keep_last,
                self.dirpath,
                command("gc", self.dirpath),
                again(n),
            )
        else:
            self.said.cleared(key)

    def exchange_reports(self, group_fallback: Any = None) -> None:
        """Leaders (a collective on the leaders group): the uploads each node finished reach
        the coordinator, which commits the checkpoints every node has uploaded."""
        if not self.topology.is_leader:
            return
        u = self.uploader
        mine = [u.take_reports(), u.left()] if u is not None else [[], {}]
        got = dist.gather_json(mine, dst=0, group=self.topology.leaders_group)
        if got is not None and self.committer is not None:
            for node, (reports, left) in enumerate(got):
                for rep in reports:
                    self.committer.report(node, rep)
                self.nodes_left[node] = left  # (why a part of it is not uploaded, at close)

    def upload_status(self) -> SyncStatus | None:
        """This node's uploads (its leader; None on the other ranks), as ``remote_status()``
        gives them in shared mode."""
        u = self.uploader
        if u is None:
            return None
        pending, c = u.pending(), u.counters
        return SyncStatus(
            pending=pending,
            uploading=pending[0] if pending else None,
            failures=u.failures_in_a_row,
            last_error=c.last_error,
            uploaded=c.checkpoints,
            uploaded_bytes=c.bytes,
            upload_seconds=c.seconds,
            stalled_s=u.stalled_s(),
            stall_allowance_s=u._allowance_s(),
        )

    def finish_nodes(
        self,
        timeout: float | None,
        outage_s: float | None = None,
        grace_left: Callable[[], float | None] | None = None,
    ) -> list[str]:
        """close(), every rank: each leader waits for its uploads (up to ``timeout``; without
        one, until they have failed for ``outage_s`` in a row), the last reports reach the
        coordinator, which waits for the remote commits (as long, and no longer once they have
        failed or hung for ``outage_s``); a preemption arriving meanwhile bounds both waits by
        its grace period (``grace_left``). The coordinator answers the other leaders, waiting
        in an exchange meanwhile, once its commits settled or after half the process group's
        timeout (:meth:`_release_settled`), then goes on waiting. Each wait is announced;
        what is left stays local, named, and is returned (close() raises
        :class:`~.errors.UploadIncompleteError` for it): on the coordinator, every checkpoint
        not committed remotely but one older than a committed one of its run (a damaged
        part, dropped); on another leader, those whose part of this node did not
        upload; on any other rank nothing (it knows nothing of the uploads)."""
        if not self.topology.is_leader:
            return []
        t0, local_only = time.monotonic(), set[str]()
        u = self.uploader
        if u is not None and u.pending():
            log.warning(  # (each node's leader says its own: naming the node)
                "close(): waiting for node %d's part of %s to upload to %s%s",
                self.topology.node,
                ", ".join(u.pending()),
                u.store.url,
                "" if timeout is None else f" (at most {timeout:.0f} s)",
            )
        if u is not None and not u.wait(timeout, outage_s, grace_left):
            local_only.update(u.pending())
            log.warning(
                "close(): node %d's part of %s is not uploaded yet (last error: %s); it stays "
                "local in %s, and the next run with the same directories uploads it",
                self.topology.node,
                ", ".join(sorted(u.pending())),
                u.counters.last_error or "none: still uploading",
                self.dirpath,
            )
        self.exchange_reports()
        self._move_taken(timeout, outage_s, grace_left)
        c = self.committer
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        if c is not None and c.ready():
            log.warning(
                "close(): waiting for the remote commit of %s (every node's part is uploaded)",
                ", ".join(c.ready()),
            )
        if c is not None:  # the other leaders wait in the exchange below meanwhile
            first = dist.wait_before_collective(math.inf if left is None else left)
            c.wait(None if math.isinf(first) else first, outage_s, grace_left)
        self._release_settled()
        if c is None:
            self.retention_or_say("at close")  # the parts kept for their remote commit may go
            return sorted(local_only)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        if not c.wait(left, outage_s, grace_left):
            stuck = c.ready()
            missing = [n for n in c.waiting() if n not in stuck]
            local_only.update(stuck + [n for n in missing if n not in c.superseded()])
            if stuck:
                log.warning(
                    "close(): not committed remotely (the store has not answered the remote "
                    "commit for %.0f s, last error: %s; the nodes' disks hold them, and a later "
                    "run with the same directories commits them): %s",
                    c.stuck_s(),
                    c.last_error or "none: the attempt under way has not returned",
                    ", ".join(stuck),
                )
            if missing:
                from .close_uploads import missing_parts

                log.warning("close(): not committed remotely: %s", missing_parts(self, missing))
        self.retention_or_say("at close")  # the copies kept for their remote commit may go
        if c.abandoned:
            log.warning(
                "close(): not committed remotely (the remote commit failed; the nodes' "
                "disks hold them, and a later run with the same directories commits "
                "them): %s",
                ", ".join(c.abandoned),
            )
        return sorted(local_only.union(c.given_up()))  # (not one a newer commit superseded)

    def _move_taken(self, timeout: Any, outage_s: Any, grace_left: Any) -> None:
        """close(), leaders (a collective on the leaders group): the checkpoints whose name a
        node found another writer's in the last reports (no save follows to say it) go under
        the coordinator's new name: each node uploads its part there, and reports it."""
        moved = self.committer.take_moved() if self.committer is not None else None
        got = dist.broadcast_json(
            None if moved is None else [[*k, n] for k, n in moved.items()],
            group=self.topology.leaders_group,
        )
        if not got or self.uploader is None:
            return
        self.uploader.move({(str(k[0]), int(k[1])): str(k[2]) for k in got})
        self.uploader.wait(timeout, outage_s, grace_left)
        self.exchange_reports()

    def _release_settled(self) -> None:
        """close(), leaders (a collective on the leaders group): the coordinator says which
        checkpoints are not settled remotely (neither committed nor dropped); each node stops
        holding its uploaded parts of the others (the last save's outcome could not say it).
        A failed exchange (a node gone) keeps every other node's parts: the next run decides.
        """
        mine = self.committer.unsettled() if self.committer is not None else None
        got: Any = None if mine is None else [list(k) for k in mine]
        try:
            got = dist.broadcast_json(got, group=self.topology.leaders_group)
        except Exception as e:
            if not dist.from_collective(e):
                raise
            log.warning(  # (each leader whose exchange failed says it, naming its node)
                "close(): node %d could not learn which checkpoints are committed remotely "
                "(%s); it keeps its parts of this run's checkpoints that it uploaded, and "
                "the next run with the same directories decides",
                self.topology.node,
                dist.failed_exchange(e),
            )
        if self.uploader is not None and got is not None:
            self.uploader.release([(str(k[0]), int(k[1])) for k in got])

    def recover_uploads(self, remote_keys: set[tuple[str, int]] | None) -> None:
        """After a restore, leaders: queue the uploads a crash cut off (see
        :func:`.node_recovery.recover_uploads`)."""
        from .node_recovery import recover_uploads

        recover_uploads(self, remote_keys)
