"""Fetch a committed checkpoint from a remote store into a local directory, verified, moved
into place atomically, under the directory's lock. One job, for ``resilient-ckpt pull`` and
for readers that fall back to the remote tier (:class:`~.dcp.ResilientStorageReader`).

The listing and the download are bounded against a dying store (:mod:`.stall`): given up with
:class:`~.errors.RemoteUnavailableError` naming the checkpoint and the files under way once no
byte has arrived for the outage limit (5 minutes), a long download's progress logged.

Runs in one process (the caller's rank 0): no collective.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
from collections.abc import Callable

from . import branches, catalog, redact, stall
from .catalog import Depth
from .commit import fsync_dir, remove_checkpoint, sweep_staging
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    nothing_found,
)
from .lock import DirLock
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .remote import RemoteEntry, RemoteStore
from .remote_claims import REMOTE_CKPT_RE

log = logging.getLogger("resilient_callbacks")


def usable(
    st: RemoteStore, step: int | None = None, passed: list[RemoteEntry] | None = None
) -> list[RemoteEntry]:
    """The committed remote checkpoints whose listed sizes match their manifests (of ``step``
    only, if given), oldest commit first; :class:`CheckpointNotFoundError` if there is none
    (marked :func:`.errors.nothing_found` where the store holds no committed checkpoint at all).
    ``passed`` (without ``step``): filled with the checkpoints listed after the newest of them
    that are not (torn, or without a manifest yet), for the caller to say."""
    listed = stall.run(st.scan, f"listing {st.url}", who="the pull")
    remote = [e for e in listed if e.manifest is not None]
    steps = sorted({e.manifest.step for e in remote if e.manifest is not None})
    if step is not None:
        remote = [e for e in remote if e.manifest is not None and e.manifest.step == step]
    off = branches.off_lineage((m.run_id, m.seq, m.lineage) for m in _manifests(remote))
    # (a roll-back's abandoned branch counts as older than the current lineage: branches.py)
    good = sorted((e for e in remote if e.problem is None), key=lambda e: e.key not in off)
    if not good:
        what = f"no checkpoint of step {step}" if step is not None else "no checkpoints"
        bad = "" if not remote else f" ({len(remote)} with files missing or of the wrong size)"
        if not remote and step is not None and steps:  # (as verify and inspect say it)
            bad = f" (its steps: {', '.join(map(str, steps))})"
        missing = CheckpointNotFoundError(f"{what} in {st.url}{bad}")
        raise missing if steps else nothing_found(missing)  # (none at all: resilient-ckpt's 3)
    if passed is not None and step is None:  # (committed by commit order, then the rest)
        after = listed[next(i for i, e in enumerate(listed) if e is good[-1]) + 1 :]
        top = good[-1].manifest.step if good[-1].manifest is not None else 0
        passed += [  # (one without a manifest of an older step: not passed over, as verify's)
            e
            for e in after
            if e.problem is not None
            and (named := REMOTE_CKPT_RE.match(e.name))
            and (e.manifest is not None or int(named.group(1)) > top)
        ]
    return good


def _manifests(entries: list[RemoteEntry]) -> list[Manifest]:
    return [e.manifest for e in entries if e.manifest is not None]


def pull_newest_whole(
    st: RemoteStore,
    entries: list[RemoteEntry],
    dirpath: str,
    command: str | None = None,
    skipping: Callable[[RemoteEntry, CheckpointCorruptError], None] | None = None,
) -> tuple[RemoteEntry, str, bool]:
    """:func:`pull` the newest of ``entries`` (oldest first, as :func:`usable` lists them) whose
    every checksum matches: one found damaged (a file or a blob rotted in place, its size
    right) is passed to ``skipping`` and the next newest is tried, as a restore falls back.
    Returns ``(entry, local path, downloaded)``; raises the last one's
    :class:`CheckpointCorruptError` (saying how to find a whole one) when none is whole."""
    left = list(entries)
    while True:
        entry = left.pop()
        try:
            return (entry, *pull(st, entry, dirpath, command))
        except CheckpointCorruptError as e:
            if not left:
                raise CheckpointCorruptError(
                    f"{st.url}/{entry.name}: {e}. {redact.command('verify', st.url, '--all')} says "
                    "which remote checkpoints are whole; pull one of them with --step N"
                ) from e
            if skipping is not None:
                skipping(entry, e)


def pull(
    st: RemoteStore, entry: RemoteEntry, dirpath: str, command: str | None = None
) -> tuple[str, bool]:
    """Download ``entry`` into ``dirpath`` unless a verified copy of it is there already;
    returns ``(local path, downloaded)``. Takes ``dirpath``'s lock (a running writer holds it:
    :class:`CheckpointError` naming it); ``command`` names the ``resilient-ckpt`` command pulling,
    which a writer starting meanwhile waits for (:class:`~.lock.DirLock`). Never overwrites
    another checkpoint of that name. A download that fails (a remote file or blob whose
    checksum is wrong: :class:`~.errors.CheckpointCorruptError`) leaves no blob in
    ``dirpath/blobs`` that no checkpoint there names."""
    assert entry.manifest is not None
    os.makedirs(dirpath, exist_ok=True)
    lock = DirLock(dirpath, command=command)
    lock.acquire()
    final = os.path.join(dirpath, entry.name)
    try:
        sweep_staging(dirpath)  # what a pull or a save killed here left (logged)
        if os.path.lexists(final) and not os.path.exists(os.path.join(final, MANIFEST_NAME)):
            raise CheckpointError(
                f"{final} exists and is not a committed checkpoint (no {MANIFEST_NAME}: no save "
                f"of this library leaves one); refusing to replace it. {_remove_hint(dirpath, final)}"
            )
        if os.path.exists(os.path.join(final, MANIFEST_NAME)):
            here = read_manifest(final)
            if (here.run_id, here.seq) != entry.key:
                raise CheckpointError(
                    f"{final} holds another checkpoint; refusing to overwrite it (pull into an "
                    "empty directory)"
                )
            missing = {f.path for f in entry.manifest.files} - {f.path for f in here.files}
            if missing:
                node = here.extra.get("node") or {}
                which = f" (node-local: ranks {node.get('ranks')})" if node else ""
                raise CheckpointError(
                    f"{final} holds only part of that checkpoint{which}: {len(missing)} of its "
                    f"{len(entry.manifest.files)} files are not there. Pull into an empty "
                    "directory to get all of it"
                )
            try:
                catalog.verify(final, here, Depth.FULL)
            except CheckpointError:
                remove_checkpoint(final)  # a damaged copy: fetched again
            else:
                return final, False
        try:
            url = f"{st.url}/{entry.name}"
            staging, _ = stall.download(st, entry, dirpath, url, who="the pull")
        except BaseException:
            _drop_unnamed_blobs(dirpath)
            raise
        try:
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_dir(dirpath)
        return final, True
    finally:
        lock.release()


def _remove_hint(dirpath: str, final: str) -> str:
    """How to get ``final`` (a folder without a manifest in ``dirpath``) out of the way: ``gc``
    removes it where ``dirpath`` is a checkpoint directory of ours; where nothing else there
    says so, ``gc`` leaves it alone (it may be another tool's: :func:`.catalog.foreign_folders`),
    so it is removed by hand, if it is a leftover."""
    scanned = catalog.scan(dirpath, Depth.NONE)
    if os.path.basename(final) not in catalog.foreign_folders(dirpath, scanned):
        return f"Remove it ({redact.command('gc', dirpath)} does) or pull into an empty directory"
    return (
        f"Nothing else in {dirpath} shows it is a checkpoint directory of resilient_callbacks, "
        "so `resilient-ckpt gc` leaves it alone (it may be another tool's): if it is a "
        f"leftover, remove it yourself (`rm -r {shlex.quote(final)}`), or pull into an empty "
        "directory"
    )


def _drop_unnamed_blobs(dirpath: str) -> None:
    """With ``dirpath``'s lock held: delete the blobs a failed download fetched into its store
    that no checkpoint there names (no writer is open: the lock is ours)."""
    from .blobs import BlobStore

    try:
        BlobStore(dirpath).collect()
    except OSError as e:
        log.warning("could not delete the blobs a failed pull left in %s: %s", dirpath, e)
