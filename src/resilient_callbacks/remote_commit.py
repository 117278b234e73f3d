"""The remote commit of a checkpoint written by several nodes (node-local mode).

Each node uploads only its own files (:class:`~.node_upload.NodeUploader`, one thread per node
leader) and reports ``{"key", "name"}``. The reports reach the coordinator through the gather
of the next save (or of close); the coordinator's :class:`RemoteCommitter` writes the global
manifest -- last, after listing every object it names with its size -- only once every node
reported, then applies the remote retention. So a remote manifest never names an object that is
missing or that a node has not verified; a crash at any point leaves at most uncommitted objects
under a name without a manifest (invisible to every reader, removed by ``gc --remote`` once a
day old).

When uploads fall behind the saves, the coordinator drops at each save the checkpoints waiting
for their upload that the remote retention would delete once the newer ones are committed
(:meth:`RemoteCommitter.drop_superseded`, as :class:`~.sync.RemoteSync` skips them in shared
mode): never the newest, never one whose parts all arrived, never the oldest still being
uploaded (so a slow node always finishes one, and the remote commits go on). A dropped
checkpoint is never committed remotely; the nodes learn it from the save's broadcast outcome.

Each node marks the name before it uploads its part (:mod:`.node_upload`); the coordinator
removes the commit's marks once its manifest is there. A node that found the name another
writer's reports it taken: the coordinator moves the commit to a free name, and the nodes learn
it, and upload their parts there, from the next save's broadcast outcome
(:meth:`RemoteCommitter.take_moved`).

Which ranks call what: a :class:`~.node_upload.NodeUploader` on every node leader, the
:class:`RemoteCommitter` on the coordinator only. Neither runs a collective.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import remote_blobs, remote_paths, upload_wait
from .catalog import archived
from .manifest import MANIFEST_NAME, Manifest
from .node_upload import Key, NodeUploader, UploadCounters, UploadJob
from .redact import url_text
from .remote import NO_MANIFEST, RemoteStore, retention_candidates
from .remote_claims import marks_of
from .remote_manifest import put_manifest
from .remote_objects import seq_floor
from .remote_owned import OwnCheckpoints, RestoredCopy
from .retention import Candidate, RetentionPolicy, plan
from .upload_thread import (
    UploadThread,
    backoff_s,
    by_grace,
    delete_checkpoint,
    retention_failed,
)

__all__ = ["Key", "NodeUploader", "PendingCommit", "RemoteCommitter", "UploadCounters", "UploadJob"]

log = logging.getLogger("resilient_callbacks")


@dataclass
class PendingCommit:
    name: str
    manifest: bytes
    local: str | None = None  # the coordinator's copy, which holds the global manifest
    done: set[int] = field(default_factory=set)
    tag: str = ""  # which commit of its key its nodes' marks name (remote_claims.commit_tag)
    _candidate: Candidate | None = field(default=None, repr=False, compare=False)

    def candidate(self) -> Candidate:
        """The checkpoint as a retention candidate (its manifest parsed once)."""
        if self._candidate is None:
            m = Manifest.from_json(json.loads(self.manifest), self.name)
            # an archive point when it was written is kept, whatever the options of the run
            # that commits it now (remote_listing.retention_candidates)
            self._candidate = Candidate(
                self.name, m.step, m.seq, m.run_id, m.metrics, archived=archived(m),
                lineage=m.lineage,
            )  # fmt: skip
        return self._candidate


class RemoteCommitter(UploadThread):
    """The coordinator's table of checkpoints waiting for their nodes' uploads, and the thread
    that commits them remotely (manifest last) and applies the remote retention."""

    def __init__(
        self,
        store: RemoteStore,
        nodes: int,
        policy: RetentionPolicy,
        *,
        max_attempts: int = 5,
        retry_base_s: float = 1.0,
        held: RestoredCopy | None = None,
        writer: str = "",
        on_committed: Callable[[PendingCommit], None] | None = None,
    ) -> None:
        super().__init__("rc-remote-commit", writer)
        self.store, self.nodes, self.policy = store, nodes, policy
        self.on_committed = on_committed  # (this thread, after each remote commit: recorded)
        self.max_attempts, self.retry_base_s = max_attempts, retry_base_s
        self.index: dict[tuple[str, int], str] = {}  # committed remotely: key -> name
        # every name listed with a manifest, also one that cannot be read or is damaged: no
        # new commit takes it (its files would overwrite a copy maybe only briefly unreadable)
        self.listed: set[str] = set()
        self.committed = 0
        self.abandoned: list[str] = []  # gave up after max_attempts: local only, named at close
        self.abandoned_why: dict[str, str] = {}  # (their last error: a later success clears
        # last_error, and close() names why each was given up)
        self._kept: list[str] = []  # the coordinator's copies of those: a later run commits them
        self._abandoned_keys: list[Key] = []  # (their keys: every node keeps its part)
        self._pending: dict[tuple[str, int], PendingCommit] = {}
        self._ready: list[tuple[str, int]] = []
        self._busy = False
        self.dropped: set[str] = set()  # names dropped (never reused: a node may still delete)
        # what the remote retention may count and delete; ``held``: the key it keeps
        self.own = OwnCheckpoints(store.url, held)
        self._moved: dict[Key, str] = {}  # name taken by another writer: key -> its new name
        # monotonic times: the first failed attempt since the last success, and the start of
        # the attempt under way (a commit lists and puts one small object: one that runs for
        # minutes is a store that accepted the connection and stopped answering)
        self.failing_since: float | None = None
        self.attempt_since: float | None = None
        self.last_error: str | None = None
        self._after_previous(store.key)
        self._start()

    # ------------------------------------------------------------------ the table

    def refresh_max_seq(self) -> int:
        """List the store (once, at open): the committed checkpoints, and the highest commit
        number there, also of a manifest this version refuses (new commits number after it)."""
        entries = self.store.scan()
        self.own.opened(entries)
        with self._cond:
            self.index = {e.key: e.name for e in entries if e.key is not None}
            self.listed = {e.name for e in entries if e.problem != NO_MANIFEST}
        return seq_floor(self.store.url, entries)

    def free_name(self, name: str) -> str:
        """``name`` unless a committed or pending remote checkpoint has it, or one whose manifest
        cannot be read: then ``name-rN``."""
        with self._cond:
            return self._free(name)

    def _free(self, name: str) -> str:
        taken = set(self.index.values()) | {p.name for p in self._pending.values()}
        taken |= self.dropped | self.listed
        candidate, n = name, 0
        while candidate in taken:
            n += 1
            candidate = f"{name}-r{n}"
        return candidate

    def expect(
        self,
        key: tuple[str, int],
        name: str,
        manifest: bytes,
        local: str | None = None,
        tag: str = "",
    ) -> None:
        """A checkpoint committed on every node: commit it remotely once each node's part is
        uploaded. ``local``: the name of the coordinator's copy, kept until then
        (:meth:`held_locally`). ``tag``: the one its nodes' marks carry."""
        with self._cond:
            if key not in self.index:
                self._pending.setdefault(key, PendingCommit(name, manifest, local, tag=tag))

    def take_moved(self) -> dict[Key, str]:
        """The checkpoints moved to another name since the last call (a node found theirs
        another writer's): each node uploads its part there (:meth:`NodeUploader.settle`)."""
        with self._cond:
            out, self._moved = self._moved, {}
        return out

    def drop_superseded(self) -> tuple[list[Key], list[Key]]:
        """Coordinator, at each save (after :meth:`expect` of its checkpoint): drop the
        checkpoints waiting for their nodes' uploads that the remote retention would delete
        once the newer ones are committed, as shared mode skips them. Never the newest, never
        one whose parts all arrived (:meth:`ready`), never the oldest still being uploaded: a
        slow node finishes that one, so remote commits go on however far behind it is. Returns
        the keys still to upload (every node drops the others from its queue) and the dropped
        ones (each node deletes the objects it uploaded of them; none is ever committed)."""
        with self._cond:
            keys = sorted(self._pending, key=lambda k: k[1])
            if self.policy.keep_last is None or len(keys) < 2:
                return keys, []
            waiting = [k for k in keys if k not in self._ready]
            protect = set(self._ready) | {keys[-1]} | set(waiting[:1])
            cands = {k: self._pending[k].candidate() for k in keys}
            keep = plan(
                cands.values(),
                self.policy,
                cands[keys[-1]].run_id,
                protected=[cands[k].name for k in protect],
            ).keep
            dropped = [k for k in keys if k not in protect and cands[k].name not in keep]
            for k in dropped:
                self.dropped.add(self._pending.pop(k).name)
            left = [k for k in keys if k not in dropped]
        if dropped:
            log.info(
                "remote: uploads are behind; not uploading %s (the remote retention would "
                "delete %s once the newer checkpoints are committed); each node removes what "
                "it uploaded of %s already",
                ", ".join(cands[k].name for k in dropped),
                "it" if len(dropped) == 1 else "them",
                "it" if len(dropped) == 1 else "them",
            )
        return left, dropped

    def held_locally(self) -> list[str]:
        """The coordinator's copies that local retention must keep: those of the checkpoints
        not committed remotely yet. Each holds the global manifest, the only record of it
        across a crash: without it a later run uploads the nodes' parts again but cannot
        commit them."""
        with self._cond:
            return [p.local for p in self._pending.values() if p.local] + list(self._kept)

    def abandoned_keys(self) -> list[Key]:
        """The checkpoints whose remote commit was given up: every node keeps its part."""
        with self._cond:
            return list(self._abandoned_keys)

    def unsettled(self) -> list[Key]:
        """The checkpoints neither committed remotely nor dropped: waiting for their parts or
        their commit, or given up (a later run commits them). The nodes keep their parts of
        these; of any other they uploaded, their retention decides."""
        with self._cond:
            return sorted(set(self._pending) | set(self._abandoned_keys), key=lambda k: k[1])

    def report(self, node: int, rep: dict[str, Any]) -> None:
        """Node ``node`` uploaded its part of ``rep['key']`` under ``rep['name']``."""
        key = (str(rep["key"][0]), int(rep["key"][1]))
        with self._cond:
            p = self._pending.get(key)
            if p is None or p.name != rep["name"]:
                return  # not ours to commit (an earlier run's), or renamed since
            if rep.get("committed"):  # a node found it committed there (a restart that could
                if key not in self._ready:  # not list the store uploaded it again)
                    self._pending.pop(key)
                    self.index[key] = p.name
                    self._cond.notify_all()
                return
            if rep.get("taken"):  # another writer has the name: every node uploads elsewhere
                self.dropped.add(p.name)  # (never reused: its marks may stay)
                base = re.sub(r"-r\d+$", "", p.name)
                self._pending.pop(key)
                p.name, p.done, p._candidate = self._free(base), set(), None
                self._pending[key] = p
                self._moved[key] = p.name
                log.warning(
                    "remote: %s is another writer's; node %d's part went nowhere; the "
                    "checkpoint is uploaded as %s",
                    rep["name"],
                    node,
                    p.name,
                )
                return
            p.done.add(node)
            if len(p.done) == self.nodes and key not in self._ready:
                self._ready.append(key)
                self._cond.notify_all()

    def waiting(self) -> list[str]:
        with self._cond:
            return [p.name for p in self._pending.values()]

    def missing(self) -> dict[str, list[int]]:
        """The waiting checkpoints whose parts did not all arrive: name -> the nodes whose
        part is missing."""
        with self._cond:
            return {
                p.name: [n for n in range(self.nodes) if n not in p.done]
                for k, p in self._pending.items()
                if k not in self._ready
            }

    def superseded(self) -> list[str]:
        """The waiting checkpoints older than one of their run committed remotely (a part
        never to arrive, its local copy damaged): missing them leaves the newest durable."""
        with self._cond:
            newest: dict[str, int] = {}
            for run_id, seq in self.index:
                newest[run_id] = max(seq, newest.get(run_id, seq))
            return [p.name for k, p in self._pending.items() if k[1] < newest.get(k[0], -1)]

    def given_up(self) -> list[str]:
        """The checkpoints whose remote commit was given up, less those older than one of
        their run committed remotely since (a blip mid-training: the newest is durable)."""
        with self._cond:
            newest: dict[str, int] = {}
            for run_id, seq in self.index:
                newest[run_id] = max(seq, newest.get(run_id, seq))
            pairs = zip(self.abandoned, self._abandoned_keys, strict=True)
            return [n for n, k in pairs if k[1] > newest.get(k[0], -1)]

    def ready(self) -> list[str]:
        """The checkpoints whose parts all arrived, not committed yet (being tried, or next)."""
        with self._cond:
            return [self._pending[k].name for k in self._ready if k in self._pending]

    def stuck_s(self) -> float:
        """Seconds the commits have failed in a row, or the attempt under way has not
        returned, whichever is longer (0: the store answers)."""
        now = time.monotonic()
        stuck = max(now - (self.failing_since or now), now - (self.attempt_since or now))
        return max(stuck, self._waited_stall_s())  # (waiting for the previous writer's)

    def wait(
        self,
        timeout: float | None = None,
        outage_s: float | None = None,
        grace_left: Callable[[], float | None] | None = None,
    ) -> bool:
        """Until every checkpoint whose parts all arrived is committed; True if nothing is left
        waiting (for a node's part, either). False once ``timeout`` passed, once the commits
        have failed or hung for ``outage_s`` (:meth:`stuck_s`), or past ``grace_left()`` (a
        preemption's time to the hard kill, less a margin to exit); at once once the thread
        was stopped (nothing more is committed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._ready or self._busy:
                if self._stop:  # (a close nested in close(), a signal handler's, gave up on it)
                    return False
                deadline = by_grace(deadline, grace_left)
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if outage_s is not None and self.stuck_s() > outage_s:
                    return False
                look = upload_wait.LOOK_S  # (as close()'s wait in shared mode)
                self._cond.wait(look if deadline is None else min(look, deadline - now))
            return not self._pending

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        prevs = self._previous  # (as RemoteSync's: what they committed late counts as its own)
        if not self._wait_previous(self.store.url):
            return
        for prev in prevs:
            own = getattr(prev, "own", None)  # (a RemoteSync's too; a NodeUploader has none)
            if prev._stop and isinstance(own, OwnCheckpoints):  # (ended)
                self.own.took_over(own)
        while True:
            with self._cond:
                if not self._wait_for_work(lambda: self._ready):
                    return
                key = self._ready[0]
                p = self._pending[key]
                self._busy = True
            ok = False
            for attempt in range(self.max_attempts):
                self.attempt_since = time.monotonic()
                try:
                    self.commit_one(p)
                    ok = True
                    self.failing_since = self.attempt_since = self.last_error = None
                    break
                except Exception as e:
                    self.failing_since = self.failing_since or self.attempt_since
                    self.attempt_since = None
                    self.last_error = f"{type(e).__name__}: {url_text(str(e))}"
                    log.warning(
                        "remote commit of %s failed (attempt %d of %d): %s: %s",
                        p.name,
                        attempt + 1,
                        self.max_attempts,
                        type(e).__name__,
                        e,
                    )
                    with self._cond:
                        if self._pause(backoff_s(attempt + 1, self.retry_base_s, jitter=False)):
                            break
            if not ok:
                log.error(
                    "remote commit of %s given up after %d attempts: it stays on the nodes' "
                    "disks only (a later run with the same directories commits it)",
                    p.name,
                    self.max_attempts,
                )
            # recorded before the commit counts as done: a wait (close()) returns only once
            # the record is written, so a process that exits then has it
            if ok and self.on_committed is not None:
                try:
                    self.on_committed(p)
                except Exception as e:  # (a record: never a reason for the commits to stop)
                    log.warning("could not record the remote commit of %s: %s", p.name, e)
            with self._cond:
                self._ready.remove(key)
                self._pending.pop(key, None)
                if ok:
                    self.index[key] = p.name
                    self.own.wrote(p.name, key)
                    self.committed += 1
                else:
                    self.abandoned.append(p.name)
                    self.abandoned_why[p.name] = self.last_error or "none recorded"
                    self._abandoned_keys.append(key)
                    self._kept += [p.local] if p.local else []
                self._busy = False
                self._cond.notify_all()
            if ok and not self._stop:  # (stopped: close() gave up on this commit and
                self._retention(p.name, key[0])  # released the store: it deletes nothing)

    def commit_one(self, p: PendingCommit) -> None:
        """List the objects under the name; every file of the manifest must be there with its
        size; then put the manifest (the commit point)."""
        st = self.store
        m = Manifest.from_json(json.loads(p.manifest), f"{st.url}/{p.name}")
        log.info("committing %s/%s remotely: checking its %d objects", st.url, p.name, len(m.files))
        st.fs.invalidate_cache()
        base = posixpath.join(st.root, p.name)
        listing = st.fs.find(base, detail=True)
        sizes = {
            st.fs._strip_protocol(k)[len(st.fs._strip_protocol(base)) + 1 :]: int(
                v.get("size") or 0
            )
            for k, v in listing.items()
        }
        for f in m.files:
            if sizes.get(f.path) != f.size:
                raise OSError(
                    f"{st.url}/{p.name}/{f.path}: {sizes.get(f.path)} bytes remotely, the "
                    f"manifest says {f.size}; not committing"
                )
        self.own.trying(p.name, m)  # (committed also if the answer is lost: its own)
        put_manifest(st, posixpath.join(base, MANIFEST_NAME), p.manifest)
        marks = marks_of(sizes, (m.run_id, m.seq), p.tag)  # (the nodes': committed now)
        if marks:  # (one a failed delete leaves is a few bytes; gc removes it with the folder)
            with contextlib.suppress(Exception):
                remote_paths.rm(st.fs, [posixpath.join(base, x) for x in marks])
        log.info("committed %s/%s remotely (%d nodes' parts)", st.url, p.name, self.nodes)

    def _retention(self, protect: str, run: str) -> None:
        """The remote retention of run ``run``, after its commit of ``protect``."""
        try:
            entries = self.store.scan()
            self.own.opened(entries)  # (the first listing, when the store was down at open)
            self._refusals.prune({e.name for e in entries})  # (gone: deleted by another)
            with self._cond:
                self.index = {e.key: e.name for e in entries if e.key is not None}
                self.listed = {e.name for e in entries if e.problem != NO_MANIFEST}
                names_pending = {x.name for x in self._pending.values()}
            mine = self.own.mine(entries, run)  # (not another live process's)
            keep = self.own.protected(mine, protect)
            p = plan(retention_candidates(mine), self.policy, run, protected=keep)
            gone: set[str] = set()  # (not one refused, or waiting out its refusal)
            for name in p.delete:
                if name in names_pending:
                    continue
                if not delete_checkpoint(self, self.store, name, "remote retention: deleted"):
                    continue  # (its manifest refused: still committed and whole)
                gone.add(name)
                with self._cond:
                    self.index = {k: v for k, v in self.index.items() if v != name}
                self.own.deleted(name)
            # the blobs of the incremental checkpoints deleted (a shared-dirpath run's, this
            # run resumed from) that no remaining one names: else kept for ever
            if any(e.manifest is not None and e.manifest.blobs for e in mine if e.name in gone):
                remote_blobs.collect(self.store)
        except Exception as e:
            retention_failed(self, self.store.url, e)
