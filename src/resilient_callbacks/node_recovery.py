"""The uploads a crash cut off, queued again after a node-local restore (docs/multinode.md,
"After a restore"): each leader uploads its parts of this run's local checkpoints newer than
the run's newest remote commit, only those the remote retention keeps; the coordinator expects
their remote commit from the global manifest it kept beside its copy. An archive point (or
one of the run's best, :mod:`.remote_best`) older than that commit which the store lacks is
uploaded too where the coordinator's history records no remote commit of it (never uploaded:
saved by a library that uploaded it only when due by ``remote_every_n_saves``, or a stop cut
its upload off) and every node holds its part; one recorded was deleted from the store since,
on purpose (or, a best one, by the remote retention once better ones outranked it).

Which ranks call what: :func:`recover_uploads` on every rank after the restore loaded (the
leaders act); one collective on every rank (``cpu_group``): whether every leader could read
its disk, which older archive points (and best ones) each leader holds, and which remote
commits the coordinator's history records, so that one node's failure skips the recovery on
every node, never leaving the others waiting in the first save's collectives, and every node
uploads the same older ones.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from . import catalog, dist, history, remote_best
from .catalog import Depth, Status, archived
from .manifest import FileEntry, Manifest
from .node_files import REMOTE_MANIFEST, is_shared
from .remote_claims import commit_tag
from .retention import Candidate, plan

if TYPE_CHECKING:
    from .nodelocal import NodeDirectory

log = logging.getLogger("resilient_callbacks")


def recover_uploads(d: NodeDirectory, remote_keys: set[tuple[str, int]] | None) -> None:
    """After a restore, leaders: queue this run's local checkpoints newer than its newest
    remote commit (their upload a crash cut off); coordinator: expect their remote commit.
    ``remote_keys`` None: the remote could not be listed, so every one is queued again.
    A leader that cannot read its disk (permission denied, the folder gone) skips the
    recovery on every node, with an ERROR: the run resumes, its new checkpoints are uploaded
    as usual (a node's part alone would hold every newer remote commit back)."""
    topo, planned, problem, recorded, blocked = d.topology, None, None, None, None
    if topo.is_leader and d.run_id is not None:
        try:
            planned = _plan(d, remote_keys)
            recorded = committed_seqs(d) if topo.rank == 0 else None
            blocked = _uncommittable(d, planned[3]) if topo.rank == 0 else None
        except Exception as e:
            problem = f"node {topo.node}: {type(e).__name__}: {e}"
    # (leaders: the older archive points and best ones this node holds, [seq, step, what];
    # rank 0: the remote commits its history records, and the older ones whose commit it
    # cannot write)
    held = None if planned is None else [[x[1].seq, x[1].step, _what(d, x[1])] for x in planned[3]]
    mine: list[Any] = [problem, held, recorded, blocked]
    got = [mine]
    if topo.cpu_group is not None:  # (every rank: one node's failure is every node's)
        got = dist.all_gather_json(mine, group=topo.cpu_group)
    problems: list[str] = [g[0] for g in got if g[0]]
    if problems:
        if topo.is_leader and d.run_id is not None:
            _say_skipped(d, problems, remote_keys)
        return
    if planned is not None:
        due, kept, why, older = planned
        _queue(d, due, kept, why, _older_everywhere(d, older, got))


def committed_seqs(d: NodeDirectory) -> list[int]:
    """Coordinator: the commit numbers of this run whose remote commit the history of its
    node's directory records (the committer's ``upload`` records: :func:`.history.uploads`)."""
    return sorted({seq for u in history.uploads(d.dirpath, d.run_id).values() for seq in u.seqs})


def _uncommittable(d: NodeDirectory, older: list[Any]) -> list[list[Any]]:
    """Coordinator: of its node's ``older`` archive points, those whose remote commit it
    cannot write (the global manifest kept beside its part unreadable, or of another layout
    of nodes), as ``[seq, why]``: no node uploads them (parts no commit could ever name,
    sent again at every restart)."""
    out: list[list[Any]] = []
    for local, m, _, _ in older:
        path = os.path.join(d.dirpath, local, REMOTE_MANIFEST)
        try:
            _, nodes = _saved_global(d, local)
        except Exception as e:  # (gone, permission denied, torn)
            out.append([m.seq, f"{path} cannot be read ({type(e).__name__}: {e})"])
            continue
        if not _this_nodes(d, nodes):
            out.append([m.seq, f"{path} names another layout of nodes ({nodes})"])
    return out


def _saved_global(d: NodeDirectory, local: str) -> tuple[bytes, Any]:
    """Coordinator: the global manifest kept beside its part of ``local`` (its bytes, as the
    remote commit writes them) and the layout of nodes it names (None: not said). Raises
    what reading or decoding it raised."""
    with open(os.path.join(d.dirpath, local, REMOTE_MANIFEST), "rb") as fh:
        raw = fh.read()
    return raw, Manifest.from_json(json.loads(raw), REMOTE_MANIFEST).extra.get("nodes")


def _this_nodes(d: NodeDirectory, nodes: Any) -> bool:
    """A global manifest's layout of nodes (None: not said) is this run's: its nodes hold
    every part of the checkpoint."""
    return nodes is None or nodes == [list(x) for x in d.topology.nodes]


def _older_everywhere(d: NodeDirectory, older: list[Any], got: list[Any]) -> list[Any]:
    """Leader: of this node's archive points and best ones older than the store's newest
    commit of the run and absent from it (``older``), those every node holds, whose remote commit rank 0's
    history does not record and rank 0 can write: uploaded now, as they never were. Rank 0
    says the others."""
    held = [{int(s): int(t) for s, t, _ in g[1]} for g in got if g[1] is not None]
    kinds = {int(x[0]): str(x[2]) for g in got if g[1] is not None for x in g[1]}
    recorded = {int(s) for g in got if g[2] is not None for s in g[2]}
    blocked = {int(s): str(why) for g in got if len(g) > 3 and g[3] for s, why in g[3]}
    steps = {s: t for h in held for s, t in h.items()}
    everywhere = set.intersection(*(set(h) for h in held)) - recorded if held else set()
    blocked = {s: why for s, why in blocked.items() if s in everywhere}
    everywhere -= set(blocked)
    if d.topology.rank == 0:
        _say_older(d, steps, recorded, everywhere | set(blocked), held, kinds)
        for s, why in sorted(blocked.items()):
            log.error(
                "step %d (commit %d) is %s the store %s lacks and whose remote "
                "commit the history in %s does not record%s, and no node uploads it: %s, and "
                "its remote commit writes that file. Its parts stay on the nodes' disks only, "
                "under the local retention; to commit it, make that file readable again (or "
                "restore it) and restart the job.",
                steps[s],
                s,
                kinds[s],
                d.remote.url if d.remote is not None else "",
                d.dirpath,
                _unknown(recorded),
                why,
            )
        if everywhere and not recorded:  # (none at all: a history from before the records)
            url = d.remote.url if d.remote is not None else "the store"
            log.warning(
                "the history in %s records no remote commit of this run (written before this "
                "library recorded them, or lost), so it cannot tell an archive point (or best "
                "checkpoint) never uploaded from one uploaded and deleted from %s since: %s "
                "uploaded now, as never uploaded. If you deleted one there on purpose, "
                "`resilient-ckpt gc --remote %s --drop-archives` (or --drop-all-archives) "
                "deletes an archive point again (a best one: delete it by hand); the run's "
                "commits are recorded from now on, so it is not uploaded again",
                d.dirpath,
                url,
                ", ".join(f"step {steps[s]} (commit {s})" for s in sorted(everywhere)),
                url,
            )
    return [x for x in older if x[1].seq in everywhere]


def _say_older(
    d: NodeDirectory,
    steps: dict[int, int],
    recorded: set[int],
    everywhere: set[int],
    held: list[dict[int, int]],
    kinds: dict[int, str],
) -> None:
    """Rank 0: the older archive points (and best ones) the store lacks that are not
    uploaded, and why."""
    dropped = sorted(s for s in steps if s in recorded)
    if dropped:  # (the remote retention keeps archive points: remote_listing.retention_candidates)
        # but not a best one once better ones outranked it there: the store ranks what it
        # holds (remote_keep_best > keep_best: more than the local disk keeps to rank against)
        outranked = [s for s in dropped if kinds[s] == remote_best.BEST]
        log.info(
            "not uploading %s again: committed remotely by this run (its history records it) "
            "and deleted from %s since, by `resilient-ckpt gc --remote` (--drop-archives, "
            "--drop-all-archives, --remove-corrupt of a damaged copy, or --other-runs) or "
            "outside this library (by hand, or an expiry rule of the store)%s; the nodes' "
            "copies stay while the local retention keeps them",
            ", ".join(f"step {steps[s]} (commit {s})" for s in dropped),
            d.remote.url if d.remote is not None else "the store",
            (
                f"; step(s) {', '.join(str(steps[s]) for s in outranked)}, best on the nodes' "
                "disks (keep_best), maybe by the remote retention too: it ranks what the store "
                "holds, better ones the disks no longer keep with remote_keep_best > keep_best"
            )
            if outranked
            else "",
        )
    for s in sorted(x for x in steps if x not in recorded and x not in everywhere):
        lacking = [str(n) for n, h in enumerate(held) if s not in h]
        log.error(
            "step %d (commit %d) is %s the store %s lacks and whose remote "
            "commit the history in %s does not record%s, and it cannot be uploaded: node(s) "
            "%s hold no part of it (a disk replaced, or a part saved on another layout of "
            "nodes). The other nodes' parts stay on their disks only, under the local "
            "retention; no restore can load it.",
            steps[s],
            s,
            kinds[s],
            d.remote.url if d.remote is not None else "",
            d.dirpath,
            _unknown(recorded),
            ", ".join(lacking),
        )


def _what(d: NodeDirectory, m: Manifest) -> str:
    """What an older checkpoint the store lacks is, that makes it due: :func:`_plan` takes
    those :func:`.remote_best.kept` names alone, so one not an archive point is a best one."""
    policy = d.config.remote_retention_policy()
    return remote_best.kept(m.step, policy, lambda: True, archived(m)) or remote_best.BEST


def _unknown(recorded: set[int]) -> str:
    """What an archive point's missing record means where rank 0's history records no remote
    commit of the run at all (``recorded`` empty): not that it was never committed."""
    if recorded:
        return ""
    return (
        " (nor any remote commit of this run: a history written before those records, or "
        "lost with node 0's disk, so it may have been committed and deleted from the store "
        "since)"
    )


def _say_skipped(
    d: NodeDirectory, problems: list[str], remote_keys: set[tuple[str, int]] | None
) -> None:
    newest = max((k[1] for k in remote_keys or () if k[0] == d.run_id), default=None)
    since = "any" if newest is None else f"those newer than commit {newest}, the store's newest"
    log.error(
        "node %d: the uploads a stop cut off are not queued again on any node: a node could "
        "not read its checkpoint directory (%s). This run's local checkpoints that the store "
        "lacks (%s of this run) stay on the nodes' disks only, not committed remotely. "
        "Training goes on and its new checkpoints are uploaded as usual; to upload the "
        "older ones, make the directory readable by the job's user (or restore it) and "
        "restart the job before its next remote commit: each restore queues them again",
        d.topology.node,
        "; ".join(problems),
        since,
    )


def _plan(d: NodeDirectory, remote_keys: set[tuple[str, int]] | None) -> tuple[Any, ...]:
    """Leader: what :func:`_queue` discards, uploads and expects; reads the disk only."""
    why = "which a stop cut off"
    if remote_keys is None:
        remote_keys, why = set(), "again: the remote could not be listed to tell if it has it"
    newest_remote = max((k[1] for k in remote_keys if k[0] == d.run_id), default=0)
    due: list[Any] = []
    older: list[Any] = []
    entries = catalog.scan(d.dirpath, Depth.SIZE)
    policy = d.config.remote_retention_policy()
    best = remote_best.best(entries, policy, d.run_id, d.found_corrupt)
    for e in entries:
        m = e.manifest
        if m is None or e.status is not Status.VALID or m.run_id != d.run_id:
            continue
        key = (m.run_id, m.seq)
        node = m.extra.get("node") or {}
        name = node.get("remote_name")
        if key in remote_keys or not name:
            continue
        # older than the store's newest commit of the run: uploaded before (and deleted there
        # since), or never (saved by a library that uploaded it only when due by
        # remote_every_n_saves, one a backlog dropped): an archive point or best checkpoint
        # the history records no commit of is uploaded (recover_uploads decides, with every
        # node); any other stays local
        ranks = functools.partial(set.__contains__, best, e.name)
        if m.seq <= newest_remote and not remote_best.kept(m.step, policy, ranks, archived(m)):
            continue
        # downloaded (a node-local save writes no blob; "remote_blobs": the remote copy had
        # blobs, maybe none of them read by this node's ranks): its blobs are no node's to
        # upload, and a commit of its manifest would name blobs the store lacks
        if m.blobs or node.get("remote_blobs"):
            log.info("not uploading %s again: downloaded, its blobs are not on this node", e.name)
            continue
        interval = d.config.remote_due(m.seq, m.reason)
        if remote_best.why_due(interval, m.step, policy, ranks, archived(m)):
            (older if m.seq <= newest_remote else due).append((e.name, m, key, name))
    due.sort(key=lambda x: x[1].seq)
    # (another layout's parts are not discarded either: under the same name, this run's save
    # of that step may be uploading another node's files of those ranks)
    due = _this_layout(d, due)
    older = _this_layout(d, sorted(older, key=lambda x: x[1].seq))
    return due, _not_superseded(d, due), why, older


def _queue(d: NodeDirectory, due: list[Any], kept: list[Any], why: str, older: list[Any]) -> None:
    """Leader: discard what a stop cut off and the remote retention would delete; upload the
    others again, and the ``older`` archive points never uploaded; coordinator: expect their
    remote commit."""
    from .node_upload import UploadJob

    for local, m, key, name in due:
        if any(local == x[0] for x in kept):
            continue
        if d.uploader is not None and why == "which a stop cut off":
            # not committed remotely (the remote was listed): what this node uploaded of it
            # before the stop goes; no node uploads it now
            job = UploadJob(local, name, key, own_files(m), tag=commit_tag(m))
            d.uploader.discard(job)
    never = " the store lacks, whose remote commit the run's history does not record (not "
    never += "uploaded when it was saved: an earlier version of this library or other "
    never += "options; or a stop cut its upload off)"
    whys = [(x, _what(d, x[1]) + never) for x in older] + [(x, why) for x in kept]
    for (local, m, key, name), reason in sorted(whys, key=lambda w: w[0][1].seq):
        if d.committer is not None:
            try:
                raw, nodes = _saved_global(d, local)
                if not _this_nodes(d, nodes):
                    continue  # another layout's: this run's nodes do not hold every part
                d.committer.expect(key, name, raw, local, commit_tag(m))
            except OSError as e:  # (permission denied, an I/O error: never silently)
                _say_not_expected(d, local, e)
            except Exception as e:  # torn (written in place before 2026-12-06, then a kill)
                log.warning(
                    "%s/%s cannot be read (%s): %s stays local (not committed remotely); "
                    "the next checkpoints are uploaded as usual",
                    local,
                    REMOTE_MANIFEST,
                    e,
                    local,
                )
        if d.uploader is not None:
            log.warning("node %d: uploading its part of %s, %s", d.topology.node, local, reason)
            d.uploader.enqueue(local, name, key, own_files(m), commit_tag(m))


def _say_not_expected(d: NodeDirectory, local: str, e: OSError) -> None:
    """Coordinator: the global manifest kept beside ``local`` cannot be read, so its remote
    commit is not expected; each node still uploads its part (only this rank knows)."""
    log.error(
        "node %d: %s cannot be read (%s: %s): %s is not committed remotely; each node uploads "
        "its part of it again, which stays in the store uncommitted (`resilient-ckpt gc DIR "
        "--remote URL` deletes such leftovers once 24 h old); its local copies stay on the "
        "nodes' disks under keep_last. Training goes on and its new checkpoints are "
        "committed as usual; to commit this one, make that file readable again (or restore "
        "it) and restart the job before its next remote commit: each restore expects it again",
        d.topology.node,
        os.path.join(d.dirpath, local, REMOTE_MANIFEST),
        type(e).__name__,
        e,
        local,
    )


def _this_layout(d: NodeDirectory, due: list[Any]) -> list[Any]:
    """Of the checkpoints a restart would upload again, those this node's part of which holds
    the ranks it runs now, in a world and node count as now: a part saved on another layout
    of nodes (4 nodes of one rank, now 2 of two) has other ranks' files, and the other parts
    of its checkpoint are on disks this run may not have, so its remote commit could never
    complete (it was tried, failed and held the newer commits back; the save of its step
    went under another name). It stays local, under the local retention."""
    topo, out, other = d.topology, [], []
    for x in due:
        m, node = x[1], x[1].extra.get("node") or {}
        same = m.world_size == topo.world_size and node.get("nodes") == len(topo.nodes)
        if same and list(node.get("ranks") or []) == list(topo.node_ranks):
            out.append(x)
        else:
            other.append(x[0])
    if other:
        log.warning(
            "not uploading %s again: saved on another layout of nodes (node %d's part holds "
            "other ranks' files than it runs now); it stays local and is not committed remotely",
            ", ".join(other),
            topo.node,
        )
    return out


def own_files(m: Manifest) -> list[FileEntry]:
    """What this node uploads of its part ``m``: the replicated files only from node 0."""
    return [f for f in m.files if not (is_shared(f.path) and f.rank != 0)]


def _not_superseded(d: NodeDirectory, due: list[Any]) -> list[Any]:
    """Of the checkpoints a restart would upload again, those the remote retention keeps
    (a backlog of uploads is not queued again only to be deleted remotely); the others
    stay local, under the local retention. Each leader plans from its disk; the
    coordinator's decision at the first save settles any difference between nodes."""
    policy = d.config.remote_retention_policy()
    if policy.keep_last is None or len(due) < 2:
        return due
    # an archive point under the remote policy it was written with is kept remotely forever,
    # also when this run has other options (remote_listing.retention_candidates)
    cands = [
        Candidate(n, m.step, m.seq, m.run_id, m.metrics, archived=archived(m), lineage=m.lineage)
        for n, m, _, _ in due
    ]
    keep = plan(cands, policy, d.run_id).keep
    skipped = [n for n, *_ in due if n not in keep]
    if skipped:
        log.info(
            "not uploading %s again: the remote retention (keep_last=%d) would delete %s "
            "once the newer checkpoints are committed",
            ", ".join(skipped),
            policy.keep_last,
            "it" if len(skipped) == 1 else "them",
        )
    return [x for x in due if x[0] in keep]
