"""The commit of one checkpoint in node-local mode (:class:`NodeLocalSession`, the same calls as
:class:`~.session.CommitSession`); the rank contract is in :mod:`.nodelocal`'s docstring: rank 0
numbers and names the commit, every rank writes into its node's staging folder, each node's
leader commits the node's part locally, the coordinator decides and broadcasts the outcome and
hands the global manifest to the remote committer; each leader then queues its node's upload and
replicates.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from . import after_commit_work, dist, remote_best
from .commit import STAGING_PREFIX, ckpt_name, remove_checkpoint, replace_file
from .errors import CheckpointWriteError, sentence
from .filewrite import encode_json
from .manifest import FileEntry, Manifest, versions
from .node_files import REMOTE_MANIFEST, global_files, is_shared
from .nodelocal import NodeDirectory
from .session import Committed, RankReport, agree_steps
from .topology import Topology

log = logging.getLogger("resilient_callbacks")


@dataclass
class _Outcome:
    ok: bool
    seq: int
    name: str
    error: str | None = None
    ranks: tuple[int, ...] = ()
    renamed: dict[str, str] = field(default_factory=dict)
    # the coordinator's backlog decision (RemoteCommitter.drop_superseded): still to upload,
    # and dropped (never committed remotely)
    upload: list[list[Any]] | None = None
    drop: list[list[Any]] = field(default_factory=list)
    kept: list[list[Any]] = field(default_factory=list)  # remote commit given up: parts stay
    moved: list[list[Any]] = field(default_factory=list)  # [run, seq, name]: name was taken
    # the coordinator's: uploaded now (remote_every_n_saves, or an archive point or one of the
    # best: remote_best)
    due: bool = True


class NodeLocalSession:
    """The commit of one checkpoint in node-local mode (same calls as
    :class:`~.session.CommitSession`: ``begin``, ``add``, ``commit``); see the module docstring
    for which ranks do what."""

    def __init__(
        self,
        directory: NodeDirectory,
        step: int,
        *,
        run_id: str,
        group: Any = None,
        metrics: Any = None,
    ) -> None:
        self.d = directory
        # rank 0's, the same on every node (begin() broadcasts them): each node's retention
        # ranks its parts by them (keep_best), as the global manifest does
        self.metrics = metrics
        self.topo = directory.topology
        self.step = step
        self.run_id = run_id
        self.group = group
        self.files: list[FileEntry] = []
        self.staging: str | None = None
        self.seq = 0
        self.name = ckpt_name(step)
        self.token = ""  # the commit's, in every node's marks (remote_claims.commit_tag)
        self._begin_error: BaseException | None = None
        self.layout: str | None = None  # set by the caller: what agree_steps compares
        self._upload_files: list[FileEntry] = []  # (leaders) this node's part to upload
        self.after_error: str | None = None  # (leaders) this node's work after the commit

    def begin(self) -> str | None:
        """Collective: rank 0 numbers the commit and names it remotely; every rank makes its
        node's staging directory (the same name on every node) and returns it."""
        d = self.d
        if self._group_gone():  # (commit() raises why)
            return None
        msg = None
        if self.topo.rank == 0:
            name = d.committer.free_name(self.name) if d.committer else self.name
            token = uuid.uuid4().hex[:12]
            msg = {"seq": d.seq + 1, "name": name, "token": token, "metrics": self.metrics}
        msg = dist.broadcast_json(msg, group=self.group)
        self.seq, self.name, self.token = int(msg["seq"]), str(msg["name"]), str(msg["token"])
        self.metrics = msg.get("metrics")
        d.tip.planned(self.seq)  # (every rank: each node's manifest records the lineage)
        self.staging = os.path.join(
            d.dirpath, f"{STAGING_PREFIX}{ckpt_name(self.step)}-{msg['token']}"
        )
        try:
            os.makedirs(self.staging, exist_ok=True)
        except OSError as e:
            self._begin_error = e
            return None
        return self.staging

    def _group_gone(self) -> bool:
        """The process group was destroyed: its collectives are no-ops, each rank alone."""
        return dist.group_size(self.group) != self.topo.world_size

    def add(self, files: list[FileEntry]) -> None:
        self.files.extend(files)

    def _manifest(self, files: list[FileEntry], metrics: Any, reason: str, fp: str, extra: Any):
        return Manifest(
            step=self.step,
            run_id=self.run_id,
            seq=self.seq,
            world_size=self.topo.world_size,
            files=files,
            metrics=dict(metrics or {}),
            reason=reason,
            fingerprint=fp,
            retention=self.d.retention.to_json(),
            remote_retention=self.d.config.remote_retention_policy().to_json(),
            versions=versions(),
            extra=dict(extra or {}),
            lineage=self.d.tip.child(self.seq).to_json(),
        )

    def commit(
        self,
        error: BaseException | None = None,
        *,
        metrics: Any = None,
        reason: str = "forced",
        fingerprint: str = "",
        extra: Any = None,
    ) -> Committed:
        """Collective: gather to the leaders, commit each node locally, gather to the
        coordinator, broadcast the outcome; raise :class:`CheckpointWriteError` on every rank
        if any rank or node failed (nothing stays committed then). ``metrics``: rank 0's
        given to the constructor win (every node's part records the same, as they were an
        unreduced loss of each rank: node 1 kept another best than node 0)."""
        d, topo = self.d, self.topo
        if self._group_gone():
            if topo.is_leader and self.staging is not None:  # (each rank alone would commit
                d.commit.abort(self.staging)  # its node's part, rank 1 as the coordinator)
            raise CheckpointWriteError(
                f"checkpoint for step {self.step} was not committed; failed on rank(s) "
                f"{topo.rank}: only this one of its {topo.world_size} ranks could report: the "
                "process group was destroyed before the save finished (close() the "
                "Checkpointer, which waits for its saves, before destroy_process_group). "
                "Nothing was committed and older checkpoints on every node are intact.",
                (topo.rank,),
            )
        metrics = self.metrics if self.metrics is not None else metrics
        error = error or self._begin_error
        report = RankReport(
            topo.rank,
            self.files if error is None else [],
            None if error is None else f"{type(error).__name__}: {error}",
            self.step,
            self.layout,
        )
        node_reports = dist.gather_json(report.to_json(), dst=topo.leader, group=topo.node_group)
        node_msg: dict[str, Any] = {}
        local_path = None
        if node_reports is not None:  # this node's leader
            reps = [RankReport.from_json(x) for x in node_reports]
            agree_steps(reps)  # (within the node)
            failed = [r for r in reps if r.error]
            files = [f for r in reps for f in r.files]
            node_msg = {"failed": [[r.rank, r.error] for r in failed], "files": None}
            if not failed:
                try:
                    node_extra = dict(extra or {})
                    node_extra["node"] = {
                        "ranks": list(topo.node_ranks),
                        "nodes": len(topo.nodes),
                        "remote_name": self.name,
                        "token": self.token,
                    }
                    m = self._manifest(files, metrics, reason, fingerprint, node_extra)
                    # this node's uploads (never other ranks' copies of the shared files): from
                    # what the manifest lists, now (a failure here is the node's, reported
                    # below; read back from the disk after the outcome, a manifest gone raised
                    # on this leader only and its peer waited in the replica exchange)
                    self._upload_files = [
                        f for f in m.files if not (is_shared(f.path) and f.rank != 0)
                    ]
                    assert self.staging is not None
                    data = encode_json(m.to_json())
                    local_path = d.commit.commit(self.staging, self.step, data, latest=True)
                    node_msg["files"] = [f.__dict__ for f in files]
                    node_msg["path"] = os.path.basename(local_path)
                except Exception as e:
                    node_msg["failed"] = [[topo.rank, f"local commit: {type(e).__name__}: {e}"]]
            if local_path is None and self.staging is not None:
                d.commit.abort(self.staging)
            node_msg["uploads"] = d.uploader.take_reports() if d.uploader else []
        gathered = None
        if topo.is_leader:
            gathered = dist.gather_json(node_msg, dst=0, group=topo.leaders_group)
        outcome = None
        if gathered is not None:  # the coordinator
            # (no try: an exception here would leave every other rank waiting in the broadcast,
            # but none reaches it from outside this process. Its one IO, the global manifest
            # beside node 0's part, catches OSError; the rest is the committer's in-memory
            # bookkeeping and this manifest, whose metrics and extra this rank encoded already
            # in its node's manifest above: were they not JSON, that commit failed and
            # _decide returns the failure before encoding them again.)
            outcome = self._decide(gathered, metrics, reason, fingerprint, extra, local_path)
        out = _Outcome(**dist.broadcast_json(outcome, group=self.group))
        out.ranks = tuple(out.ranks)
        if not out.ok:
            if local_path is not None:
                with contextlib.suppress(OSError):
                    remove_checkpoint(local_path)
            raise CheckpointWriteError(
                sentence(
                    f"checkpoint for step {self.step} was not committed; failed on rank(s) "
                    f"{', '.join(map(str, out.ranks))}: {out.error}"
                )
                + " Nothing was committed and older checkpoints on every node are intact.",
                out.ranks,
            )
        d.committed(out.seq)  # (the local copy of the one restored from: no longer protected)
        local_name = out.renamed.get(str(topo.node), ckpt_name(self.step))
        path = local_path or os.path.join(d.dirpath, local_name)
        if topo.is_leader and d.uploader is not None and out.upload is not None:
            d.uploader.settle(
                [(str(k[0]), int(k[1])) for k in out.upload],
                [(str(k[0]), int(k[1])) for k in out.drop],
                [(str(k[0]), int(k[1])) for k in out.kept],
                {(str(k[0]), int(k[1])): str(k[2]) for k in out.moved},
            )
        if topo.is_leader and local_path is not None:
            self._after_local_commit(local_path, out.due)
        return Committed(path, self.step, out.seq, sum(f.size for f in self.files))

    def _decide(
        self,
        gathered: list[dict[str, Any]],
        metrics: Any,
        reason: str,
        fingerprint: str,
        extra: Any,
        local_path: str | None,
    ) -> dict[str, Any]:
        """Coordinator: the outcome from every node's result; the global manifest of a
        committed checkpoint goes to the remote committer (and next to node 0's copy)."""
        d = self.d
        failed = [tuple(x) for g in gathered for x in g.get("failed") or []]
        for node, g in enumerate(gathered):  # upload reports of earlier checkpoints
            for rep in g.get("uploads") or []:
                if d.committer is not None:
                    d.committer.report(node, rep)
        if failed:
            return {
                "ok": False,
                "seq": self.seq,
                "name": self.name,
                "error": "; ".join(f"rank {r}: {e}" for r, e in failed),
                "ranks": sorted({int(r) for r, _ in failed}),
            }
        renamed = {
            str(i): g["path"] for i, g in enumerate(gathered) if g["path"] != ckpt_name(self.step)
        }
        files = global_files([FileEntry(**f) for g in gathered for f in g["files"]])
        gextra = dict(extra or {})
        gextra["nodes"] = [list(x) for x in self.topo.nodes]
        m = self._manifest(files, metrics, reason, fingerprint, gextra)
        data = encode_json(m.to_json())
        if local_path is not None:
            try:
                # atomic and durable: a restart's remote commit of this checkpoint reads it
                replace_file(os.path.join(local_path, REMOTE_MANIFEST), data)
            except OSError as e:
                log.warning(  # (the coordinator's node: its leader says it, naming it)
                    "node %d: could not keep the global manifest next to its part %s: %s",
                    self.topo.node,
                    local_path,
                    e,
                )
        if d.committer is not None:
            committer, key, name = d.committer, (self.run_id, self.seq), self.name
            here = os.path.basename(local_path) if local_path is not None else None
            tag = self.token
            # (an archive point or one of the best: uploaded too, on every node)
            interval, policy = d.config.remote_due(self.seq, reason), committer.policy
            ranks = functools.partial(d.is_best, here, policy) if here else (lambda: False)
            due = remote_best.why_due(interval, self.step, policy, ranks) is not None
            if due:
                d.hold_upload(self.step, None)
                committer.expect(key, name, data, here, tag)
            else:
                expect = functools.partial(committer.expect, key, name, data, here, tag)
                d.hold_upload(self.step, expect, here or name)
            upload, drop = committer.drop_superseded()  # uploads behind the saves
            return {
                "ok": True,
                "seq": self.seq,
                "name": self.name,
                "renamed": renamed,
                "upload": [list(k) for k in upload],
                "drop": [list(k) for k in drop],
                "kept": [list(k) for k in committer.abandoned_keys()],
                "moved": [[*k, n] for k, n in committer.take_moved().items()],
                "due": due,
            }
        return {"ok": True, "seq": self.seq, "name": self.name, "renamed": renamed}

    def _after_local_commit(self, local_path: str, due: bool) -> None:
        """Leader: queue this node's part for upload (if ``due``, as the coordinator decided
        for every node), replicate, apply retention. The
        checkpoint is committed on every node by now, and every other rank returns it as
        committed: a failure of the upload queue or the retention pass (or of both: the pass
        runs after a queueing that failed) is said by this leader (naming its node, what
        failed and what that leaves undone: :mod:`.after_commit_work`)
        and kept as :attr:`after_error`, never raised (raised on this rank alone, the save was
        told as uncommitted and recorded as failed, and its peers waited in a later
        collective)."""
        d = self.d
        name = os.path.basename(local_path)
        key = f"{d.dirpath} node {self.topo.node}"
        error: Exception | None = None
        try:
            if d.uploader is not None:
                uploader, ukey, remote_name = d.uploader, (self.run_id, self.seq), self.name
                tag, mine = self.token, self._upload_files

                def upload() -> None:
                    try:
                        uploader.enqueue(name, remote_name, ukey, mine, tag)
                    except Exception as e:  # (why the coordinator's close finds it missing)
                        why = f"queueing its upload failed: {type(e).__name__}: {e}"
                        uploader.skipped[remote_name] = why
                        raise

                if due:
                    d.hold_upload(self.step, None)
                    upload()
                else:
                    d.hold_upload(self.step, upload, name)
        except Exception as e:  # (the message says the upload is not queued: it raised)
            error = after_commit_work.UploadNotQueued(name)
            error.__cause__ = e
        if d.config.replicas:  # (every leader, whatever failed: its peers' ends wait for it)
            self._replicate(local_path)  # (says its own failures)
        retained, also = True, None
        try:
            d.apply_retention(protect=name)
        except Exception as e:  # (after a queueing that failed: both are named)
            retained, also = False, e if error is not None else None
            error = error or e
        if error is None:
            after_commit_work.succeeded(key, d.said)
        else:
            where, who = f"{local_path}, on every node", f"node {self.topo.node}"
            self.after_error = after_commit_work.failed(
                key, error, self.step, where, who, d.uploader, said=d.said, retained=retained,
                also=also,
            )  # fmt: skip

    def _replicate(self, local_path: str) -> None:
        """Leader: send this node's files to the next node, keep the previous node's."""
        from . import peers

        topo = self.topo
        pred = topo.predecessor(topo.node)
        root = peers.replica_root(self.d.dirpath, Topology.label(topo.nodes[pred]))
        group = self.group if self.group is not None else topo.cpu_group
        try:
            peers.exchange(
                local_path,
                topo.nodes[topo.successor(topo.node)][0],
                topo.nodes[pred][0],
                root,
                group,
            )
            peers.prune(root, keep=max(2, self.d.config.keep_last or 2))
        except Exception as e:  # the local and remote tiers still hold the checkpoint
            # (both ends raise: the leader of the node whose end failed says it, naming its
            # node; the other end logs it at INFO)
            mine = topo.rank in getattr(e, "failed_ranks", (topo.rank,))
            (log.warning if mine else log.info)(
                "node %d: replicating %s to or from its peer nodes failed: %s",
                topo.node,
                os.path.basename(local_path),
                e,
            )
