"""Node-local mode: ``dirpath`` on each node's own disk, no filesystem shared between nodes.

Detection (:func:`detect`, at construction, every rank): each rank writes a probe file named
after a token rank 0 chose; after a barrier every rank lists ``dirpath`` and learns which ranks'
probes it sees. The ranks that see each other's probes share a disk: a *node* (a storage domain).
One node holding every rank is the shared mode of before (nothing changes); several nodes are
node-local mode. ``shared_dirpath=True`` skips the probe, ``False`` requires node-local disks.

Which ranks call what in node-local mode (the rank contract of :mod:`.session` still holds for
every call below; *leader* = the lowest rank of a node, *coordinator* = rank 0):

- open (:class:`NodeDirectory`): each leader makes, locks and sweeps its node's ``dirpath`` and
  connects to the remote tier (preflight); the coordinator also owns the remote committer.
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
- ``replicas=1``: each leader also sends its node's committed files to the next node's leader,
  which keeps them under ``.replicas/`` (:mod:`.peers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import catalog, dist
from .commit import STAGING_PREFIX, ckpt_name, remove_checkpoint, sweep_staging
from .directory import Directory, apply_retention
from .errors import CheckpointError, CheckpointWriteError, ConfigError
from .manifest import FileEntry, Manifest, versions
from .session import Committed, RankReport
from .tensorfile import encode_json, write_bytes

if TYPE_CHECKING:
    from .config import CheckpointerConfig
    from .remote_commit import NodeUploader, RemoteCommitter
    from .retention import RetentionPolicy

log = logging.getLogger("resilient_callbacks")

PROBE_PREFIX = ".rc-node-probe-"
REMOTE_MANIFEST = "remote_manifest.json"  # the coordinator's copy of the global manifest
SHARED_PATHS = ("shared.json", "shared.safetensors")


@dataclass
class Topology:
    """Which ranks share a disk. ``nodes``: the ranks of each node, nodes ordered by their
    lowest rank. The groups (gloo) exist only in node-local mode."""

    rank: int
    world_size: int
    nodes: tuple[tuple[int, ...], ...]
    node_group: Any = None
    leaders_group: Any = None
    cpu_group: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def node_local(self) -> bool:
        return len(self.nodes) > 1

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is on no node")

    @property
    def node_ranks(self) -> tuple[int, ...]:
        return self.nodes[self.node]

    @property
    def leader(self) -> int:
        return self.node_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def leaders(self) -> list[int]:
        return [n[0] for n in self.nodes]

    def successor(self, node: int) -> int:
        return (node + 1) % len(self.nodes)

    def predecessor(self, node: int) -> int:
        return (node - 1) % len(self.nodes)

    @staticmethod
    def label(ranks: tuple[int, ...] | list[int]) -> str:
        """A node's name on disk (replica folders): its ranks."""
        return f"ranks_{min(ranks):05d}-{max(ranks):05d}"


def detect(dirpath: str, shared: bool | None) -> Topology:
    """Every rank, at construction: which ranks see the same ``dirpath`` (see the module
    docstring). Raises :class:`ConfigError` when ``shared=False`` but every rank sees one
    directory, or when the visibility is not a partition of the ranks."""
    r, n = dist.rank(), dist.world_size()
    if n == 1 or shared is True:
        return Topology(r, n, (tuple(range(n)),))
    token = dist.broadcast_json(uuid.uuid4().hex[:12] if r == 0 else None)
    prefix = f"{PROBE_PREFIX}{token}-"
    probe = os.path.join(dirpath, f"{prefix}{r:05d}")
    error = None
    try:
        os.makedirs(dirpath, exist_ok=True)
        write_bytes(probe, b"")
    except OSError as e:
        error = f"rank {r}: cannot write into {dirpath}: {e}"
    errors = [e for e in dist.all_gather_json(error) if e]
    if errors:
        raise CheckpointWriteError("; ".join(errors) + ". Check the path and its permissions.")
    dist.barrier()
    seen: set[int] = set()
    for attempt in range(2):  # a second look: network filesystems may list a new file late
        if attempt:
            time.sleep(0.2)
        for name in os.listdir(dirpath):
            if name.startswith(prefix):
                with contextlib.suppress(ValueError):
                    seen.add(int(name[len(prefix) :]))
    view = [min(seen), len(seen), hash(tuple(sorted(seen))) & 0xFFFFFFFF]
    views = dist.all_gather_json(view)
    dist.barrier()
    with contextlib.suppress(OSError):
        os.unlink(probe)
    groups: dict[int, list[int]] = {}
    for rank_, (first, _, _) in enumerate(views):
        groups.setdefault(first, []).append(rank_)
    for ranks in groups.values():
        if any(views[x][1] != len(ranks) or views[x][2] != views[ranks[0]][2] for x in ranks):
            raise ConfigError(
                f"dirpath={dirpath!r}: the ranks disagree about who shares this directory "
                f"(visible probe files per rank: {views}); it must be either one filesystem "
                "all ranks share or one disk per node. Pass shared_dirpath=True or False."
            )
    nodes = tuple(tuple(v) for _, v in sorted(groups.items()))
    if len(nodes) == 1:
        if shared is False:
            raise ConfigError(
                f"shared_dirpath=False, but every rank sees the same dirpath={dirpath!r} (a "
                "shared filesystem): node-local mode needs a directory of its own per node. "
                "Drop shared_dirpath (detected) or give each node a local path."
            )
        return Topology(r, n, nodes)
    topo = Topology(r, n, nodes)
    import torch.distributed as tdist

    for node_ranks in nodes:  # every rank creates every group, in the same order
        g = tdist.new_group(list(node_ranks), backend="gloo")
        if r in node_ranks:
            topo.node_group = g
    topo.leaders_group = tdist.new_group(topo.leaders, backend="gloo")
    topo.cpu_group = tdist.new_group(backend="gloo")
    log.info(
        "node-local mode: %d nodes (%s) each with its own %s",
        len(nodes),
        ", ".join(Topology.label(x) for x in nodes),
        dirpath,
    )
    return topo


