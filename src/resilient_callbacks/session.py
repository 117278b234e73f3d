"""CommitSession: the commit of one checkpoint by every rank, usable without a Checkpointer.

The sequence, and which ranks call what (every call below is made by *every* rank, in this
order, for the same step; each one marked *collective* runs collectives on ``group``)::

    session = CommitSession(dirpath, step, run_id=run_id)
    staging = session.begin()        # collective: rank 0 makes the staging directory
    if staging is not None:
        session.add(layout.write_part(staging, rank, ...))   # each rank writes its own files
    path = session.commit()          # collective: gather reports; rank 0 writes the manifest
                                     # last, renames, points `latest`, then (rank 0 only)
                                     # the after-commit step: queue the upload, retention;
                                     # then every rank learns the outcome

- ``begin``: the coordinator (rank 0) creates a hidden staging directory and every rank gets its
  path (``None`` when rank 0 could not create it: ``commit`` then raises on every rank).
- Between ``begin`` and ``commit`` each rank writes only its own files, through the core's hashing
  writers (:func:`.tensorfile.write_tensors`, :func:`.filewrite.write_json` or
  :func:`.layout.write_part`), and hands their :class:`~.manifest.FileEntry` list to :meth:`add`;
  a rank that failed passes its exception to ``commit(error=...)`` instead of raising, so that no
  rank is left waiting in the gather.
- ``commit``: every rank's report is gathered; if any rank failed, rank 0 removes the staging
  directory and *every* rank raises one :class:`~.errors.CheckpointWriteError` naming the failed
  rank(s). Otherwise rank 0 checks that every listed file is visible to it (the directory must be
  shared), moves the blobs ranks wrote into ``<staging>/blobs/`` into the run's store
  (``incremental=True`` with FileParts, :mod:`.part_blobs`), writes ``manifest.json`` last (the
  commit point), fsyncs and renames the staging
  directory into place and updates the advisory ``latest`` pointer; every rank gets the final
  path. Only then does rank 0 run ``after_commit`` (upload queue, retention): deletion happens
  after the newer checkpoint is durable, by one process. Its failure is not raised: the
  checkpoint is committed and valid, rank 0 says what failed and what that leaves undone
  (:mod:`.after_commit_work`: one behaviour in every mode), and every rank returns the
  committed checkpoint with the failure's message as :attr:`CommitSession.after_error`: it
  travels in the outcome broadcast every rank waits in anyway (no collective of its own; a
  rank that raised alone once left the others waiting in their next collective).

A process killed before the manifest is written leaves only a ``.staging-*`` directory: no
reader counts it, and the next writer to open the directory sweeps it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import after_commit_work, catalog, dist, known
from .blobs import BlobStore, key_of
from .branches import Tip
from .commit import CommitStrategy, RenameCommit, point_latest
from .errors import CheckpointWriteError, ConfigError, sentence
from .filewrite import encode_json
from .manifest import FileEntry, Manifest, versions
from .part_blobs import promote_staged
from .repeats import Repeats
from .retention import RetentionPolicy
from .retention_pass import apply_retention

log = logging.getLogger("resilient_callbacks")


@dataclass
class RankReport:
    """What one rank wrote for a checkpoint, or why it could not."""

    rank: int
    files: list[FileEntry] = field(default_factory=list)
    error: str | None = None
    step: int | None = None  # the step this rank saves (None: not said)
    layout: str | None = None  # hash of the replicated state's keys (structure_layout.layout_hash)

    def to_json(self) -> dict[str, Any]:
        files = [f.__dict__ for f in self.files]
        d = {"rank": self.rank, "files": files, "error": self.error, "step": self.step}
        return {**d, "layout": self.layout}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankReport:
        files = [FileEntry(**f) for f in d["files"]]
        return cls(int(d["rank"]), files, d["error"], d.get("step"), d.get("layout"))


def agree_steps(reports: list[RankReport]) -> None:
    """Mark as failed each report whose step, or the keys of whose replicated state, differ
    from the lowest rank's. Ranks that pass different steps to one save (a counter off by one
    on one rank) committed one checkpoint mixing two steps' states; a key only one rank has
    (rank 0 alone writes the replicated state) was dropped, and the run could not resume from
    any of its checkpoints: both in silence."""
    first = min(reports, key=lambda r: r.rank)
    for r in reports:
        if r.error:
            continue
        if r.step is not None and first.step is not None and r.step != first.step:
            r.error = (
                f"it saves step {r.step}, rank {first.rank} step {first.step}: every rank "
                "must pass the same step"
            )
        elif r.layout is not None and first.layout is not None and r.layout != first.layout:
            r.error = (
                f"its state has other keys or objects than rank {first.rank}'s: every rank "
                "must save the same state (per-rank values wrapped in PerRank)"
            )


@dataclass
class Committed:
    """A committed checkpoint, as every rank learns it."""

    path: str
    step: int
    seq: int
    bytes: int  # the size of every file of every rank
    reason: str = "forced"  # periodic | final | forced | emergency | close


class CommitSession:
    """Commit one checkpoint: begin -> each rank's files -> manifest last -> rename -> ``latest``
    -> (rank 0) upload queue and retention. See the module docstring for the rank contract.

    ``strategy``: how a staging directory becomes a checkpoint (default: :class:`RenameCommit`
    on ``dirpath``). ``seq``: the commit number (default: one more than the newest in
    ``dirpath``, read by rank 0 at commit time). ``after_commit``: what rank 0 does once the
    checkpoint is committed; by default, apply ``retention`` (if given) and queue the upload on
    ``sync`` (if given). ``group``: the process group of the collectives (default: the world).
    ``step``: an int >= 0 (a :class:`ConfigError` otherwise: it names the ``step_*`` folder).
    ``tip`` (rank 0's): where the save descends from, recorded as the manifest's ``lineage``
    (:mod:`.branches`); without one the manifest records none (read in commit order).
    ``blobs`` (rank 0's): the store of the directory's writer, whose collection (the
    uploader's retention, in another thread) must not take the blobs the ranks staged between
    their move into the store and the commit of the manifest that names them: they are pinned
    meanwhile. ``said`` (rank 0's): the failures said so far, each once while it persists
    (:mod:`.repeats`): the directory's of a Checkpointer or DCP writer, which outlives each
    save's session; by default the process's (:data:`.after_commit_work.SAID`).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        step: int,
        *,
        run_id: str,
        group: Any = None,
        strategy: CommitStrategy | None = None,
        seq: int | None = None,
        retention: RetentionPolicy | None = None,
        remote_retention: RetentionPolicy | None = None,
        sync: Any = None,
        after_commit: Callable[[Committed], None] | None = None,
        tip: Tip | None = None,
        blobs: BlobStore | None = None,
        said: Repeats | None = None,
    ) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"the step of a checkpoint must be an int >= 0, got {step!r}")
        self.dirpath = os.path.abspath(os.fspath(dirpath))
        self.step = step
        self.run_id = run_id
        self.group = group
        self.strategy: CommitStrategy = strategy or RenameCommit(self.dirpath)
        self.seq = seq
        self.retention = retention
        self.remote_retention = remote_retention
        self.sync = sync
        self.after_commit = after_commit or self._default_after_commit
        self.tip = tip  # where this save descends from (its manifest's lineage); None: unsaid
        self.blobs = blobs
        self.said = after_commit_work.SAID if said is None else said
        if tip is not None and seq is not None:
            tip.planned(seq)
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self._ranks = dist.group_size(group)  # the reports commit() must gather
        self.is_coordinator = self.rank == 0
        self.staging: str | None = None
        # once committed (every rank after commit(); rank 0's after_commit may fail then)
        self.done: Committed | None = None
        self.after_error: str | None = None  # rank 0's after_commit failed: what it said
        self.files: list[FileEntry] = []
        self._begin_error: str | None = None
        self.layout: str | None = None  # set by the caller: what agree_steps compares

    def begin(self) -> str | None:
        """Collective. Rank 0 creates the staging directory; every rank returns its path, or
        ``None`` if rank 0 could not create it (then write nothing and call :meth:`commit`)."""
        staging, error = None, None
        if self.is_coordinator:
            try:
                # (known before the broadcast: a save stopped in it removes the directory)
                staging = self.staging = self.strategy.begin(self.step)
            except OSError as e:
                error = f"cannot create a staging directory in {self.dirpath}: {e}"
        msg = dist.broadcast_json({"staging": staging, "error": error}, group=self.group)
        self.staging, self._begin_error = msg["staging"], msg["error"]
        return self.staging

    def begin_here(self) -> str:
        """Coordinator only, no collective: create the staging directory and return its path
        (raises :class:`CheckpointWriteError` if it cannot). For callers whose framework moves
        the path to the other ranks itself (a DCP ``StorageWriter`` puts it into the global
        plan that DCP scatters)."""
        try:
            self.staging = self.strategy.begin(self.step)
        except OSError as e:
            raise CheckpointWriteError(
                f"cannot create a staging directory in {self.dirpath}: {e}"
            ) from e
        return self.staging

    def commit_here(
        self,
        reports: Iterable[RankReport],
        *,
        metrics: Mapping[str, float | None] | None = None,
        reason: str = "forced",
        fingerprint: str = "",
        extra: Mapping[str, Any] | None = None,
    ) -> Committed:
        """Coordinator only, no collective: commit the staging directory from every rank's
        report, gathered by the caller (DCP calls ``StorageWriter.finish()`` on the coordinator
        only, after gathering the ranks' write results itself): manifest last, rename,
        ``latest``, then ``after_commit`` (its failure is said, and kept as
        :attr:`after_error`, not raised). If a report names an error or the commit fails, the
        staging directory is removed and :class:`CheckpointWriteError` names the rank(s)."""
        assert self.staging is not None, "commit_here() without begin_here()"
        reports = list(reports)
        failed = [r for r in reports if r.error]
        try:
            if failed:
                raise CheckpointWriteError(
                    sentence(
                        f"checkpoint for step {self.step} was not committed; failed on rank(s) "
                        f"{', '.join(str(r.rank) for r in failed)}: "
                        + "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
                    )
                    + f" Nothing was committed and older checkpoints in {self.dirpath} are "
                    "intact.",
                    tuple(r.rank for r in failed),
                )
            path, seq = self._commit(reports, metrics, reason, fingerprint, extra)
        except CheckpointWriteError as e:
            self.strategy.abort(self.staging)
            raise self._with_space_hint(e) from e.__cause__
        except Exception as e:
            self.strategy.abort(self.staging)
            raise CheckpointWriteError(
                sentence(
                    f"checkpoint for step {self.step} was not committed; failed on rank(s) 0: "
                    f"rank 0 (commit): {type(e).__name__}: {e}"
                )
                + f" Nothing was committed and older checkpoints in {self.dirpath} are intact.",
                (0,),
            ) from e
        done = Committed(
            path, self.step, seq, sum(f.size for r in reports for f in r.files), reason
        )
        self.after_error = self._after(done)
        return done

    def add(self, files: Iterable[FileEntry]) -> None:
        """This rank wrote ``files`` into the staging directory (paths relative to it)."""
        self.files.extend(files)

    def commit(
        self,
        error: BaseException | None = None,
        *,
        metrics: Mapping[str, float | None] | None = None,
        reason: str = "forced",
        fingerprint: str = "",
        extra: Mapping[str, Any] | None = None,
    ) -> Committed:
        """Collective. Gather every rank's report (``error``: this rank's failure), commit on
        rank 0 if every rank succeeded, and return the committed checkpoint on every rank; raise
        :class:`CheckpointWriteError` naming the failed rank(s) on every rank otherwise (nothing
        is committed then, older checkpoints are intact). Where rank 0's ``after_commit``
        failed, every rank returns the committed checkpoint all the same, with rank 0's message
        as :attr:`after_error` (rank 0 said it; :mod:`.after_commit_work`)."""
        report = RankReport(
            self.rank,
            self.files if error is None else [],
            None if error is None else f"{type(error).__name__}: {error}",
            self.step,
            self.layout,
        )
        gathered = dist.all_gather_json(report.to_json(), group=self.group)
        reports = [RankReport.from_json(r) for r in gathered]
        if len(reports) != self._ranks:  # the group was destroyed: its collectives are no-ops
            for r in reports:
                r.error = r.error or (
                    f"only {len(reports)} of its {self._ranks} ranks reported: the process "
                    "group was destroyed before the save finished (close() the Checkpointer, "
                    "which waits for its saves, before destroy_process_group)"
                )
        agree_steps(reports)
        failed = [r for r in reports if r.error]
        size = sum(f.size for r in reports for f in r.files)
        outcome: dict[str, Any] = {"path": None, "seq": None, "error": self._begin_error}
        if self.is_coordinator and self.staging is not None:
            if failed:
                self.strategy.abort(self.staging)
            else:
                try:
                    path, seq = self._commit(reports, metrics, reason, fingerprint, extra)
                    outcome = {"path": path, "seq": seq, "error": None}
                except Exception as e:
                    self.strategy.abort(self.staging)
                    error = error or e
                    outcome["error"] = f"{type(e).__name__}: {e}"
            if outcome["path"] is not None:  # before the outcome: every rank learns it there
                done = Committed(outcome["path"], self.step, outcome["seq"], size, reason)
                outcome["after"] = self._after(done)
        outcome = dist.broadcast_json(outcome, group=self.group)
        if outcome["path"] is None:
            if failed:
                ranks = tuple(r.rank for r in failed)
                detail = "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
            else:
                ranks, detail = (0,), f"rank 0 (commit): {outcome['error']}"
            err = CheckpointWriteError(
                sentence(
                    f"checkpoint for step {self.step} was not committed; failed on rank(s) "
                    f"{', '.join(map(str, ranks))}: {detail}"
                )
                + f" Nothing was committed and older checkpoints in {self.dirpath} are intact.",
                ranks,
            )
            if isinstance(error, OSError) and error.errno:
                err.errno = error.errno
            raise self._with_space_hint(err) from error
        self.done = done = Committed(outcome["path"], self.step, outcome["seq"], size, reason)
        self.after_error = outcome.get("after")  # (every rank the same: none raises alone)
        if self.after_error and not self.is_coordinator:  # (rank 0 said it)
            log.debug("rank 0's work after the commit of step %d failed", self.step)
        return done

    def _after(self, done: Committed) -> str | None:
        """Coordinator: ``after_commit``, once ``done`` is committed (kept as :attr:`done`).
        Its failure is said (:func:`.after_commit_work.failed`: the checkpoint is committed all
        the same, what failed after it, and what that leaves undone) and its message returned,
        never raised; None when it succeeded."""
        self.done = done
        try:
            self.after_commit(done)
        except Exception as e:  # (the upload is named where its queueing failed only)
            return after_commit_work.failed(
                self.dirpath, e, self.step, done.path, "rank 0", self.sync, self.dirpath, self.said
            )
        after_commit_work.succeeded(self.dirpath, self.said)
        return None

    def _with_space_hint(self, err: CheckpointWriteError) -> CheckpointWriteError:
        """``err``, saying what a full disk (or an exceeded quota) must hold when that is why the
        save failed (or which limit a file of the checkpoint ran into, or that the directory is
        not writable)."""
        if err.errno == errno.EFBIG:
            err.args = (
                str(err) + " A file of the checkpoint is larger than this process may write "
                "(the file-size limit, `ulimit -f`: RLIMIT_FSIZE, set by some batch schedulers) "
                "or than the filesystem allows (4 GiB on FAT32): raise the limit, or point "
                "dirpath at another filesystem.",
            )
            return err
        if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            err.args = (
                str(err) + f" {self.dirpath} is not writable by this process now (its "
                "permissions or owner changed, or its filesystem was remounted read-only, as "
                "after disk errors): make it writable again and the next save goes on; the "
                "run's checkpoints are not touched meanwhile.",
            )
            return err
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            return err
        keep = self.retention.keep_last if self.retention is not None else None
        room = (
            f"room for keep_last + 1 checkpoints ({keep + 1} here)"
            if keep is not None
            else "room for every checkpoint (keep_last=None keeps them all)"
        )
        pol = self.retention
        if keep is not None and pol is not None and pol.keep_best:
            room += f", plus up to {pol.keep_best} kept as best by {pol.monitor}"
        if keep is not None and pol is not None and pol.keep_every_n_steps:
            room += f", plus every archive step (keep_every_n_steps={pol.keep_every_n_steps})"
        hint = (
            f" The disk is full: a save writes the new checkpoint before retention deletes the "
            f"oldest, so {self.dirpath} needs {room}; free space, lower keep_last, or point "
            "dirpath at a larger disk."
        )
        if err.errno == errno.EDQUOT:  # the disk may have room; this user's share has not
            hint = (
                " The disk quota (of this user, its group or project) on the filesystem of "
                f"{self.dirpath} is exceeded: a save writes the new checkpoint before retention "
                f"deletes the oldest, so the quota needs {room}. Check it with `quota -s` (or "
                "the filesystem's own tool: `lfs quota -h -u $USER <mount>` on Lustre, "
                "`mmlsquota` on GPFS); free space within it, lower keep_last, or point dirpath "
                "at a filesystem with more quota."
            )
        held = sorted(self.sync.pending()) if self.sync is not None else []
        if held:  # the uploader's backlog: kept past keep_last until uploaded (an outage?)
            status = self.sync.status()
            error = f" (last upload error: {status.last_error})" if status.last_error else ""
            hint += (
                f" {len(held)} checkpoint(s) are held locally until their upload to "
                f"{self.sync.store.url} ({', '.join(held)}){error}: the remote store is behind, "
                "so retention cannot delete them yet."
            )
        err.args = (str(err) + hint,)
        return err

    def _commit(
        self,
        reports: list[RankReport],
        metrics: Mapping[str, float | None] | None,
        reason: str,
        fingerprint: str,
        extra: Mapping[str, Any] | None,
    ) -> tuple[str, int]:
        """Rank 0: manifest last, then rename and ``latest``."""
        assert self.staging is not None
        seq = self.seq if self.seq is not None else catalog.next_seq(self.dirpath)
        if self.tip is not None:
            self.tip.planned(seq)
        manifest = Manifest(
            step=self.step,
            run_id=self.run_id,
            seq=seq,
            world_size=self.world_size,
            files=[f for r in reports for f in r.files],
            metrics=dict(metrics or {}),
            reason=reason,
            fingerprint=fingerprint,
            retention=self.retention.to_json() if self.retention is not None else {},
            remote_retention=(
                self.remote_retention.to_json() if self.remote_retention is not None else {}
            ),
            versions=versions(),
            extra=dict(extra or {}),
            lineage=self.tip.child(seq).to_json() if self.tip is not None else {},
        )
        keys = {key_of(b.path) for b in manifest.blobs}
        # pinned until the manifest is committed: a collection meanwhile in another thread
        # (the uploader's retention) would take the staged blobs once moved into the store
        with self.blobs.pinned(keys) if self.blobs is not None else contextlib.nullcontext():
            promote_staged(self.staging, self.dirpath, manifest)  # FileParts' new blobs
            data = encode_json(manifest.to_json())
            st = self.strategy  # ours (not a subclass's own commit): `latest` in its one fsync
            if isinstance(st, RenameCommit) and type(st).commit is RenameCommit.commit:
                return st.commit(self.staging, self.step, data, latest=True), seq
            final = self.strategy.commit(self.staging, self.step, data)
        point_latest(self.dirpath, os.path.basename(final))
        return final, seq

    def _default_after_commit(self, committed: Committed) -> None:
        name = os.path.basename(committed.path)
        if self.sync is not None:
            try:
                self.sync.enqueue(name)
            except Exception as e:
                raise after_commit_work.UploadNotQueued(name) from e
        if self.retention is not None:
            protected = {name, *(self.sync.pending() if self.sync is not None else ())}
            # (the manifests read by the passes before, of this process's sessions: a session
            # per save read every one kept; a folder it cannot delete is said once)
            lock, seen = known.shared(self.dirpath)
            with lock:
                seen.forget(name)  # (its name and inode may be those of one deleted since)
                apply_retention(
                    self.dirpath, self.retention, self.run_id, protected, known=seen, said=self.said
                )
