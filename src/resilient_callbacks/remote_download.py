"""Downloading a committed remote checkpoint into a local staging folder, every checksum
verified before the caller moves it into place (:meth:`.remote.RemoteStore.download`).

Which ranks call what: only those that read the remote store (the coordinator; ``pull``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from typing import TYPE_CHECKING

from . import remote_blobs
from .catalog import Depth, verify
from .commit import STAGING_PREFIX, fsync_tree
from .manifest import MANIFEST_NAME
from .progress import Progress

if TYPE_CHECKING:
    from .remote import RemoteStore
    from .remote_listing import RemoteEntry

log = logging.getLogger("resilient_callbacks")


def download(
    store: RemoteStore,
    entry: RemoteEntry,
    local_root: str,
    progress: bool | None = None,
    staging: str | None = None,
) -> tuple[str, str]:
    """Download a committed remote checkpoint into a staging directory under
    ``local_root`` and verify every checksum. Returns ``(staging_dir, name)``; the caller
    moves it into place. Raises :class:`CheckpointCorruptError` or ``OSError``.

    ``staging``: the folder to download into, made if missing and kept when this raises (the
    caller removes it once it gives up): a try after one that failed part-way (a 5xx burst, a
    reset) fetches only the files that did not arrive whole; a file of the manifest's size
    counts as arrived, and its checksum is verified with the others. Without it, a new
    folder, removed when this raises."""
    assert entry.manifest is not None
    m = entry.manifest
    own = staging is None
    if staging is None:
        staging = os.path.join(local_root, f"{STAGING_PREFIX}{entry.name}-{uuid.uuid4().hex[:12]}")
    os.makedirs(staging, exist_ok=not own)
    with contextlib.suppress(FileNotFoundError):  # an earlier try's: "every byte arrived" (stall)
        os.unlink(os.path.join(staging, MANIFEST_NAME))
    try:
        for f in m.files:
            if "/" in f.path:
                os.makedirs(os.path.dirname(os.path.join(staging, f.path)), exist_ok=True)
        remote_blobs.download(store, m, local_root, staging)  # verified, before the manifest
        left = [f for f in m.files if not _whole(os.path.join(staging, f.path), f.size)]
        if len(left) < len(m.files):
            log.warning(
                "%d of %d file(s) of %s/%s arrived whole before the last try failed; fetching "
                "the other %d",
                len(m.files) - len(left),
                len(m.files),
                store.url,
                entry.name,
                len(left),
            )
        total = sum(f.size for f in left)
        bar = Progress(total, f"downloading {entry.name} from {store.url}", bar=progress)
        try:
            if left:
                store.fs.get(
                    [store._path(entry.name, f.path) for f in left],
                    [os.path.join(staging, f.path) for f in left],
                    callback=bar.multi_callback(),
                )
        finally:
            bar.close()
        with open(os.path.join(staging, MANIFEST_NAME), "wb") as fh:
            fh.write(store.fs.cat_file(store._path(entry.name, MANIFEST_NAME)))
        for rel in [f.path for f in m.files] + [MANIFEST_NAME]:  # the manifest too
            with open(os.path.join(staging, rel), "rb+") as fh:
                os.fsync(fh.fileno())
        verify(staging, m, Depth.FULL)
        fsync_tree(staging)  # (every folder: parts/<id>/ hold files too)
    except BaseException:
        if own:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging, entry.name


def _whole(path: str, size: int) -> bool:
    try:
        return os.path.getsize(path) == size
    except OSError:
        return False
