"""A node leader's uploads of its node's files in node-local mode (:class:`NodeUploader`; the
remote commit that follows is :mod:`.remote_commit`'s).

Each node uploads only its own files, retried with backoff like :class:`~.sync.RemoteSync`,
checks them (size, and the MD5 ETag of objects up to 8 MiB) and reports ``{"key", "name"}``
to the coordinator. When uploads fall behind the saves, the coordinator decides at each save
which queued checkpoints no node uploads any more (:meth:`NodeUploader.settle`, from the
outcome that save broadcasts): each node takes them out of its queue, and removes the objects
it already uploaded of the ones the coordinator dropped (never committed remotely).

Before it puts anything under a name, a node marks it (:func:`~.remote_claims.claim_part`, the
mark every upload to a remote URL puts): another writer of that name (another run given the
same URL, a ``push``, a second process of this run) yields to the marks of this commit's parts,
which stay until the coordinator committed. A node that finds another writer's mark or
manifest there puts nothing and reports the name taken: the coordinator moves the commit to a
free name (:meth:`~.remote_commit.RemoteCommitter.take_moved`), and each node uploads its part
there again (:meth:`NodeUploader.settle`), so a committed remote checkpoint holds one run's
files only.

What the thread does with one part against the store (its upload under the node's mark, the
check of every object, the deletion of a dropped part) is :mod:`.node_transfer`'s.

Which ranks call what: a :class:`NodeUploader` on every node leader; nothing here is
collective.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import upload_wait
from .manifest import FileEntry
from .node_transfer import delete_part, upload_part
from .redact import url_text
from .remote import RemoteStore
from .upload_thread import UploadThread, backoff_s, by_grace

log = logging.getLogger("resilient_callbacks")

Key = tuple[str, int]  # (run id, commit number)


@dataclass
class UploadJob:
    local_name: str  # the checkpoint in this node's dirpath
    remote_name: str  # its name under the remote URL (the same on every node)
    key: tuple[str, int]  # (run id, commit number)
    files: list[FileEntry]  # what this node uploads
    # the coordinator dropped it while it was being uploaded: finish, then delete the objects
    dropped: bool = False
    cancelled: bool = False  # no longer to upload (dropped, or committed already)
    tag: str = ""  # which commit of its key (remote_claims.commit_tag): in its marks
    mark: str | None = None  # this node's mark under the name, once put
    taken: bool = False  # another writer has the name: nothing of this node's is there


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
        super().__init__("rc-node-upload", local_root)
        self.store, self.local_root, self.node = store, local_root, node
        # after each upload (this thread): the local retention, which keeps what is not uploaded
        self.on_uploaded = on_uploaded
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self.counters = UploadCounters()
        self._queue: list[UploadJob] = []
        self._reports: list[dict[str, Any]] = []
        self._current: UploadJob | None = None  # the job under way
        # uploaded, its remote commit not known yet: deleted if the coordinator drops it
        self._uploaded: dict[Key, UploadJob] = {}
        self._deletes: list[UploadJob] = []  # objects of dropped checkpoints, to delete
        # remote name -> why this node did not upload its part (for the coordinator's close)
        self.skipped: dict[str, str] = {}
        self.failing_since: float | None = None  # monotonic time of the first failure in a row
        self.failures_in_a_row = 0
        self._after_previous(store.key)  # (a stopped writer's attempt ends before this one's)
        self._start()

    def enqueue(
        self,
        local_name: str,
        remote_name: str,
        key: tuple[str, int],
        files: list[FileEntry],
        tag: str = "",
    ) -> None:
        with self._cond:
            if all(j.key != key for j in self._queue):
                self._queue.append(UploadJob(local_name, remote_name, key, files, tag=tag))
                self._cond.notify_all()

    def settle(
        self,
        upload: list[Key],
        dropped: list[Key],
        kept: list[Key] | None = None,
        moved: dict[Key, str] | None = None,
    ) -> None:
        """Leader, after each save's broadcast outcome: the coordinator's decision
        (:meth:`~.remote_commit.RemoteCommitter.drop_superseded`). ``upload``: the checkpoints
        still waiting for their remote commit; the queued ones not among them are not uploaded
        (superseded, or committed already), and so no longer held on the disk. ``dropped``: the
        ones the coordinator will never commit: the objects this node uploaded of them are
        deleted (by this thread). The job under way finishes first. ``kept``: those whose
        remote commit the coordinator gave up on (a later run commits them): this node's
        uploaded parts of them stay held, as do those of ``upload``. ``moved``: the checkpoints
        whose name another writer had (a node found its mark or manifest there), with the name
        the coordinator gave them instead: this node's part goes there (what it put under the
        old name is deleted; nothing, where it found the name taken)."""
        keep_keys, drop_keys = set(upload), set(dropped)
        with self._cond:
            for key, name in (moved or {}).items():
                self._move(key, name)
            queue = []
            for j in self._queue:
                if j.key in keep_keys:
                    queue.append(j)
                elif j is self._current:  # (dropped by an earlier settle: stays dropped)
                    j.cancelled, j.dropped = True, j.dropped or j.key in drop_keys
                    queue.append(j)
            self._queue = queue
            for k in drop_keys:
                done = self._uploaded.pop(k, None)
                if done is not None:
                    self._deletes.append(done)
            self._reports = [r for r in self._reports if _key(r) not in drop_keys]
            held = keep_keys | set(kept or [])
            self._uploaded = {k: j for k, j in self._uploaded.items() if k in held}
            self._cond.notify_all()

    def move(self, moved: dict[Key, str]) -> None:
        """Leader, at close: :meth:`settle`'s ``moved`` alone (no save follows)."""
        with self._cond:
            for key, name in moved.items():
                self._move(key, name)

    def _move(self, key: Key, name: str) -> None:
        """(Under the lock) :meth:`settle`'s ``moved``: upload ``key``'s part as ``name``."""
        jobs = [j for j in self._queue if j.key == key]
        old = self._uploaded.pop(key, None)
        for j in jobs:
            if j is self._current:  # finishes, then its objects go
                j.cancelled = j.dropped = True
            else:
                self._queue.remove(j)
        if old is not None and not old.taken:
            self._deletes.append(old)
        was = jobs[0] if jobs else old
        if was is not None and was.remote_name != name:
            job = UploadJob(was.local_name, name, key, was.files, tag=was.tag)
            self._queue.append(job)
            self._queue.sort(key=lambda j: j.key[1])
            self._cond.notify_all()

    def release(self, unsettled: list[Key]) -> None:
        """Leader, at close (the coordinator's last word, after its remote commits settled):
        this node's uploaded parts of the checkpoints not in ``unsettled`` (committed
        remotely, or dropped) are no longer held on the disk; the others stay (a later run
        with the same directories uploads and commits them)."""
        keep = set(unsettled)
        with self._cond:
            self._uploaded = {k: j for k, j in self._uploaded.items() if k in keep}

    def discard(self, job: UploadJob) -> None:
        """Leader, at a restart: ``job``'s checkpoint, never committed remotely, will not be
        uploaded again; delete what this node uploaded of it before the stop (this thread)."""
        with self._cond:
            self._deletes.append(job)
            self._cond.notify_all()

    def pending(self) -> list[str]:
        with self._cond:
            return [j.local_name for j in self._queue]

    def held(self) -> list[str]:
        """The local checkpoints the disk must keep: those queued; those uploaded whose remote
        commit the coordinator has not confirmed (a crash before it, while another node's part
        was still on its way: the next run uploads this node's part again, and the
        coordinator commits it; deleted, it could never be committed); and those whose
        uploaded objects are still to delete (a crash before that: the next run finds the
        local copy, and deletes them)."""
        with self._cond:
            jobs = self._queue + list(self._uploaded.values()) + self._deletes
            return [j.local_name for j in jobs]

    def stalled_s(self) -> float:
        """Seconds the transfer under way has moved no byte (0: none under way), or the
        previous writer's attempt this thread waits for (:meth:`_wait_previous`)."""
        p = self._progress
        return self._waited_stall_s() if p is None else time.monotonic() - p.last_update

    def left(self) -> dict[str, str]:
        """Remote name -> why this node's part of it is not uploaded: still queued (close gave
        up on it), or skipped (its local copy damaged or gone)."""
        why = f"last error: {self.counters.last_error or 'none, still uploading'}"
        with self._cond:
            out = dict(self.skipped)
            out.update({j.remote_name: f"its upload did not finish ({why})" for j in self._queue})
        return out

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
        uploads have failed (and none under way moves bytes), or the one under way has moved no
        byte, for ``outage_s`` seconds
        (close gives up on an outage, and on a store that accepted the connection and stopped
        answering), or past ``grace_left()`` (a preemption's time to the hard kill, less a
        margin to exit); at once once the thread was stopped (nothing more is uploaded)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._deletes:
                if self._stop:  # (a close nested in close(), a signal handler's, gave up on it)
                    return False
                deadline = by_grace(deadline, grace_left)
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                stalled = self.stalled_s()  # (an attempt moving bytes is let finish: no outage)
                outage = math.inf if outage_s is None else outage_s
                limit = max(outage, self._allowance_s())  # (a store counting per part)
                moving = self._progress is not None and stalled <= outage  # (as upload_wait)
                failing = 0.0 if moving else now - (self.failing_since or now)
                if failing > outage or stalled > limit:
                    return False
                look = upload_wait.LOOK_S  # (as close()'s wait in shared mode)
                self._cond.wait(look if deadline is None else min(look, deadline - now))
            return True

    def _run(self) -> None:
        if not self._wait_previous(self.store.url):
            return
        failures = 0
        while True:
            with self._cond:
                if not self._wait_for_work(lambda: self._queue or self._deletes):
                    return
                deletes = list(self._deletes)  # (held locally until deleted: held())
                job = self._current = self._queue[0] if self._queue else None
            done = []
            for gone in deletes:
                if self._stop:  # (close() gave up: another writer may own the store now)
                    break
                self._delete(gone)
                done.append(gone)
            if done:
                with self._cond:
                    self._deletes = [j for j in self._deletes if all(j is not d for d in done)]
                    self._cond.notify_all()  # wait() may be waiting for the deletes
            if job is None or self._stop:  # stopped during the deletes: no new attempt (it
                continue  # put the part under a name the next writer's retention deleted)
            if job.cancelled:  # while this thread waited out a failed attempt's backoff
                self._finished(job, delete=job.dropped)
                continue
            try:
                self._upload(job)
            except Exception as e:
                if job.cancelled:  # not to retry: the coordinator no longer wants it
                    self._finished(job, delete=job.dropped)
                    continue
                failures += 1
                self.failures_in_a_row = failures
                self.failing_since = self.failing_since or time.monotonic()
                self.counters.failures += 1
                self.counters.last_error = f"{type(e).__name__}: {url_text(str(e))}"
                if failures == 1 or failures % 10 == 0:
                    log.warning(
                        "remote %s: uploading node %d's part of %s failed (%d attempt(s)): "
                        "%s; kept locally, retrying with backoff",
                        self.store.url,
                        self.node,
                        job.local_name,
                        failures,
                        self.counters.last_error,
                    )
                with self._cond:
                    self._pause(backoff_s(failures, self.retry_base_s, self.retry_max_s))
                continue
            failures = self.failures_in_a_row = 0
            self.failing_since = None
            if self.on_uploaded is not None and not self._stop:  # (stopped: close() gave up
                # on it and released the directory, which another writer may own now)
                # while the job is still queued, so wait() has not returned: close() finds the
                # disk as retention leaves it (the job's own checkpoint, the newest uploaded,
                # stays protected until the next upload's turn)
                try:
                    self.on_uploaded()
                except Exception as e:
                    log.warning(
                        "local retention after an upload failed: %s: %s", type(e).__name__, e
                    )
            self._finished(job)

    def _finished(self, job: UploadJob, delete: bool = False) -> None:
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
            self._current = None
            if delete:
                self._deletes.append(job)
            self._cond.notify_all()

    def _delete(self, job: UploadJob) -> None:
        """This thread: :func:`~.node_transfer.delete_part`."""
        delete_part(self, job)

    def _upload(self, job: UploadJob) -> None:
        """This thread: :func:`~.node_transfer.upload_part` (one attempt)."""
        upload_part(self, job)


def _key(report: dict[str, Any]) -> Key:
    return (str(report["key"][0]), int(report["key"][1]))
