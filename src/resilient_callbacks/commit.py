"""Atomic commit of a checkpoint directory on a POSIX filesystem.

The strategy: every file is written into a hidden staging directory next to the final one;
files are fsynced as they are written, then the manifest is written last and fsynced, the
staging directory and every folder in it are fsynced, the staging directory is renamed to its
final name, the advisory ``latest`` pointer is replaced, and the parent directory is fsynced
(once: it makes both the rename and ``latest`` durable). A crash or a power loss at any point
leaves either no checkpoint or a complete one; leftovers are hidden ``.staging-*`` directories
that :func:`sweep_staging` removes when the next writer starts.

Deleting is ordered the other way round (:func:`remove_checkpoints`): the checkpoint is renamed
to a hidden ``.trash-*`` name and the parent directory fsynced *before* any of its files (or
the blobs only it named) are deleted, so that a power loss cannot bring back a checkpoint whose
files are partly gone.

Which ranks call what: the coordinator (rank 0) calls :meth:`RenameCommit.begin`,
:meth:`~RenameCommit.commit` and :meth:`~RenameCommit.abort`; every rank writes its own files
into the staging directory returned by ``begin`` (the directory must be on a filesystem that all
ranks share).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Protocol

from .errors import CheckpointWriteError
from .filewrite import write_bytes
from .manifest import MANIFEST_NAME

log = logging.getLogger("resilient_callbacks")

STAGING_PREFIX = ".staging-"
LATEST_TMP_PREFIX = ".latest."
CKPT_RE = re.compile(r"^step_(\d+)(?:-(\d+))?$")


def ckpt_name(step: int, n: int = 0) -> str:
    return f"step_{step:09d}" + (f"-{n}" if n else "")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems do not support fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every directory under ``path``, deepest first, then ``path`` itself: a file in a
    subfolder (``parts/<id>/``, ``dcp/``) is durable only once its own folder is."""
    for dirpath, _, _ in reversed(list(os.walk(path))):
        fsync_dir(dirpath)


