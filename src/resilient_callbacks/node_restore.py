"""Restore in node-local mode: the newest checkpoint every node can load, from local disks when
they all hold it (NVRx's rule), else with the missing nodes' files fetched from a peer's replica
or the remote -- each node fetching only its own ranks' files (and the replicated ``shared.*``).

Which ranks call what (every rank calls :meth:`NodeRestorer.restore`):

1. each leader lists what its disk holds (committed checkpoints, sizes checked, and the
   replicas it keeps for its predecessor) and sends it to the coordinator (leaders group);
2. the coordinator lists the remote tier once and plans the candidates, newest commit first,
   each with a source per node: ``local``, ``peer`` (the successor's replica) or ``remote``;
   a commit no source covers for some node is not a candidate. It broadcasts the plan;
3. for each candidate in turn: the leaders fetch what their node lacks (a replica travels
   point-to-point from its holder), every rank learns its node's path, and the ranks load and
   verify as in :class:`~.restoring.Restorer` -- a problem anywhere skips the candidate on
   every rank, loudly;
4. after the load: the leaders queue the uploads a crash interrupted; the coordinator picks up
   the global manifests of those checkpoints, so their remote commit completes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from . import branches, catalog, dist, node_download, peers, stall
from .candidates import unreadable_remote, warn_abandoned
from .catalog import Depth, Status
from .commit import remove_checkpoint
from .config import ResumeMode
from .errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    NoValidCheckpointError,
    RemoteUnavailableError,
    RemoteWaitPreemptedError,
    ResumeFallbackWarning,
    relayed,
    warn_and_log,
)
from .manifest import Manifest, read_manifest
from .node_files import REMOTE_MANIFEST, needed
from .nodelocal import NodeDirectory
from .remote import NO_MANIFEST
from .restoring import Candidate, Restorer, RestoreReport
from .topology import Topology

log = logging.getLogger("resilient_callbacks")


class NodeRestorer(Restorer):
    """The restore path of a Checkpointer in node-local mode (see the module docstring)."""

    @property
    def _d(self) -> NodeDirectory:
        d = self._ck._dir
        assert isinstance(d, NodeDirectory)
        return d

    def restore(self, state: Any) -> int:
        ck, d = self._ck, self._d
        topo = d.topology
        r = ck.config.resume
        self._t0, self._tier, self._skipped = time.perf_counter(), "local", 0
        self._fetched: dict[tuple[str, int], dict[str, Any]] = {}  # this restore's downloads
        self._deferred: tuple[str, Manifest] | None = None
        if r == ResumeMode.NEVER:
            ck._trigger.clock.reset()
            ck._start_run(0)
            return 0
        if isinstance(r, str) and r != ResumeMode.AUTO:
            return super().restore(state)  # a checkpoint folder every node sees
        got = None
        if topo.is_leader:
            got = dist.gather_json(self._holdings(), dst=0, group=topo.leaders_group)
        msg: dict[str, Any] | None = None
        if ck.rank == 0:
            try:
                cands, remote_keys, unusable, orphans = self._plan(got or [])
                msg = {
                    "cands": cands,
                    "remote_keys": remote_keys,
                    "unusable": unusable,
                    "orphans": orphans,
                    "seq": d.seq,
                    "error": None,
                }
            except Exception as e:
                msg = {"cands": [], "error": [type(e).__name__, str(e)]}
        msg = dist.broadcast_json(msg, group=topo.cpu_group)
        assert msg is not None
        if msg["error"] is not None:
            raise relayed(msg["error"][0], msg["error"][1])
        d.seq = max(d.seq, int(msg["seq"]))
        self._remove_orphans([(str(k[0]), int(k[1])) for k in msg.get("orphans") or []])
        unusable = [str(u) for u in msg.get("unusable") or []]
        if not msg["cands"] and unusable:
            raise NoValidCheckpointError(
                f"{ck.dirpath} (on {len(topo.nodes)} nodes) or its remote tier holds "
                "checkpoints, but for none of them does every node have its files (on its disk, "
                "in a peer's replica or in the remote tier, with a manifest that can be read):"
                "\n  - " + "\n  - ".join(unusable) + "\nRefusing to start "
                "from scratch silently; pass resume='never' to start fresh."
            )
        if not msg["cands"]:
            self.fresh_start()
            return 0
        explicit = isinstance(r, int)
        skipped: list[str] = []
        for why in unusable:  # newer than every candidate: skipped, loudly
            skipped.append(why)
            self._warn_unusable(why)
        for i, c in enumerate(msg["cands"]):
            # resume=<step> fails at the last copy of that commit only: a damaged local copy
            # is followed, loudly, by the remote one (_plan), never by another commit
            strict = explicit and all(x["key"] != c["key"] for x in msg["cands"][i + 1 :])
            mine, problems, tiers = self._obtain(c)
            key = (str(c["key"][0]), int(c["key"][1]))
            where = f"step {c['step']} (commit {key[1]})"
            if problems:
                why = "; ".join(problems)
                skipped.append(f"{where}: {why}")
                if strict:
                    raise CheckpointCorruptError(f"cannot resume from {where}: {why}")
                self._warn_fallback(Candidate(mine.get("path"), c["step"], why, key), why)
                continue
            cand = Candidate(mine["path"], int(c["step"]), None, key)
            # the run's restore, as the history records it: from the remote if any node
            # fetched from there, else from a peer if any did
            self._tier = next((t for t in ("remote", "peer") if t in tiers), "local")
            self._skipped = len(skipped)
            step = self._try_load(cand, state, strict, skipped)
            if step is not None and c.get("abandoned") and not explicit:
                warn_abandoned(cand, skipped, ck.is_coordinator)  # loudly: the timeline changes
            if step is not None:
                tier = mine["tier"]
                url = d.remote.url if d.remote is not None else ck.config.remote
                ck.last_restore = RestoreReport(
                    mine["path"],
                    step,
                    tier,
                    f"{url}/{c['src'][str(topo.node)][1]}" if tier == "remote" else None,
                    tuple(skipped),
                    int(mine.get("files", 0)),
                    int(mine.get("bytes", 0)),
                )
                listed = msg["remote_keys"]
                d.recover_uploads(
                    None if listed is None else {(str(k[0]), int(k[1])) for k in listed}
                )
                if self._deferred is not None:  # after: what recover_uploads queues is kept
                    Restorer._catch_up(self, *self._deferred)
                return step
        raise NoValidCheckpointError(
            f"{ck.dirpath} (on {len(topo.nodes)} nodes) holds checkpoints but none can be "
            "restored:\n  - " + "\n  - ".join(skipped) + "\nRefusing to start from scratch "
            "silently; pass resume='never' to start fresh."
        )

    def _catch_up(self, path: str, manifest: Manifest) -> None:
        self._deferred = (path, manifest)  # see restore(): after the uploads are queued again

    def _warn_unusable(self, why: str) -> None:
        msg = f"skipping {why}; trying the next copy (this step from another tier, or older)"
        warn_and_log(log, msg, ResumeFallbackWarning, stacklevel=4, warn=self._ck.is_coordinator)

    def _say_fallback(self, c: Candidate, problem: str) -> None:
        """As in shared mode, but named by step and commit (each node has its own path), and
        the next candidate may be this commit again, from another tier."""
        key = f" (commit {c.key[1]})" if c.key is not None else ""
        self._warn_unusable(f"step {c.step}{key} on {len(self._d.topology.nodes)} nodes: {problem}")

    # ------------------------------------------------------------------ leaders, coordinator

    def _holdings(self) -> dict[str, Any]:
        """Leader: the committed checkpoints on this node's disk and the replicas it keeps."""
        d = self._d
        local, damaged = [], []
        for e in catalog.scan(d.dirpath, Depth.SIZE):
            if e.manifest is not None and e.status is Status.VALID:
                m = e.manifest
                ranks = sorted({f.rank for f in m.files})
                # the coordinator's copy, and whether the coordinator recorded the checkpoint
                # as committed on every node (the global manifest beside it; see _plan)
                coordinator = 0 in ((m.extra.get("node") or {}).get("ranks") or [])
                recorded = os.path.exists(os.path.join(e.path, REMOTE_MANIFEST))
                row = [m.run_id, m.seq, m.step, e.name, ranks, m.world_size, coordinator]
                local.append([*row, recorded, m.lineage])  # (lineage: branches.py)
            elif e.status is Status.CORRUPT:  # another node's copy, or the remote's, is used
                if e.manifest is not None:  # still says what a roll-back abandoned
                    damaged.append([e.manifest.run_id, e.manifest.seq, e.manifest.lineage])
                log.warning(
                    "node %d: %s is damaged, not used: %s", d.topology.node, e.path, e.problem
                )
        replicas = [
            [label, m.run_id, m.seq, m.step, path]
            for label, items in peers.list_replicas(d.dirpath, d.topology.node).items()
            for path, m in items
        ]
        return {"local": local, "replicas": replicas, "damaged": damaged}

    def _plan(
        self, got: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[Any] | None, list[str], list[list[Any]]]:
        """Coordinator: the candidates, newest first, each with a source for every node; the
        commits newer than every candidate that some node has no source for; and the orphans:
        commits some node has no source for, of which the coordinator's own copy shows that
        they were never committed on every node (a save a failure cut off after some nodes'
        local commits; no global manifest beside it), so not checkpoints at all."""
        d, topo = self._d, self._d.topology
        remote: dict[tuple[str, int], str] = {}
        steps: dict[tuple[str, int], int] = {}
        remote_worlds: dict[tuple[str, int], int] = {}
        lines: dict[tuple[str, int], Any] = {}  # each commit's lineage field (branches.py)
        unlisted: str | None = None
        broken: dict[tuple[str, int], str] = {}  # committed remotely, damaged there: why
        unread: list[Candidate] = []  # remote manifests that cannot be read: maybe the newest
        if d.remote is not None:
            try:
                # bounded; a preemption request ends it (the limit outlasts a grace period),
                # raised on every rank as restore() relays this one's error
                listed = stall.run(d.remote.scan, f"listing {d.remote.url}", preemptible=True)
                unread = unreadable_remote(d.remote.url, listed)  # named, never skipped silently
                for e in listed:
                    if e.manifest is None:
                        continue
                    key = (e.manifest.run_id, e.manifest.seq)
                    lines[key] = e.manifest.lineage  # (damaged too: its lineage)
                    steps[key] = e.manifest.step
                    if e.problem is not None:  # named where no node has another copy
                        broken[key] = f"{d.remote.url}/{e.name} is damaged ({e.problem})"
                        continue
                    remote[key] = e.name
                    remote_worlds[key] = e.manifest.world_size
                if d.committer is not None:
                    d.committer.index = dict(remote)
                    d.committer.listed = {e.name for e in listed if e.problem != NO_MANIFEST}
            except RemoteWaitPreemptedError:  # not restored from the disks only: it ends the run
                raise
            except Exception as e:
                unlisted = f"{type(e).__name__}: {e}"
        local: list[dict[tuple[str, int], tuple[str, set[int]]]] = []
        unrecorded: set[tuple[str, int]] = set()  # the coordinator's copy has no global manifest
        marked: set[tuple[str, int]] = set()  # a copy has it: committed on every node
        worlds: dict[tuple[str, int], int] = dict(remote_worlds)
        for holding in got:
            for run_id, seq, line in holding.get("damaged", []):
                lines.setdefault((run_id, seq), line)
            mine: dict[tuple[str, int], tuple[str, set[int]]] = {}
            for run_id, seq, step, name, ranks, world, coordinator, recorded, line in holding[
                "local"
            ]:
                lines.setdefault((run_id, seq), line)
                if coordinator and not recorded:
                    unrecorded.add((run_id, seq))
                elif recorded:
                    marked.add((run_id, seq))
                known = mine.get((run_id, seq))
                if known is None or len(ranks) > len(known[1]):  # the fullest copy on the disk
                    mine[(run_id, seq)] = (name, set(ranks))
                # the remote's step, else the first node's: a copy that says another step is
                # not used (_not_the_planned)
                steps.setdefault((run_id, seq), step)
                worlds[(run_id, seq)] = world
            local.append(mine)
        held: dict[tuple[int, str, tuple[str, int]], str] = {}
        for node, holding in enumerate(got):
            for label, run_id, seq, step, path in holding["replicas"]:
                held[(node, label, (run_id, seq))] = path
                steps.setdefault((run_id, seq), step)
        d.seq = max([d.seq, *(k[1] for k in steps)])
        if unlisted is not None:
            if not steps:  # nothing on any disk either: never a silent fresh start
                raise RemoteUnavailableError(
                    f"the remote tier {d.remote.url if d.remote else ''} cannot be listed "
                    f"({unlisted}) and no node's disk holds a checkpoint: refusing to start from "
                    "scratch while the remote may hold the run; retry when it is reachable, or "
                    "pass resume='never' to start fresh"
                )
            msg = (
                f"the remote tier cannot be listed ({unlisted}): restoring from the nodes' "
                "disks only; the remote may hold a newer checkpoint"
            )
            warn_and_log(log, msg, ResumeFallbackWarning, stacklevel=4)
        cands: list[dict[str, Any]] = []
        unusable: list[str] = []
        orphans: list[list[Any]] = []
        # the run's current lineage first, newest first; what a roll-back abandoned after it
        # (over every commit known, a damaged one too: the newest may be the one that says the
        # run rolled back)
        off = branches.off_lineage((k[0], k[1], line) for k, line in lines.items())
        for key in sorted(steps, key=lambda k: (k not in off, k[1], steps[k]), reverse=True):
            src: dict[str, list[Any]] = {}
            for k, ranks in enumerate(topo.nodes):
                have = local[k].get(key) if k < len(local) else None
                holder = topo.successor(k)
                replica = held.get((holder, Topology.label(ranks), key))
                if have is not None and needed(ranks, worlds.get(key)) <= have[1]:
                    src[str(k)] = ["local", have[0]]
                elif replica is not None:
                    src[str(k)] = ["peer", holder, replica]
                elif key in remote:
                    src[str(k)] = ["remote", remote[key]]
                else:
                    if key in unrecorded and key not in marked and key not in broken:
                        orphans.append([*key, steps[key], k])
                    elif not cands:  # newer than every candidate: the restore says it skipped it
                        torn = f": its remote copy {broken[key]}" if key in broken else ""
                        unusable.append(
                            f"step {steps[key]} (commit {key[1]}): node {k} has no copy of its "
                            f"files (not on its disk, in a peer's replica, nor in the remote "
                            f"tier{torn})"
                        )
                    break
            else:
                cands.append({"key": list(key), "step": steps[key], "src": src})
                cands[-1]["abandoned"] = key in off
                if key in remote and any(v[0] != "remote" for v in src.values()):
                    # if a local copy turns out damaged: the same commit from the remote, where
                    # a node's own copy does not verify (a third item: check that one first)
                    every = {
                        k: ["remote", remote[key], *(v[1:] if v[0] == "local" else [])]
                        for k, v in src.items()
                    }
                    cands.append(dict(cands[-1], src=every))
        # (maybe the newest: skipped first, loudly; an error when nothing else is restored)
        unusable[:0] = [
            f"step {c.step}: {c.problem}" if c.step is not None else str(c.problem) for c in unread
        ]
        r = self._ck.config.resume
        if isinstance(r, int):
            cands = [c for c in cands if c["step"] == r]
            if not cands:
                raise CheckpointNotFoundError(
                    f"resume={r}: no checkpoint of step {r} that every node can load "
                    f"(steps present: {sorted(set(steps.values())) or 'none'})"
                    + "".join(f"; {c.problem}" for c in unread if c.step == r)
                )
            unusable = []  # the step asked for, not the newest: nothing newer is skipped
        keys = None if unlisted is not None else [list(k) for k in remote]  # None: not known
        for _, seq, step, k in orphans:
            why = (
                f"step {step} (commit {seq}) was never committed on every node (node {k} has no "
                "copy of its files, and the save was not recorded as committed: a failure cut "
                "it off): not a checkpoint; its nodes' parts are removed"
            )
            warn_and_log(log, why, ResumeFallbackWarning, stacklevel=4)
        return cands, keys, unusable, [o[:2] for o in orphans]  # (every one: as shared mode)

    def _remove_orphans(self, keys: list[tuple[str, int]]) -> None:
        """Leader: delete this node's parts of the commits ``keys`` (orphans, see :meth:`_plan`),
        which would take ``keep_last``'s places, be listed as valid and be uploaded again."""
        d = self._d
        if not keys or not d.topology.is_leader:
            return
        for e in catalog.scan(d.dirpath, Depth.NONE):
            m = e.manifest
            if m is not None and (m.run_id, m.seq) in keys:
                try:
                    remove_checkpoint(e.path, d.trash.put)
                    log.info("removed %s: this node's part of a save that was cut off", e.path)
                except OSError as err:
                    log.warning("could not remove %s: %s", e.path, err)

    # ------------------------------------------------------------------ fetching (collective)

    def _obtain(self, c: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
        """Every rank: each leader makes its node hold candidate ``c`` (fetching from a peer or
        the remote if needed); every rank gets its node's result, every node's problem and
        every node's tier."""
        d, topo = self._d, self._d.topology
        src = c["src"]
        mine_src = src[str(topo.node)]
        key = (str(c["key"][0]), int(c["key"][1]))
        result: dict[str, Any] = {"path": None, "problem": None, "tier": mine_src[0]}
        raised: RemoteWaitPreemptedError | None = None
        if topo.is_leader and mine_src[0] == "local":
            result["path"] = os.path.join(d.dirpath, mine_src[1])
            result["problem"] = self._not_the_planned(result["path"], c)
        elif topo.is_leader and mine_src[0] == "remote" and self._intact(mine_src[2:], c):
            result["path"], result["tier"] = os.path.join(d.dirpath, mine_src[2]), "local"
        elif topo.is_leader and mine_src[0] == "remote" and key in self._fetched:
            result.update(self._fetched[key])  # downloaded for this commit's first try
        elif topo.is_leader and mine_src[0] == "remote":
            try:
                result["path"], result["files"], result["bytes"] = node_download.download(
                    d, mine_src[1], c
                )
                self._fetched[key] = {k: result[k] for k in ("path", "files", "bytes", "tier")}
            except RemoteWaitPreemptedError as e:  # (the limit is longer than a grace period)
                raised, result["preempted"] = e, str(e)
            except Exception as e:
                result["problem"] = f"remote copy {mine_src[1]}: {type(e).__name__}: {e}"
                self._fetched[key] = {"problem": result["problem"]}  # not fetched again
        for j in sorted(src, key=int):  # replicas, pair by pair, in the same order everywhere
            s = src[j]
            if s[0] != "peer" or not topo.is_leader:
                continue
            holder, receiver = int(s[1]), int(j)
            try:
                if topo.node == holder:
                    peers.exchange(s[2], topo.nodes[receiver][0], None, None, topo.cpu_group)
                elif topo.node == receiver:
                    path = peers.exchange(
                        None, None, topo.nodes[holder][0], d.dirpath, topo.cpu_group
                    )
                    assert path is not None
                    m = read_manifest(path)
                    result["path"] = path
                    result["files"] = len(m.files)
                    result["bytes"] = m.total_bytes
                    log.warning(
                        "restored node %d's files of step %s from the replica on node %d",
                        topo.node,
                        c["step"],
                        holder,
                    )
            except Exception as e:
                if topo.node == receiver:
                    result["problem"] = f"replica on node {holder}: {type(e).__name__}: {e}"
        everyone = dist.all_gather_json(result if topo.is_leader else None, group=topo.cpu_group)
        preempted = [x["preempted"] for x in everyone if x is not None and x.get("preempted")]
        if preempted:  # a leader's download ended by a preemption request: every rank ends
            raise raised or RemoteWaitPreemptedError(preempted[0])
        problems = [
            f"node {topo.node_of(r)} (rank {r}): {x['problem']}"
            for r, x in enumerate(everyone)
            if x is not None and x["problem"]
        ]
        mine = everyone[topo.leader] or {}
        tiers = [x["tier"] for x in everyone if x is not None]
        return mine, problems, tiers

    @staticmethod
    def _not_the_planned(path: str, c: dict[str, Any]) -> str | None:
        """Leader: why this node's copy at ``path`` is not candidate ``c`` (its manifest names
        another run, commit or step: then the ranks would resume at different steps), or
        ``None``."""
        try:
            m = read_manifest(path)
        except (OSError, CheckpointCorruptError) as e:
            return f"{path}: {type(e).__name__}: {e}"
        if [m.run_id, m.seq, m.step] != [*c["key"], c["step"]]:
            return (
                f"{path}: its manifest says step {m.step} (commit {m.seq} of run {m.run_id}), "
                f"the other nodes' step {c['step']} (commit {c['key'][1]} of run {c['key'][0]})"
            )
        return None

    def _intact(self, local: list[str], c: dict[str, Any]) -> bool:
        """Leader: is this node's own copy (``local``: its name, or nothing) candidate ``c``,
        and does it verify? Then a fallback to the same commit from the remote does not
        download it again (only the nodes whose copy is damaged do)."""
        if not local:
            return False
        path = os.path.join(self._d.dirpath, local[0])
        problem = self._not_the_planned(path, c)
        if problem is None:
            try:
                catalog.verify(path, read_manifest(path), Depth.FULL)
            except (OSError, ValueError, CheckpointCorruptError) as e:
                problem = str(e)
        if problem is not None:
            log.info("this node's copy %s is not usable (%s): fetching it again", path, problem)
            return False
        return True