def global_files(files: list[FileEntry]) -> list[FileEntry]:
    """The files of the remote (global) checkpoint: every rank's files, the replicated ones
    (written by each node's leader) once, as rank 0 wrote them."""
    out: dict[str, FileEntry] = {}
    for f in sorted(files, key=lambda f: f.rank):
        out.setdefault(f.path, f)
    return list(out.values())


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

    def open(self, config: CheckpointerConfig) -> None:
        """Every rank: each leader opens its node's directory and connects to the remote tier;
        every rank learns the first failure, and the commit number every tier is past."""
        error, seq = None, 0
        if self.topology.is_leader:
            try:
                self._open_leader(config)
                seq = self.seq
            except (CheckpointError, OSError) as e:
                error = f"{type(e).__name__} on rank {self.topology.rank}: {e}"
                self.release()
        results = dist.all_gather_json([error, seq])
        errors = [e for e, _ in results if e]
        if errors:
            self.release()
            raise CheckpointWriteError(
                f"node-local checkpoint directory {self.dirpath} could not be opened: "
                + "; ".join(errors)
            )
        self.seq = max(s for _, s in results)

    def _open_leader(self, config: CheckpointerConfig) -> None:
        from .remote import RemoteStore
        from .remote_commit import NodeUploader, RemoteCommitter

        os.makedirs(self.dirpath, exist_ok=True)
        self.lock.acquire()
        swept = sweep_staging(self.dirpath)
        if swept:
            log.warning("removed %d leftover(s) of interrupted saves: %s", len(swept), swept)
        self.seq = catalog.next_seq(self.dirpath) - 1
        assert config.remote is not None
        self.remote = RemoteStore(config.remote, config.remote_options)
        self.remote.preflight(timeout=config.remote_timeout)
        self.uploader = NodeUploader(self.remote, self.dirpath, self.topology.node)
        if self.topology.rank == 0:
            self.committer = RemoteCommitter(
                self.remote, len(self.topology.nodes), config.remote_retention_policy()
            )
            self.seq = max(self.seq, self.committer.refresh_max_seq())

    def release(self) -> None:
        if self.uploader is not None:
            self.uploader.stop()
        if self.committer is not None:
            self.committer.stop()
        self.lock.release()

    def apply_retention(self, protect: str | None) -> None:
        """Leader: the local retention of this node's directory; a checkpoint whose part this
        node has not uploaded yet is kept."""
        if not self.topology.is_leader:
            return
        with self._retention_lock:
            protected = [protect] if protect else []
            if self.uploader is not None:
                protected += self.uploader.pending()
            apply_retention(self.dirpath, self.retention, self.run_id, protected)

    def exchange_reports(self, group_fallback: Any = None) -> None:
        """Leaders (a collective on the leaders group): the uploads each node finished reach
        the coordinator, which commits the checkpoints every node has uploaded."""
        if not self.topology.is_leader:
            return
        mine = self.uploader.take_reports() if self.uploader is not None else []
        got = dist.gather_json(mine, dst=0, group=self.topology.leaders_group)
        if got is not None and self.committer is not None:
            for node, reports in enumerate(got):
                for rep in reports:
                    self.committer.report(node, rep)

    def finish_nodes(self, timeout: float | None) -> None:
        """close(), every rank: each leader waits for its uploads, the last reports reach the
        coordinator, which waits for the remote commits (what is left stays local, named)."""
        if not self.topology.is_leader:
            return
        t0 = time.monotonic()
        if self.uploader is not None and not self.uploader.wait(timeout):
            log.warning(
                "close(): this node's part of %s is not uploaded yet; it stays local in %s",
                ", ".join(sorted(self.uploader.pending())),
                self.dirpath,
            )
        self.exchange_reports()
        if self.committer is not None:
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
            if not self.committer.wait(left):
                log.warning(
                    "close(): not committed remotely (a node's part is missing): %s",
                    ", ".join(self.committer.waiting()),
                )