def ensure_dir(path: str) -> None:
    """Create the directory ``path`` if it is missing, and fsync the parent of every level it
    created: a new folder's name is durable only once its parent is fsynced (else a power loss
    can take the folder, and every checkpoint in it, away). Nothing is synced if it exists. A
    parent that cannot be opened to sync it (write but no read permission) gets a warning."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    os.makedirs(path, exist_ok=True)
    for p in reversed(missing):
        try:
            fsync_dir(os.path.dirname(p))
        except PermissionError as e:  # a parent one may write in but not read (mode -wx)
            log.warning(
                "created %s, but could not sync its parent (%s): a power loss may take the new "
                "folder away; make the parent readable to have it synced",
                p,
                e,
            )


def open_dir(path: str) -> None:
    """Create the run directory ``path`` if it is missing and make it durable as it is: its
    name in its parent and its own entries (what another process, or a writer that crashed,
    created there without syncing: the ``blobs/`` folder). Two fsyncs, once per opening."""
    ensure_dir(path)
    for d in (os.path.dirname(os.path.abspath(path)), path):
        try:
            fsync_dir(d)
        except OSError as e:  # the commits fsync again; a failing disk shows there
            log.warning("could not sync %s (%s): a power loss may undo recent changes in it", d, e)


class CommitStrategy(Protocol):
    """How a set of files becomes one checkpoint atomically; one protocol for a POSIX directory
    (:class:`RenameCommit`) and an object store (:class:`~.remote_objects.ManifestLastCommit`).

    Which ranks call what: rank 0 (or the one process that uploads) calls all three methods.
    Every writer puts its files into the staging location ``begin`` returned; ``commit`` writes
    the manifest last and makes the checkpoint visible in one step -- before it returns, no
    reader sees the checkpoint; after it, readers see every file the manifest lists."""

    def begin(self, step: int) -> str:
        """Create and return a fresh staging location for ``step``."""
        ...

    def commit(self, staging: str, step: int, manifest: bytes) -> str:
        """Write ``manifest`` (the manifest file's bytes) last and make ``staging`` the
        checkpoint for ``step``; return where it now is. Raises if it could not: then nothing
        is visible."""
        ...

    def abort(self, staging: str) -> None:
        """Remove ``staging``; nothing becomes visible."""
        ...


class RenameCommit:
    """Staging directory + fsync + rename: the commit strategy for local/POSIX directories."""

    def __init__(self, root: str) -> None:
        self.root = root

    def begin(self, step: int) -> str:
        """Create and return a fresh staging directory for ``step`` (coordinator only)."""
        path = os.path.join(self.root, f"{STAGING_PREFIX}{ckpt_name(step)}-{uuid.uuid4().hex[:12]}")
        os.makedirs(path)
        return path

    def final_name(self, step: int) -> str:
        n = 0
        while os.path.lexists(os.path.join(self.root, ckpt_name(step, n))):
            n += 1
        return ckpt_name(step, n)

    def commit(self, staging: str, step: int, manifest: bytes, *, latest: bool = False) -> str:
        """Write the manifest into ``staging`` (fsynced), fsync ``staging`` and every folder in
        it, then rename ``staging`` to the checkpoint's name for ``step`` and fsync the parent
        directory; return its final path. Durable when it returns: a power loss after it
        keeps the checkpoint. Never replaces an existing checkpoint. ``latest``: point the
        advisory ``latest`` file at it before the parent is fsynced (one fsync for both).
        Raises :class:`CheckpointWriteError` if a file the manifest lists is not in
        ``staging`` (nothing is committed then)."""
        files = json.loads(manifest).get("files") or []
        missing = [f["path"] for f in files if not os.path.exists(os.path.join(staging, f["path"]))]
        if missing:
            raise CheckpointWriteError(
                f"files listed in the manifest are not in the staging directory {staging}: "
                f"{missing}. With several ranks, files written by other ranks are not visible "
                "to rank 0: dirpath must be on a filesystem all ranks share."
            )
        write_bytes(os.path.join(staging, MANIFEST_NAME), manifest)
        fsync_tree(staging)
        for _ in range(100):
            final = os.path.join(self.root, self.final_name(step))
            try:
                # os.rename onto an existing non-empty directory fails (ENOTEMPTY/EEXIST) rather
                # than replacing it, so a concurrent name clash cannot destroy a checkpoint.
                if os.path.lexists(final):
                    continue
                os.rename(staging, final)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    continue
                raise CheckpointWriteError(
                    f"could not move the staged checkpoint {staging} into place at {final}: {e}"
                ) from e
            if latest:
                point_latest(self.root, os.path.basename(final))
            try:
                fsync_dir(self.root)
            except OSError as e:  # renamed: visible and loadable, so committed; said so
                log.warning(
                    "committed %s, but syncing its directory failed (%s): a power loss before "
                    "the filesystem writes it back may undo the rename",
                    final,
                    e,
                )
            return final
        raise CheckpointWriteError(f"could not find a free name for step {step} in {self.root}")

    def abort(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)


TRASH_PREFIX = ".trash-"


def remove_checkpoint(path: str, discard: Callable[[str], None] | None = None) -> None:
    """Delete a committed checkpoint so that no crash can leave a torn one: rename it to a hidden
    trash name first (atomic: it stops being a checkpoint at once) and fsync its directory
    (durable: a power loss cannot undo the rename once files are deleted), then delete the
    files, here or, with ``discard``, by handing the trash directory to it (a
    :class:`~.trash.TrashBin`). A crash mid-delete leaves a ``.trash-*`` directory that
    :func:`sweep_staging` removes."""
    root = os.path.dirname(path.rstrip("/"))
    trash = _to_trash(path)
    fsync_dir(root)
    _delete(trash, discard)


def remove_checkpoints(
    root: str,
    names: list[str],
    discard: Callable[[str], None] | None = None,
    failed: Callable[[str, OSError], None] | None = None,
) -> list[str]:
    """:func:`remove_checkpoint` for several checkpoints of ``root`` with one directory fsync:
    every one is renamed to the trash, ``root`` is fsynced, then their files are deleted.
    Returns the names removed; ``failed(name, error)`` hears of each one that could not be
    (raised otherwise). The caller deletes blobs only they named after this returns."""
    trashed: list[tuple[str, str]] = []
    for name in names:
        try:
            trashed.append((name, _to_trash(os.path.join(root, name))))
        except OSError as e:
            if failed is None:
                raise
            failed(name, e)
    try:
        if trashed:
            fsync_dir(root)  # the renames are durable before any file goes
    except OSError as e:  # deleting now could leave torn checkpoints: the next sweep does it
        if failed is None:
            raise
        for name, _ in trashed:
            failed(name, e)
        return []
    done = []
    for name, trash in trashed:
        try:
            _delete(trash, discard)
            done.append(name)
        except OSError as e:  # renamed out of sight: the next writer's sweep finishes it
            if failed is None:
                raise
            failed(name, e)
    return done


def _to_trash(path: str) -> str:
    root, name = os.path.split(path.rstrip("/"))
    trash = os.path.join(root, f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    return trash


def _delete(trash: str, discard: Callable[[str], None] | None) -> None:
    if discard is not None:
        discard(trash)
        return
    shutil.rmtree(trash, ignore_errors=True)
    if os.path.exists(trash):
        raise OSError(f"could not delete {trash} completely")


def sweep_staging(root: str) -> list[str]:
    """Remove what interrupted saves and deletions left (staging and trash directories,
    temporary ``latest`` files) and log it; return the names removed. A folder named like a
    checkpoint but without a manifest is left alone: no save of ours leaves one (the rename
    that makes a checkpoint carries its manifest), so it is someone's, and ``gc`` removes it
    when asked. Call only while holding the directory lock (no save is in progress then)."""
    removed: list[str] = []
    stuck: list[str] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)
            (stuck if os.path.lexists(path) else removed).append(name)
        elif name.startswith(LATEST_TMP_PREFIX):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
    if removed:
        log.warning(
            "removed %d leftover(s) of interrupted saves or deletions in %s: %s",
            len(removed),
            root,
            ", ".join(sorted(removed)),
        )
    if stuck:
        log.warning(
            "could not remove %d leftover(s) of interrupted saves or deletions in %s: %s (a "
            "file in them cannot be deleted: still open on NFS, immutable, or not ours to "
            "delete); they are never loaded, remove them once that is resolved",
            len(stuck),
            root,
            ", ".join(sorted(stuck)),
        )
    return removed


def replace_file(
    path: str, data: bytes, *, tmp_prefix: str | None = None, sync_folder: bool = True
) -> None:
    """Make ``data`` the file ``path`` atomically and durably: written to a hidden temporary
    file beside it (``tmp_prefix`` + a random part; default ``.<name>.tmp-``), fsynced, renamed
    over ``path``, the folder fsynced (``sync_folder=False``: the caller fsyncs it later). A
    kill or a power loss leaves the old file or the new one, never a truncated one."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f"{tmp_prefix or f'.{name}.tmp-'}{uuid.uuid4().hex[:8]}")
    try:
        write_bytes(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_folder:
        fsync_dir(folder)


def point_latest(root: str, name: str) -> None:
    """:func:`write_latest_pointer`, never raising: one that cannot be written (a full disk) is
    removed rather than left naming a checkpoint retention deletes, and a warning says so."""
    try:
        write_latest_pointer(root, name)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(root, "latest"))
        log.warning("could not update the advisory 'latest' pointer (removed it): %s", e)


def write_latest_pointer(root: str, name: str) -> None:
    """Advisory ``latest`` file naming the newest checkpoint, for humans and shell scripts:
    written to a temporary file, fsynced and renamed over ``latest`` (durable once ``root``
    is fsynced, which :meth:`RenameCommit.commit` does after it). Discovery never trusts it:
    manifests decide."""
    latest = os.path.join(root, "latest")
    replace_file(latest, f"{name}\n".encode(), tmp_prefix=LATEST_TMP_PREFIX, sync_folder=False)
