"""The checkpoint directory as its one writer sees it: lock, sweep, commit sequence, retention,
run history, checkpoints of other runs, and the remote tier attached to it.

Which ranks call what: every rank constructs a :class:`Directory` and calls :meth:`~Directory.open`
(a collective: rank 0's failure is raised on every rank). All else is for the coordinator (rank
0): it holds the lock, numbers the commits, deletes, records history and owns the uploader.
Other ranks only write their files into a staging directory it made (see :mod:`.session`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import catalog, dist, history, remote_best
from .after_commit_work import UploadNotQueued, held_not_queued
from .blobs import BlobStore
from .branches import Tip
from .catalog import Depth, Entry, Status
from .commit import CKPT_RE, RenameCommit, open_dir, sweep_staging
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
    relayed,
)
from .known import KnownCheckpoints
from .lock import COMMAND_WAIT_S, DirLock, claim_remote
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .reader import by_commit
from .redact import command
from .remote_owned import RestoredCopy
from .repeats import Repeats
from .retention import RetentionPolicy
from .retention_pass import apply_retention, collect_blobs
from .trash import TrashBin

if TYPE_CHECKING:
    from .config import CheckpointerConfig
    from .remote import RemoteStore
    from .session import Committed
    from .sync import RemoteSync

log = logging.getLogger("resilient_callbacks")


def unusable(dirpath: str, e: OSError) -> CheckpointWriteError:
    """The error for a ``dirpath`` that cannot be opened (``e``: what creating or locking it
    raised): a file, no permission, a read-only or full filesystem, an exceeded quota, said
    as such."""
    file = os.path.exists(dirpath) and not os.path.isdir(dirpath)
    fix = "Check that the path is right and writable by this user."
    if not file and e.errno == errno.ENOSPC:  # (no block or no inode left to create it)
        fix = "Its filesystem is full: free space (or inodes) there, or use another disk."
    if not file and e.errno == errno.EDQUOT:  # (this user's share of blocks or inodes)
        fix = (
            "The disk quota (of this user, its group or project) on its filesystem is exceeded: "
            "check it with `quota -s` (or the filesystem's own tool: `lfs quota` on Lustre, "
            "`mmlsquota` on GPFS), free space or inodes within it, or use another filesystem."
        )
    if os.path.islink(dirpath) and not os.path.exists(dirpath):  # (mkdir says "File exists")
        fix = (
            f"It is a symbolic link to {os.path.realpath(dirpath)}, which does not exist: "
            "create that folder, or point the link at an existing one."
        )
    if (
        not file
        and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
        and _holds(dirpath)
    ):
        fix += (
            " To restore from it only (an evaluation job): Checkpointer(dirpath, read_only=True)."
        )
    err = CheckpointWriteError(
        f"cannot use {dirpath} as a checkpoint directory: "
        f"{'it is a file' if file else e.strerror or e}. {fix}"
    )
    err.errno = e.errno
    err.__cause__ = e
    return err


def _holds(dirpath: str) -> bool:
    """Whether ``dirpath`` holds a ``step_*`` folder (something to restore)."""
    with contextlib.suppress(OSError):
        return any(CKPT_RE.match(n) for n in os.listdir(dirpath))
    return False


class Directory:
    """One checkpoint directory and, optionally, its remote tier. Its one job: the directory's
    lifecycle as rank 0 sees it (see the module docstring for the rank contract)."""

    def __init__(
        self, dirpath: str, retention: RetentionPolicy, world_size: int, read_only: bool = False
    ) -> None:
        self.dirpath = dirpath
        # restore only: no lock, no sweep, no history, no retention; nothing is written
        self.read_only = read_only
        self.retention = retention
        self.world_size = world_size
        self.is_coordinator = dist.rank() == 0
        self.lock = DirLock(dirpath)
        self.commit = RenameCommit(dirpath)
        self.blobs = BlobStore(dirpath)  # incremental checkpoints' shared tensors
        self.seq = 0  # commit number of the newest checkpoint either tier holds
        self.run_id: str | None = None
        self.remote: RemoteStore | None = None
        self.sync: RemoteSync | None = None
        self.remote_due: Callable[[int, str], bool] | None = None  # remote_every_n_saves
        self._retention_lock = threading.Lock()
        self.trash = TrashBin()  # deletes what retention removed, off the persist path
        # read by retention and is_best at each commit; kept between commits
        self.known = KnownCheckpoints()
        self.said = Repeats()  # retention's failures, each said once (not after every save)
        self._reported_foreign = False
        self.checked_foreign = False
        self.found_corrupt: set[str] = set()  # by a restore (checksums): kept for inspection
        # the checkpoint this process restored from, kept until its first commit: before it, a
        # roll-back's abandoned newer checkpoints are the newest, and the lineage unknown
        self.restored: str | None = None
        self.restored_copy = RestoredCopy()  # its remote copy, kept until the branch is there
        self.tip = Tip()  # where the next save descends from: its manifest's lineage
        # the uploads the newest commit skipped (remote_every_n_saves), run if it proves final
        self._held: tuple[int, list[Callable[[], None]], str] | None = None

    # ------------------------------------------------------------------ opening

    def open(self, config: CheckpointerConfig) -> None:
        """Every rank: rank 0 creates the directory, takes the lock, sweeps what interrupted
        saves left, reads the commit sequence and connects the remote tier; a failure there is
        raised on every rank."""
        error: dict[str, Any] | None = None
        pending: BaseException | None = None
        if self.is_coordinator:
            try:
                self._open_here(config)
            except CheckpointError as e:
                error = {"type": type(e).__name__, "msg": str(e)}
                pending = e
            except OSError as e:
                pending = unusable(self.dirpath, e)
                error = {"type": "OSError", "msg": str(pending), "errno": e.errno}
            except BaseException:  # a KeyboardInterrupt, an unexpected error: nothing held
                self.release_opened()
                raise
        error = dist.broadcast_json(error)
        if error is not None:
            if self.is_coordinator:
                self.release_opened()
                assert pending is not None
                raise pending
            if error["type"] == "OSError":
                err = CheckpointWriteError(
                    f"rank 0 could not open the checkpoint directory: {error['msg']}"
                )
                err.errno = error.get("errno")
                raise err
            raise relayed(error["type"], error["msg"])

    def release_opened(self) -> None:
        """What an open that failed part-way holds: the remote's threads, the lock."""
        if self.sync is not None:
            self.sync.stop()
        self.lock.release()

    def open_here(self, config: CheckpointerConfig, load_hint: str | None = None) -> None:
        """Coordinator only, no collective: what :meth:`open` does on rank 0 (create the
        directory, take the lock, sweep leftovers, read the commit sequence, connect the remote
        tier). For callers that must not run collectives (a DCP ``StorageWriter``). Read-only:
        only that the directory exists. A ``dirpath`` that is one checkpoint is refused
        (``load_hint``: how the caller's user loads that checkpoint; default ``resume=<it>``);
        one that cannot be opened (a file, no permission) raises :func:`unusable`'s error."""
        try:
            self._open_here(config, load_hint)
        except CheckpointError:
            raise
        except OSError as e:
            raise unusable(self.dirpath, e) from e

    def _open_here(self, config: CheckpointerConfig, load_hint: str | None = None) -> None:
        if _is_checkpoint(self.dirpath):
            # a run there would nest its checkpoints inside this one, where the parent's
            # retention or gc deletes them with it
            parent = os.path.dirname(os.path.abspath(self.dirpath))
            raise ConfigError(
                f"dirpath={self.dirpath} is one checkpoint (it holds {MANIFEST_NAME}), not a "
                f"directory of checkpoints: pass its parent directory {parent} as dirpath, and "
                + (load_hint or f"resume={self.dirpath!r}")
                + " to restore this checkpoint in particular"
            )
        if self.read_only:
            if not os.path.isdir(self.dirpath):
                raise CheckpointNotFoundError(
                    f"read_only=True: {self.dirpath} is not a directory (a read-only Checkpointer "
                    "creates nothing); check the path"
                )
            return
        open_dir(self.dirpath)  # (its name durable: a power loss keeps what it holds)
        # (the other ranks wait in open()'s broadcast meanwhile)
        self.lock.acquire(wait_s=dist.wait_before_collective(COMMAND_WAIT_S))
        sweep_staging(self.dirpath)  # (logs what it removed)
        self.seq = catalog.next_seq(self.dirpath) - 1
        collect_blobs(self.blobs)  # what crashed saves or deletions left (nothing in flight)
        if config.remote is not None:
            self._open_remote(config)

    def _open_remote(self, config: CheckpointerConfig) -> None:
        """Coordinator: connect to the remote tier and prove it usable (a clear error now, not
        after hours of training), then start the uploader."""
        from .remote import RemoteStore
        from .remote_open import open_listing, preflight
        from .sync import RemoteSync

        assert config.remote is not None
        self.remote = RemoteStore(config.remote, config.remote_options)
        st = self.remote  # one writer per store in this process, however its URL is spelled
        claim_remote(st.key, st.url, self.lock)
        reachable = preflight(self.remote, config.remote_timeout, self.dirpath)
        self.remote_due = config.remote_due
        self.sync = RemoteSync(
            self.remote,
            self.dirpath,
            config.remote_retention_policy(),
            after_upload=self._retention_after_upload,
            on_uploaded=self._record_upload,
            held=self.restored_copy,
        )
        # new commits number after the remote's (a newer format's too), also when no restore()
        # lists the tiers (a new run that only saves): a restore takes the highest number
        if reachable:
            self.seq = max(self.seq, open_listing(self.sync.max_seq, st.url, self.dirpath))

    def release(self) -> None:
        """Stop the uploader and the trash bin's thread, and release the lock (idempotent)."""
        if self.sync is not None:
            self.sync.stop()
        self.trash.stop()
        self.lock.release()

    # ------------------------------------------------------------------ after a commit

    def after_commit(self, committed: Committed) -> None:
        """Coordinator, once a checkpoint is committed: number it, queue its upload, apply
        retention (never to the checkpoint just committed). Queueing that fails raises
        :class:`~.after_commit_work.UploadNotQueued` from its failure (the message names the
        upload then only: one held by ``remote_every_n_saves`` is not wrong)."""
        self.committed(committed.seq)
        name = os.path.basename(committed.path)
        due = self.remote_due is None or self.remote_due(committed.seq, committed.reason)
        if self.sync is not None:
            sync = self.sync
            # (an archive point or one of the best: uploaded whatever the interval)
            ranks = functools.partial(self.is_best, name, sync.policy)
            due = remote_best.why_due(due, committed.step, sync.policy, ranks) is not None
            self.hold_upload(committed.step, None if due else lambda: sync.enqueue(name), name)
            if due:
                try:
                    sync.enqueue(name)
                except Exception as e:
                    raise UploadNotQueued(name) from e
        self.apply_retention(protect=name)

    def is_best(self, name: str, policy: RetentionPolicy) -> bool:
        """Coordinator: checkpoint ``name``, just committed here, is one of the run's best
        that ``policy`` (the remote retention) keeps: uploaded though ``remote_every_n_saves``
        skips it (:mod:`.remote_best`)."""
        with self._retention_lock:  # (the manifests the retention passes parse, and delete)
            self.known.forget(name)  # (its name and inode may be those of one deleted since)
            return remote_best.is_best(
                self.dirpath, name, policy, self.run_id, self.known, self.found_corrupt
            )

    def committed(self, seq: int) -> None:
        """Every rank, once the checkpoint of commit number ``seq`` is committed (before the
        retention after it): the next commits number after it, and the local copy of the
        checkpoint this process restored from is no longer protected (the commit records the
        lineage: retention knows what to keep); its remote copy is, until the first commit of
        this branch there (:class:`~.remote_owned.RestoredCopy`)."""
        self.seq = max(self.seq, seq)
        self.restored = None
        self.restored_copy.committed(seq)

    def protected(self, protect: str | None) -> list[str]:
        """What no retention pass of this process deletes, whatever the policy: ``protect``
        (the checkpoint just committed or restored) and, until the first commit, the one this
        process restored from (before it, after a roll-back, the abandoned newer checkpoints
        are the newest, and a pass after an upload deleted it with ``keep_last=1``)."""
        return [p for p in (protect, self.restored) if p]

    def hold_upload(self, step: int, upload: Callable[[], None] | None, name: str = "") -> None:
        """A commit of ``step`` (``name``, in this directory) whose upload
        ``remote_every_n_saves`` skipped (``upload``: what queues it) or did not skip (None).
        Kept until the next commit: if the run ends at that step (a final save of a step
        already saved), :meth:`upload_held` queues it."""
        with self._retention_lock:
            if upload is None:
                self._held = None
            elif self._held is not None and self._held[0] == step:
                self._held[1].append(upload)  # node-local: the coordinator is a leader too
            else:
                self._held = (step, [upload], name)

    def upload_held(self, step: int) -> str | None:
        """Every rank, after its background saves finished: the run's final save is of
        ``step``, saved already; queue its uploads if ``remote_every_n_saves`` skipped them
        (the remote tier always takes the last state of a run). Queueing that fails is not
        raised (the checkpoint is committed; the run is at its end): said as an ERROR naming
        the checkpoint and what uploads it, whose message is returned (kept and counted as
        the work after its commit, said again at close: :mod:`.after_commit_work`)."""
        with self._retention_lock:
            held, self._held = self._held, None
        if held is None or held[0] != step:
            return None
        log.info("remote: uploading the checkpoint of step %d as well: it is the run's last", step)
        errors = []
        for upload in held[1]:
            try:
                upload()
            except Exception as e:  # (the others still run: the leader's, the coordinator's)
                errors.append(e)
        if not errors:
            return None
        who, sync = self.after_commit_worker()
        path = os.path.join(self.dirpath, held[2])
        return held_not_queued(step, path, errors, who, sync, self.dirpath)

    def after_commit_worker(self) -> tuple[str, Any]:
        """Who does the work after a commit here, and its uploader (as
        :func:`~.after_commit_work.failed` names them)."""
        return "rank 0", self.sync

    def _retention_after_upload(self) -> None:
        if self.run_id is not None:
            self.apply_retention(protect=None)

    def apply_retention(self, protect: str | None, policy: RetentionPolicy | None = None) -> None:
        """Coordinator: apply the local retention policy (``policy``: another one, e.g. the
        policy recorded in a checkpoint). With a remote tier, a checkpoint whose remote copy
        is not committed yet is never deleted (it is the only copy); nor is the one this
        process restored from before its first commit."""
        if self.read_only:
            return
        with self._retention_lock:  # the persist and the upload threads both call this
            protected = self.protected(protect)
            if protect:  # (just committed: maybe with the name and inode of one deleted)
                self.known.forget(protect)
            if self.sync is not None:
                protected += self.sync.pending()
            apply_retention(
                self.dirpath,
                policy or self.retention,
                self.run_id,
                protected,
                self.blobs,
                self.trash.put,
                self.found_corrupt,
                self.known,
                self.said,
            )

    # ------------------------------------------------------------------ history, other runs

    def _record_upload(self, manifest: Manifest, name: str, seconds: float) -> None:
        """The uploader, after each upload: how long it took, and how long after its commit
        the checkpoint was durable remotely (the report: do the uploads keep up)."""
        lag = max(0.0, time.time() - manifest.created)
        self.record(
            "upload", manifest.step, sync=False, name=name, bytes=manifest.total_bytes,
            seconds=round(seconds, 6), lag_s=round(lag, 3),
        )  # fmt: skip

    def record(self, event: str, step: int, *, sync: bool = True, **fields: Any) -> None:
        """Append to the directory's run history (coordinator only). Never raises: the
        history is a record, never a reason for a save or a restore to fail."""
        if self.read_only:
            return
        try:
            history.append(
                self.dirpath, event, step, self.run_id, self.world_size, sync=sync, **fields
            )
        except Exception as e:
            log.warning("could not record the %s in %s: %s", event, self.dirpath, e)

    def check_foreign(self, unrestored: bool = False) -> list[str]:
        """Coordinator, once per run: the warnings (``ForeignCheckpointsWarning``) to say about
        checkpoints of other runs in the directory (``unrestored``: this run saves without a
        restore() that resume='auto' asked for). The caller says them where a warning the
        filters make an error stops every rank (``-W error``): in restore's last broadcast, or
        as the first save's failure, which every rank learns in the save's exchange."""
        self.checked_foreign = True
        if self.read_only:  # a reader deletes nothing: the warning is for the run's writer
            return []
        try:
            entries = catalog.scan(self.dirpath, Depth.NONE)
        except OSError as e:  # the save that follows reports what is wrong with the directory
            log.info("could not list %s for checkpoints of other runs: %s", self.dirpath, e)
            return []
        return self.report_foreign(entries, unrestored) + self._report_remote_foreign()

    def _report_remote_foreign(self) -> list[str]:
        """The same for the remote tier's listing (made when the directory was opened): a new
        run beside another run's remote checkpoints, e.g. a sweep's trials given one URL."""
        if self.sync is None or self.remote is None or self.run_id is None:
            return []
        mine = self.run_id
        foreign = [
            e.manifest for e in self.sync.entries() if e.manifest and e.manifest.run_id != mine
        ]
        if foreign:
            runs = sorted({m.run_id for m in foreign})
            msg = (
                f"remote {self.remote.url} holds {len(foreign)} checkpoint(s) of {len(runs)} "
                f"other run(s) ({', '.join(runs)}). The remote retention does not count or "
                "delete them, and a resume from the remote takes the newest of any run: use a "
                "remote URL per run, or remove them with "
                f"{command('gc', self.dirpath, '--remote', self.remote.url, '--other-runs')} "
                "(--dry-run first)."
            )
            return [msg]
        return []

    def report_foreign(self, entries: list[Entry], unrestored: bool = False) -> list[str]:
        if self._reported_foreign or self.run_id is None:
            return []
        foreign = [e for e in entries if e.manifest and e.manifest.run_id != self.run_id]
        if not foreign:
            return []
        self._reported_foreign = True
        runs = sorted({e.manifest.run_id for e in foreign if e.manifest})
        steps = [e.manifest.step for e in foreign if e.manifest]
        newest = max(foreign, key=lambda e: e.seq)
        assert newest.manifest is not None  # (foreign entries have one)
        forgot = (
            "restore() was not called before this run's first save, and resume='auto' would "
            f"have resumed from step {newest.step} of run {newest.manifest.run_id}: this run starts "
            "from scratch beside it, and the next resume takes this run's newer checkpoints. "
            "Call ckpt.restore(state) before training, or pass resume='never' to start a new "
            "run on purpose. "
            if unrestored
            else ""
        )
        msg = forgot + (
            f"{self.dirpath} holds {len(foreign)} checkpoint(s) of {len(runs)} other run(s) "
            f"({', '.join(runs)}; steps {min(steps)}..{max(steps)}). Retention does not count "
            "or delete them; use a separate dirpath per run, or remove them with "
            f"{command('gc', self.dirpath, '--other-runs')} (after this run has saved; "
            "`--dry-run` first shows what it would delete)."
        )
        return [msg]

    def checkpoints(self) -> list[Entry]:
        """Committed checkpoints in the directory, oldest first (sizes checked, not checksums)."""
        return catalog.committed(catalog.scan(self.dirpath, Depth.SIZE))

    def latest_valid(self) -> str | None:
        """The newest valid checkpoint of the current lineage (after a roll-back, never one of
        the branch it abandoned while one of the lineage is valid: :mod:`.branches`)."""
        ordered = by_commit(self.checkpoints())  # (a damaged head still says the lineage)
        return next((e.path for e in ordered if e.status is Status.VALID), None)


def _is_checkpoint(dirpath: str) -> bool:
    """Whether ``dirpath`` is one checkpoint: it holds a manifest this library wrote (another
    tool's ``manifest.json`` beside the checkpoints is none of ours)."""
    if not os.path.isfile(os.path.join(dirpath, MANIFEST_NAME)):
        return False
    try:
        read_manifest(dirpath)
    except (OSError, CheckpointError):
        return False
    return True
