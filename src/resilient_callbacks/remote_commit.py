"""The remote commit of a checkpoint written by several nodes (node-local mode).

Each node uploads only its own files (:class:`NodeUploader`, one thread per node leader, retried
with backoff like :class:`~.sync.RemoteSync`), checks them (size, and the MD5 ETag of objects up
to 8 MiB) and reports ``{"key", "name"}``. The reports reach the coordinator through the gather
of the next save (or of close); the coordinator's :class:`RemoteCommitter` writes the global
manifest -- last, after listing every object it names with its size -- only once every node
reported, then applies the remote retention. So a remote manifest never names an object that is
missing or that a node has not verified; a crash at any point leaves at most uncommitted objects
under a name without a manifest (invisible to every reader, removed by ``gc --remote`` once a
day old).

Which ranks call what: a :class:`NodeUploader` on every node leader, the :class:`RemoteCommitter`
on the coordinator only. Neither runs a collective.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .catalog import verify_entries
from .errors import CheckpointCorruptError
from .manifest import MANIFEST_NAME, FileEntry, Manifest
from .progress import Progress
from .redact import url_text
from .remote import ETAG_CHECK_MAX, RemoteStore, retention_candidates
from .remote_objects import md5
from .retention import RetentionPolicy, plan
from .upload_thread import EXIT_MARGIN_S, UploadThread, backoff_s

log = logging.getLogger("resilient_callbacks")


def _by_grace(
    deadline: float | None, grace_left: Callable[[], float | None] | None
) -> float | None:
    """``deadline`` (monotonic), brought forward to a preemption's hard kill less a margin to
    exit, once ``grace_left()`` says one is coming."""
    grace = grace_left() if grace_left is not None else None
    if grace is None:
        return deadline
    by = time.monotonic() + max(0.0, grace - EXIT_MARGIN_S)
    return by if deadline is None else min(deadline, by)


@dataclass
class UploadJob:
    local_name: str  # the checkpoint in this node's dirpath
    remote_name: str  # its name under the remote URL (the same on every node)
    key: tuple[str, int]  # (run id, commit number)
    files: list[FileEntry]  # what this node uploads


@dataclass
class UploadCounters:
    files: int = 0
    bytes: int = 0
    checkpoints: int = 0
    seconds: float = 0.0  # spent in successful uploads
    failures: int = 0
    last_error: str | None = None


class NodeUploader(UploadThread):
    """A node leader's background uploads of its node's files; finished ones are reported
    through :meth:`take_reports`."""

    def __init__(
        self,
        store: RemoteStore,
        local_root: str,
        node: int,
        *,
        retry_base_s: float = 1.0,
        retry_max_s: float = 60.0,
        on_uploaded: Callable[[], None] | None = None,
    ) -> None:
        super().__init__("rc-node-upload")
        self.store, self.local_root, self.node = store, local_root, node
        # after each upload (this thread): the local retention, which keeps what is not uploaded
        self.on_uploaded = on_uploaded
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self.counters = UploadCounters()
        self._queue: list[UploadJob] = []
        self._reports: list[dict[str, Any]] = []
        self.failing_since: float | None = None  # monotonic time of the first failure in a row
        self.failures_in_a_row = 0
        self._progress: Progress | None = None  # of the transfer under way
        self._start()

    def enqueue(
        self, local_name: str, remote_name: str, key: tuple[str, int], files: list[FileEntry]
    ) -> None:
        with self._cond:
            if all(j.key != key for j in self._queue):
                self._queue.append(UploadJob(local_name, remote_name, key, files))
                self._cond.notify_all()

    def pending(self) -> list[str]:
        with self._cond:
            return [j.local_name for j in self._queue]

    def stalled_s(self) -> float:
        """Seconds the transfer under way has moved no byte (0: none under way)."""
        p = self._progress
        return 0.0 if p is None else time.monotonic() - p.last_update

    def take_reports(self) -> list[dict[str, Any]]:
        """The uploads finished since the last call (for the coordinator)."""
        with self._cond:
            out, self._reports = self._reports, []
        return out

    def wait(
        self,
        timeout: float | None = None,
        outage_s: float | None = None,
        grace_left: Callable[[], float | None] | None = None,
    ) -> bool:
        """Block until every queued upload is done; False if ``timeout`` passed first, once
        uploads have failed, or the one under way has moved no byte, for ``outage_s`` seconds
        (close gives up on an outage, and on a store that accepted the connection and stopped
        answering), or past ``grace_left()`` (a preemption's time to the hard kill, less a
        margin to exit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue:
                deadline = _by_grace(deadline, grace_left)
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                failing = now - (self.failing_since or now)
                if outage_s is not None and max(failing, self.stalled_s()) > outage_s:
                    return False
                self._cond.wait(1.0 if deadline is None else min(1.0, deadline - now))
            return True

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                if not self._wait_for_work(lambda: self._queue):
                    return
                job = self._queue[0]
            try:
                self._upload(job)
            except Exception as e:
                failures += 1
                self.failures_in_a_row = failures
                self.failing_since = self.failing_since or time.monotonic()
                self.counters.failures += 1
                self.counters.last_error = f"{type(e).__name__}: {url_text(str(e))}"
                if failures == 1 or failures % 10 == 0:
                    log.warning(
                        "remote %s: uploading this node's part of %s failed (%d attempt(s)): "
                        "%s; kept locally, retrying with backoff",
                        self.store.url,
                        job.local_name,
                        failures,
                        self.counters.last_error,
                    )
                with self._cond:
                    self._pause(backoff_s(failures, self.retry_base_s, self.retry_max_s))
                continue
            failures = self.failures_in_a_row = 0
            self.failing_since = None
            if self.on_uploaded is not None:
                # while the job is still queued, so wait() has not returned: close() finds the
                # disk as retention leaves it (the job's own checkpoint, the newest uploaded,
                # stays protected until the next upload's turn)
                try:
                    self.on_uploaded()
                except Exception as e:
                    log.warning(
                        "local retention after an upload failed: %s: %s", type(e).__name__, e
                    )
            with self._cond:
                if job in self._queue:
                    self._queue.remove(job)
                self._cond.notify_all()

    def _check(self, local: str, job: UploadJob, rpaths: list[str]) -> None:
        """Each uploaded object of this node: its size, and its MD5 ETag where the store gives
        one (single-part objects up to 8 MiB). One HEAD per object: O(own files) requests per
        node, never a listing of the whole checkpoint (which would be O(N) per node)."""
        st = self.store
        for f, rpath in zip(job.files, rpaths, strict=True):
            # refresh: s3fs would answer from a cached listing of the parent, which the
            # coordinator's committer thread (the same filesystem object) may have taken
            # while this node's files were still being uploaded: a spurious "not found"
            info = st.fs.info(rpath, refresh=True)
            where = f"{st.url}/{job.remote_name}/{f.path}"
            if int(info.get("size") or 0) != f.size:
                raise OSError(f"{where}: {info.get('size')} bytes after upload, expected {f.size}")
            etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
            if etag and "-" not in etag and len(etag) == 32 and f.size <= ETAG_CHECK_MAX:
                digest = md5(os.path.join(local, f.path))
                if digest != etag:
                    raise OSError(f"{where}: ETag {etag} does not match the local MD5 {digest}")

    def _upload(self, job: UploadJob) -> None:
        local = os.path.join(self.local_root, job.local_name)
        if not os.path.isdir(local):
            log.warning("remote: %s was removed locally before it was uploaded", job.local_name)
            return
        try:  # the committed bytes, or nothing goes up: never a rotten file made durable
            verify_entries(local, job.files)
        except CheckpointCorruptError as e:
            log.error(
                "remote: not uploading node %d's part of %s, its local copy is damaged: %s; "
                "it is not committed remotely",
                self.node,
                job.local_name,
                e,
            )
            return
        st = self.store
        t0 = time.perf_counter()
        log.info(
            "uploading node %d's part of %s (%d files) to %s",
            self.node,
            job.local_name,
            len(job.files),
            st.url,
        )
        rpaths = [posixpath.join(st.root, job.remote_name, f.path) for f in job.files]
        if st.is_local:
            for p in {posixpath.dirname(x) for x in rpaths}:
                st.fs.makedirs(p, exist_ok=True)
        progress = Progress(
            sum(f.size for f in job.files),
            f"uploading node {self.node}'s part of {job.local_name} to {st.url}",
            bar=False,
            log_every_s=30.0,
        )
        self._progress = progress  # its last byte's time: wait() tells a stalled store
        try:
            lpaths = [os.path.join(local, f.path) for f in job.files]
            st.fs.put(lpaths, rpaths, callback=progress.multi_callback())
            self._check(local, job, rpaths)
        finally:
            self._progress = None
            progress.close()
        if st.is_local:
            st._fsync_local(rpaths)
        with self._cond:
            self._reports.append({"key": list(job.key), "name": job.remote_name})
            self.counters.files += len(job.files)
            self.counters.bytes += sum(f.size for f in job.files)
            self.counters.checkpoints += 1
            self.counters.seconds += time.perf_counter() - t0
        log.info("uploaded node %d's part of %s to %s", self.node, job.local_name, st.url)


@dataclass
class PendingCommit:
    name: str
    manifest: bytes
    local: str | None = None  # the coordinator's copy, which holds the global manifest
    done: set[int] = field(default_factory=set)


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
    ) -> None:
        super().__init__("rc-remote-commit")
        self.store, self.nodes, self.policy = store, nodes, policy
        self.max_attempts, self.retry_base_s = max_attempts, retry_base_s
        self.index: dict[tuple[str, int], str] = {}  # committed remotely: key -> name
        self.committed = 0
        self.abandoned: list[str] = []  # gave up after max_attempts: local only, named at close
        self._kept: list[str] = []  # the coordinator's copies of those: a later run commits them
        self._pending: dict[tuple[str, int], PendingCommit] = {}
        self._ready: list[tuple[str, int]] = []
        self._busy = False
        # monotonic times: the first failed attempt since the last success, and the start of
        # the attempt under way (a commit lists and puts one small object: one that runs for
        # minutes is a store that accepted the connection and stopped answering)
        self.failing_since: float | None = None
        self.attempt_since: float | None = None
        self.last_error: str | None = None
        self._start()

    # ------------------------------------------------------------------ the table

    def refresh_max_seq(self) -> int:
        """List the store (once, at open): the committed checkpoints, and the highest commit
        number there (new commits number after it)."""
        entries = self.store.scan()
        with self._cond:
            self.index = {e.key: e.name for e in entries if e.key is not None}
        return max((k[1] for k in self.index), default=0)

    def free_name(self, name: str) -> str:
        """``name`` unless a committed or pending remote checkpoint has it: then ``name-rN``."""
        with self._cond:
            taken = set(self.index.values()) | {p.name for p in self._pending.values()}
        candidate, n = name, 0
        while candidate in taken:
            n += 1
            candidate = f"{name}-r{n}"
        return candidate

    def expect(
        self, key: tuple[str, int], name: str, manifest: bytes, local: str | None = None
    ) -> None:
        """A checkpoint committed on every node: commit it remotely once each node's part is
        uploaded. ``local``: the name of the coordinator's copy, kept until then
        (:meth:`held_locally`)."""
        with self._cond:
            if key not in self.index:
                self._pending.setdefault(key, PendingCommit(name, manifest, local))

    def held_locally(self) -> list[str]:
        """The coordinator's copies that local retention must keep: those of the checkpoints
        not committed remotely yet. Each holds the global manifest, the only record of it
        across a crash: without it a later run uploads the nodes' parts again but cannot
        commit them."""
        with self._cond:
            return [p.local for p in self._pending.values() if p.local] + list(self._kept)

    def report(self, node: int, rep: dict[str, Any]) -> None:
        """Node ``node`` uploaded its part of ``rep['key']`` under ``rep['name']``."""
        key = (str(rep["key"][0]), int(rep["key"][1]))
        with self._cond:
            p = self._pending.get(key)
            if p is None or p.name != rep["name"]:
                return  # not ours to commit (an earlier run's), or renamed since
            p.done.add(node)
            if len(p.done) == self.nodes and key not in self._ready:
                self._ready.append(key)
                self._cond.notify_all()

    def waiting(self) -> list[str]:
        with self._cond:
            return [p.name for p in self._pending.values()]

    def ready(self) -> list[str]:
        """The checkpoints whose parts all arrived, not committed yet (being tried, or next)."""
        with self._cond:
            return [self._pending[k].name for k in self._ready if k in self._pending]

    def stuck_s(self) -> float:
        """Seconds the commits have failed in a row, or the attempt under way has not
        returned, whichever is longer (0: the store answers)."""
        now = time.monotonic()
        return max(now - (self.failing_since or now), now - (self.attempt_since or now))

    def wait(
        self,
        timeout: float | None = None,
        outage_s: float | None = None,
        grace_left: Callable[[], float | None] | None = None,
    ) -> bool:
        """Until every checkpoint whose parts all arrived is committed; True if nothing is left
        waiting (for a node's part, either). False once ``timeout`` passed, once the commits
        have failed or hung for ``outage_s`` (:meth:`stuck_s`), or past ``grace_left()`` (a
        preemption's time to the hard kill, less a margin to exit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._ready or self._busy:
                deadline = _by_grace(deadline, grace_left)
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if outage_s is not None and self.stuck_s() > outage_s:
                    return False
                self._cond.wait(1.0 if deadline is None else min(1.0, deadline - now))
            return not self._pending

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
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
            with self._cond:
                self._ready.remove(key)
                self._pending.pop(key, None)
                if ok:
                    self.index[key] = p.name
                    self.committed += 1
                else:
                    self.abandoned.append(p.name)
                    self._kept += [p.local] if p.local else []
                self._busy = False
                self._cond.notify_all()
            if ok:
                self._retention(p.name)

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
        st.fs.pipe_file(posixpath.join(base, MANIFEST_NAME), p.manifest)
        if st.is_local:
            st._fsync_local([posixpath.join(base, MANIFEST_NAME)])
        log.info("committed %s/%s remotely (%d nodes' parts)", st.url, p.name, self.nodes)

    def _retention(self, protect: str) -> None:
        try:
            entries = self.store.scan()
            with self._cond:
                self.index = {e.key: e.name for e in entries if e.key is not None}
                names_pending = {x.name for x in self._pending.values()}
            newest = max((e.manifest for e in entries if e.manifest), key=lambda m: m.seq)
            p = plan(retention_candidates(entries), self.policy, newest.run_id, protected=[protect])
            for name in p.delete:
                if name in names_pending:
                    continue
                self.store.delete(name)
                with self._cond:
                    self.index = {k: v for k, v in self.index.items() if v != name}
                log.info("remote retention: deleted %s/%s", self.store.url, name)
        except Exception as e:
            log.warning("remote retention on %s failed: %s", self.store.url, url_text(str(e)))
