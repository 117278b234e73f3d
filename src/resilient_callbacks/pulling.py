"""Fetch a committed checkpoint from a remote store into a local directory, verified, moved
into place atomically, under the directory's lock. One job, for ``resilient-ckpt pull`` and
for readers that fall back to the remote tier (:class:`~.dcp.ResilientStorageReader`).

Runs in one process (the caller's rank 0): no collective.
"""

from __future__ import annotations

import os
import shutil

from . import catalog
from .catalog import Depth
from .commit import fsync_dir, remove_checkpoint, sweep_staging
from .errors import CheckpointError, CheckpointNotFoundError
from .lock import DirLock
from .manifest import MANIFEST_NAME, read_manifest
from .remote import RemoteEntry, RemoteStore


def usable(st: RemoteStore, step: int | None = None) -> list[RemoteEntry]:
    """The committed remote checkpoints whose listed sizes match their manifests (of ``step``
    only, if given), oldest commit first; :class:`CheckpointNotFoundError` if there is none."""
    remote = [e for e in st.scan() if e.manifest is not None]
    if step is not None:
        remote = [e for e in remote if e.manifest is not None and e.manifest.step == step]
    good = [e for e in remote if e.problem is None]
    if not good:
        what = f"no checkpoint of step {step}" if step is not None else "no checkpoints"
        bad = "" if not remote else f" ({len(remote)} with files missing or of the wrong size)"
        raise CheckpointNotFoundError(f"{what} in {st.url}{bad}")
    return good


def pull(
    st: RemoteStore, entry: RemoteEntry, dirpath: str, command: str | None = None
) -> tuple[str, bool]:
    """Download ``entry`` into ``dirpath`` unless a verified copy of it is there already;
    returns ``(local path, downloaded)``. Takes ``dirpath``'s lock (a running writer holds it:
    :class:`CheckpointError` naming it); ``command`` names the ``resilient-ckpt`` command pulling,
    which a writer starting meanwhile waits for (:class:`~.lock.DirLock`). Never overwrites
    another checkpoint of that name."""
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
                "of this library leaves one); refusing to replace it. Remove it (`resilient-ckpt "
                f"gc {dirpath}` does) or pull into an empty directory"
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
        staging, _ = st.download(entry, dirpath, progress=None)
        try:
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_dir(dirpath)
        return final, True
    finally:
        lock.release()
