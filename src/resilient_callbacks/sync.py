"""Background upload of committed local checkpoints to the remote store, with retries.

One thread uploads the queued checkpoints in commit order. A failed upload is retried with
exponential backoff and full jitter (``retry_base_s`` doubling up to ``retry_max_s``) for as long
as it takes: an outage of the store is reported (a warning with the backlog, repeated at most
every ``warn_every_s``) while training goes on, and the backlog uploads when the store returns.
After each upload the remote retention policy runs, then ``after_upload`` (the Checkpointer's
local retention: a local checkpoint is deletable only once its remote copy is committed, or
once the uploader skipped it), which also runs when queued checkpoints are skipped.

Which ranks call what: only the coordinator has a RemoteSync.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import remote_blobs
from .catalog import Depth, archived, verify
from .errors import CheckpointCorruptError
from .manifest import Manifest, read_manifest
from .progress import Progress
from .redact import url_text
from .remote import (
    NO_MANIFEST,
    STALE_UPLOAD_S,
    RemoteEntry,
    RemoteStore,
    retention_candidates,
)
from .remote_claims import REMOTE_CKPT_RE, UNREADABLE, RemoteNameTaken, free_name
from .remote_objects import seq_floor
from .remote_owned import OwnCheckpoints, RestoredCopy
from .retention import Candidate, RetentionPolicy, plan
from .upload_thread import UploadThread, backoff_s, delete_checkpoint, retention_failed

SWEEP_EVERY_S = 3600.0  # keeping every checkpoint, cut-off uploads are looked for this often

log = logging.getLogger("resilient_callbacks")


@dataclass
class SyncStatus:
    pending: list[str]  # local checkpoint names not yet committed remotely, oldest first
    uploading: str | None
    failures: int  # consecutive failed attempts (0 when the store answers)
    last_error: str | None
    uploaded: int  # checkpoints uploaded by this process
    uploaded_bytes: int
    upload_seconds: float
    stalled_s: float = 0.0  # seconds the upload under way has moved no byte (0: none under way)
    # seconds it may move no counted byte and still be moving (its store counts per part)
    stall_allowance_s: float = 0.0
    # waiting for the upload of the previous writer of the store in this process to end
    waits_previous: bool = False


class RemoteSync(UploadThread):
    def __init__(
        self,
        store: RemoteStore,
        local_root: str,
        policy: RetentionPolicy,
        after_upload: Callable[[], None] | None = None,
        *,
        on_uploaded: Callable[[Manifest, str, float], None] | None = None,
        held: RestoredCopy | None = None,
        retry_base_s: float = 1.0,
        retry_max_s: float = 60.0,
        warn_every_s: float = 60.0,
    ) -> None:
        super().__init__("rc-upload", local_root)
        self.store = store
        self.local_root = local_root
        self.policy = policy
        self.after_upload = after_upload
        self.on_uploaded = on_uploaded  # (manifest, local name, seconds): each upload done
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self.warn_every_s = warn_every_s
        self.index: dict[tuple[str, int], str] = {}  # (run_id, seq) -> remote name
        # remote names never free: a manifest that cannot be read, or another process's commit
        # with a key of this run's (two processes resumed the run from this URL)
        self.unfree: set[str] = set()
        self._copies: dict[tuple[str, int], Any] = {}  # key -> the remote copy's files, blobs
        # what the remote retention may count and delete; ``held``: the key it keeps
        self.own = OwnCheckpoints(store.url, held)
        self.show_progress = False
        self._queue: list[str] = []
        self._remote_entries: list[RemoteEntry] = []
        self._current: str | None = None
        self._failures = 0
        self._last_error: str | None = None
        self._last_warn = 0.0
        self._uploaded = 0
        self._uploaded_bytes = 0
        self._upload_seconds = 0.0
        self._last_sweep: float | None = None  # when cut-off uploads were last looked for
        self._after_previous(store.key)
        self._start()

    # ------------------------------------------------------------------ queries

    def refresh(self) -> list[RemoteEntry]:
        """List the remote store and rebuild the index of committed remote checkpoints."""
        entries = self.store.scan()
        found = {e.key: e.name for e in entries if e.key is not None and e.problem is None}
        unread = {e.name for e in entries if e.manifest is None and e.problem != NO_MANIFEST}
        copies = {(m.run_id, m.seq): (m.files, m.blobs) for e in entries if (m := e.manifest)}
        self.own.opened(entries)  # (the first listing: at open)
        with self._cond:
            self.index, self.unfree, self._copies = found, unread, copies
            self._remote_entries = entries
        return entries

    def max_seq(self) -> int:
        """:meth:`refresh`; the highest commit number the store shows (:func:`seq_floor`)."""
        return seq_floor(self.store.url, self.refresh())

    def entries(self) -> list[RemoteEntry]:
        """The remote entries of the last :meth:`refresh` (no I/O)."""
        with self._cond:
            return list(self._remote_entries)

    def is_uploaded(self, manifest: Manifest) -> bool:
        """Whether the remote holds this commit: its key, with its files and blobs (another
        process that resumed this run from the URL numbers its commits alike)."""
        key = (manifest.run_id, manifest.seq)
        with self._cond:
            return key in self.index and self._copies.get(key) == (manifest.files, manifest.blobs)

    def pending(self) -> set[str]:
        """Local names queued for upload (including the one being uploaded)."""
        with self._cond:
            return set(self._queue)

    def status(self) -> SyncStatus:
        with self._cond:
            return SyncStatus(
                pending=list(self._queue),
                uploading=self._current,
                failures=self._failures,
                last_error=self._last_error,
                uploaded=self._uploaded,
                uploaded_bytes=self._uploaded_bytes,
                upload_seconds=self._upload_seconds,
                stalled_s=self._waited_stall_s()  # (waiting for the previous writer's)
                if (p := self._progress) is None
                else time.monotonic() - p.last_update,
                waits_previous=self._waiting_since is not None,
                stall_allowance_s=self._allowance_s(),
            )

    # ------------------------------------------------------------------ control

    def enqueue(self, name: str) -> None:
        with self._cond:
            if name not in self._queue:
                self._queue.append(name)
                self._cond.notify_all()
            busy = self._failures > 0 or self._current is not None
        # the uploader waits out a backoff, or an upload under way (one a store that stopped
        # answering holds for minutes: s3fs's retries of its timeouts): skip what it would skip
        if busy:  # at its next try now, so local retention frees the disk at this commit
            self._coalesce()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue, timeout)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        prevs = self._previous  # what they committed after this writer's listing: counted too
        if not self._wait_previous(self.store.url):
            return
        for prev in prevs:
            if isinstance(prev, RemoteSync) and prev._stop:  # (ended: keep_last holds)
                self.own.took_over(prev.own)
        while True:
            with self._cond:
                if not self._wait_for_work(lambda: self._queue):
                    return
            self._coalesce()
            with self._cond:
                if not self._queue:
                    continue
                name = self._queue[0]
                self._current = name
            done = self._attempt(name)
            with self._cond:
                self._current = None
                if done:
                    if name in self._queue:
                        self._queue.remove(name)
                    self._cond.notify_all()
                    continue
                self._pause(backoff_s(self._failures, self.retry_base_s, self.retry_max_s))

    def _coalesce(self) -> None:
        """When uploads fall behind saves, skip the queued checkpoints that the remote
        retention would delete as soon as the newer ones arrive: the uploader always works
        toward the newest state. Skipped ones stay local (and local retention may then
        delete them like any uploaded one)."""
        with self._cond:
            queued = list(self._queue)
        remote = self.entries()
        if len(queued) < 2 or self.policy.keep_last is None:
            return
        local: dict[str, Manifest] = {}
        for name in queued:
            try:
                local[name] = read_manifest(f"{self.local_root}/{name}")
            except Exception:
                return  # let _attempt report the problem
        newest = local[queued[-1]]
        # an archive point under the remote policy it was written with: kept, whatever the
        # options now (a restart queued the uploads a stop cut off: restore_remote)
        cands = retention_candidates(self.own.mine(remote, newest.run_id)) + [
            Candidate(
                f"\0local/{n}",
                m.step,
                m.seq,
                m.run_id,
                m.metrics,
                True,
                archived=archived(m),
                lineage=m.lineage,
            )
            for n, m in local.items()
        ]
        keep = plan(cands, self.policy, newest.run_id).keep
        with self._cond:  # (never the one being uploaded: enqueue() calls this too)
            skip = [n for n in queued if f"\0local/{n}" not in keep and n != self._current]
            if not skip:
                return
            self._queue = [n for n in self._queue if n not in skip]
            self._cond.notify_all()
        log.info(
            "remote: uploads are behind; skipping %s (the remote retention would delete %s "
            "once the newer checkpoints are uploaded)",
            ", ".join(skip),
            "it" if len(skip) == 1 else "them",
        )
        # no longer held for upload: local retention deletes them now, not at the next commit
        # (during an outage that filled the disk with them, no save could commit)
        self._local_retention()

    def _attempt(self, name: str) -> bool:
        """One try at uploading ``name``: True when it is done (uploaded, or dropped because
        the local copy is gone or bad), False to retry later."""
        path = f"{self.local_root}/{name}"
        try:
            manifest = read_manifest(path)
            verify(path, manifest, Depth.SIZE)
        except FileNotFoundError:
            log.warning("remote: %s was removed locally before it was uploaded; skipping it", name)
            return True
        except CheckpointCorruptError as e:
            log.warning("remote: not uploading %s, its local copy is damaged: %s", name, e)
            return True
        if self.is_uploaded(manifest):
            return True
        t0 = time.perf_counter()
        progress = Progress(
            manifest.total_bytes,
            f"uploading {name} to {self.store.url}",
            bar=None if self.show_progress else False,
            log_every_s=30.0,
        )
        try:
            with self._transfer(progress):
                remote_name = self._upload(path, manifest, name, progress)
        except CheckpointCorruptError as e:  # its bytes rotted since its commit: never uploaded
            log.error("remote: not uploading %s, its local copy is damaged: %s", name, e)
            return True
        except Exception as e:
            if self._stop:  # close() gave up on this attempt: never retried (it said so)
                log.info(
                    "remote %s: the upload of %s that close() gave up on ended without a "
                    "commit: %s: %s",
                    url_text(self.store.url),
                    name,
                    type(e).__name__,
                    url_text(str(e)),
                )
                return False
            self._failed(name, e)
            return False
        elapsed = time.perf_counter() - t0
        with self._cond:
            recovered = self._failures
            self.index[(manifest.run_id, manifest.seq)] = remote_name
            self.own.wrote(remote_name, (manifest.run_id, manifest.seq))
            self._copies[(manifest.run_id, manifest.seq)] = (manifest.files, manifest.blobs)
            self._failures = 0
            self._last_error = None
            self._uploaded += 1
            self._uploaded_bytes += manifest.total_bytes
            self._upload_seconds += elapsed
            backlog = len(self._queue) - 1
        if recovered:
            log.warning(
                "remote %s is reachable again after %d failed attempt(s); uploaded %s, "
                "%d more to upload",
                self.store.url,
                recovered,
                name,
                backlog,
            )
        log.info(
            "uploaded %s to %s/%s (%.1f MB, %.2f s)",
            name,
            self.store.url,
            remote_name,
            manifest.total_bytes / 1e6,
            elapsed,
        )
        if self._stop:  # close() gave up on this attempt and released the directory: no
            return True  # retention (another writer may own it now), no record in its history
        if self.on_uploaded is not None:
            self.on_uploaded(manifest, name, elapsed)
        self._remote_retention(manifest, remote_name)
        self._local_retention()
        return True

    def _local_retention(self) -> None:
        """``after_upload``: a checkpoint is no longer held for upload (uploaded, or skipped)."""
        if self.after_upload is not None:
            try:
                self.after_upload()
            except Exception as e:  # retention must never stop uploads
                log.warning("local retention after upload failed: %s", e)

    def _free_name(self, name: str, manifest: Manifest) -> str:
        """``name``, unless another committed remote checkpoint has it (another run writing
        to the same URL), or one whose manifest cannot be read: then ``name-rN``."""
        with self._cond:
            taken = {v: k for k, v in self.index.items()}
            taken.update(dict.fromkeys(self.unfree, UNREADABLE))
        return free_name(name, (manifest.run_id, manifest.seq), taken)

    def _upload(self, path: str, manifest: Manifest, name: str, progress: Progress) -> str:
        """Upload under ``name``'s free remote name; the name it got. A name another process
        committed since the index was listed (two runs writing to one URL) is left to it: the
        upload takes the next free name."""
        while True:
            remote_name = self._free_name(name, manifest)
            self.own.trying(remote_name, manifest)
            try:
                self.store.upload(path, manifest, remote_name, progress)
                return remote_name
            except RemoteNameTaken as e:
                if e.key is None:  # maybe only briefly unreadable: never replaced
                    log.warning(
                        "remote %s: the manifest of %s cannot be read here (damaged, newer or "
                        "not answered); it is left as it is (`resilient-ckpt gc --remote "
                        "--remove-corrupt` deletes a damaged one) and %s goes under another name",
                        self.store.url,
                        e.name,
                        name,
                    )
                    with self._cond:
                        self.unfree.add(e.name)
                    continue
                if e.key == (manifest.run_id, manifest.seq):  # this run's key, not this commit
                    log.warning(
                        "remote %s: %s is commit %d of this run (%s) written by another process "
                        "(was the run resumed twice from this URL?); uploading %s under another "
                        "name. Only one process may write a run to a remote URL",
                        self.store.url,
                        e.name,
                        e.key[1],
                        e.key[0],
                        name,
                    )
                    with self._cond:
                        self.unfree.add(e.name)
                    continue
                if e.key == UNREADABLE:  # a deletion's mark (one key for every such name)
                    log.warning(
                        "remote %s: %s is being deleted by another process (or a deletion was "
                        "cut off there: `resilient-ckpt gc --remote` removes it after a day); "
                        "uploading %s under another name",
                        self.store.url,
                        e.name,
                        name,
                    )
                elif e.key[0] == manifest.run_id:  # a re-save of this step, after a fallback
                    log.warning(
                        "remote %s: %s holds commit %d of this run (an earlier save of this "
                        "step, or its upload a kill cut off); uploading %s under another name",
                        self.store.url,
                        e.name,
                        e.key[1],
                        name,
                    )
                else:
                    log.warning(
                        "remote %s: %s is a checkpoint of another run (%s) that writes to the "
                        "same URL; uploading %s under another name. Give each run a remote URL "
                        "of its own",
                        self.store.url,
                        e.name,
                        e.key[0],
                        name,
                    )
                with self._cond:  # (by name: a key, UNREADABLE above all, may cover many)
                    self.unfree.add(e.name)

    def _failed(self, name: str, e: BaseException) -> None:
        now = time.monotonic()
        with self._cond:
            self._failures += 1
            self._last_error = f"{type(e).__name__}: {url_text(str(e))}"
            failures, backlog = self._failures, list(self._queue)
            warn = failures == 1 or now - self._last_warn >= self.warn_every_s
            if warn:
                self._last_warn = now
        if warn:
            log.warning(
                "remote %s: uploading %s failed (%d attempt(s) so far): %s. Training goes on; "
                "%d checkpoint(s) are only local (%s) and are kept until they are uploaded; "
                "retrying with backoff",
                self.store.url,
                name,
                failures,
                self._last_error,
                len(backlog),
                ", ".join(backlog),
            )

    def _remote_retention(self, manifest: Manifest, protect: str) -> None:
        keep_all = self.policy.keep_last is None
        now = time.time()
        if keep_all and self._last_sweep is not None and now - self._last_sweep < SWEEP_EVERY_S:
            # nothing to delete but cut-off uploads; listing after each upload grew with the
            return  # number of checkpoints the store holds: look once a process, then hourly
        self._last_sweep = now
        try:
            entries = self.refresh()
            self._refusals.prune({e.name for e in entries})  # (gone: deleted by another)
            mine = self.own.mine(entries, manifest.run_id)  # (not another live process's)
            keep = self.own.protected(mine, protect)
            p = plan(retention_candidates(mine), self.policy, manifest.run_id, protected=keep)
            gone = False  # (a refused one, or one waiting out its refusal: no collection)
            for name in p.delete:  # none when keeping all
                if not delete_checkpoint(self, self.store, name, "remote retention: deleted"):
                    continue  # (its manifest refused: still committed and whole)
                gone = True
                with self._cond:
                    self.index = {k: v for k, v in self.index.items() if v != name}
                    self._remote_entries = [e for e in self._remote_entries if e.name != name]
                self.own.deleted(name)
            now, swept = time.time(), False
            for e in entries:  # uploads a crash cut off: each run's kill left one behind
                if (
                    e.problem == NO_MANIFEST
                    and REMOTE_CKPT_RE.match(e.name)  # (step_N-r1 too)
                    and e.modified is not None
                    and now - e.modified > STALE_UPLOAD_S
                ):
                    what = "remote: deleted an upload cut off"
                    swept = delete_checkpoint(self, self.store, e.name, what) or swept
            # then the blobs no remaining remote checkpoint refers to; also those of an upload
            # cut off (keeping every checkpoint, nothing else ever collected them)
            if gone or swept:
                remote_blobs.collect(self.store)
        except Exception as e:
            retention_failed(self, self.store.url, e)