@dataclass
class _Outcome:
    ok: bool
    seq: int
    name: str
    error: str | None = None
    ranks: tuple[int, ...] = ()
    renamed: dict[str, str] = field(default_factory=dict)


class NodeLocalSession:
    """The commit of one checkpoint in node-local mode (same calls as
    :class:`~.session.CommitSession`: ``begin``, ``add``, ``commit``); see the module docstring
    for which ranks do what."""

    def __init__(
        self, directory: NodeDirectory, step: int, *, run_id: str, group: Any = None
    ) -> None:
        self.d = directory
        self.topo = directory.topology
        self.step = step
        self.run_id = run_id
        self.group = group
        self.files: list[FileEntry] = []
        self.staging: str | None = None
        self.seq = 0
        self.name = ckpt_name(step)
        self._begin_error: BaseException | None = None

    def begin(self) -> str | None:
        """Collective: rank 0 numbers the commit and names it remotely; every rank makes its
        node's staging directory (the same name on every node) and returns it."""
        d = self.d
        msg = None
        if self.topo.rank == 0:
            name = d.committer.free_name(self.name) if d.committer else self.name
            msg = {"seq": d.seq + 1, "name": name, "token": uuid.uuid4().hex[:12]}
        msg = dist.broadcast_json(msg, group=self.group)
        self.seq, self.name = int(msg["seq"]), str(msg["name"])
        self.staging = os.path.join(
            d.dirpath, f"{STAGING_PREFIX}{ckpt_name(self.step)}-{msg['token']}"
        )
        try:
            os.makedirs(self.staging, exist_ok=True)
        except OSError as e:
            self._begin_error = e
            return None
        return self.staging

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
            versions=versions(),
            extra=dict(extra or {}),
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
        if any rank or node failed (nothing stays committed then)."""
        d, topo = self.d, self.topo
        error = error or self._begin_error
        report = RankReport(
            topo.rank,
            self.files if error is None else [],
            None if error is None else f"{type(error).__name__}: {error}",
        )
        node_reports = dist.gather_json(report.to_json(), dst=topo.leader, group=topo.node_group)
        node_msg: dict[str, Any] = {}
        local_path = None
        if node_reports is not None:  # this node's leader
            reps = [RankReport.from_json(x) for x in node_reports]
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
                    }
                    m = self._manifest(files, metrics, reason, fingerprint, node_extra)
                    assert self.staging is not None
                    local_path = d.commit.commit(self.staging, self.step, encode_json(m.to_json()))
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
            outcome = self._decide(gathered, metrics, reason, fingerprint, extra, local_path)
        out = _Outcome(**dist.broadcast_json(outcome, group=self.group))
        out.ranks = tuple(out.ranks)
        if not out.ok:
            if local_path is not None:
                with contextlib.suppress(OSError):
                    remove_checkpoint(local_path)
            raise CheckpointWriteError(
                f"checkpoint for step {self.step} was not committed; failed on rank(s) "
                f"{', '.join(map(str, out.ranks))}: {out.error}. Nothing was committed and older "
                f"checkpoints on every node are intact.",
                out.ranks,
            )
        d.seq = max(d.seq, out.seq)
        local_name = out.renamed.get(str(topo.node), ckpt_name(self.step))
        path = local_path or os.path.join(d.dirpath, local_name)
        if topo.is_leader and local_path is not None:
            self._after_local_commit(local_path, reason)
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
                write_bytes(os.path.join(local_path, REMOTE_MANIFEST), data)
            except OSError as e:
                log.warning("could not keep the global manifest next to %s: %s", local_path, e)
        if d.committer is not None and d.config.remote_due(self.seq, reason):
            d.committer.expect((self.run_id, self.seq), self.name, data)
        return {"ok": True, "seq": self.seq, "name": self.name, "renamed": renamed}

    def _after_local_commit(self, local_path: str, reason: str) -> None:
        """Leader: queue this node's part for upload (if due), replicate, apply retention."""
        d = self.d
        name = os.path.basename(local_path)
        if d.uploader is not None and d.config.remote_due(self.seq, reason):
            from .manifest import read_manifest

            m = read_manifest(local_path)
            mine = [f for f in m.files if not (f.path in SHARED_PATHS and f.rank != 0)]
            d.uploader.enqueue(name, self.name, (self.run_id, self.seq), mine)
        if d.config.replicas:
            self._replicate(local_path)
        d.apply_retention(protect=name)

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
            log.warning("replicating %s to the next node failed: %s", local_path, e)
