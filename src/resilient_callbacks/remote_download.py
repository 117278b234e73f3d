"""Downloading a committed remote checkpoint into a local staging folder, every checksum
verified before the caller moves it into place (:meth:`.remote.RemoteStore.download`).

Which ranks call what: only those that read the remote store (the coordinator; ``pull``).
"""

from __future__ import annotations

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


def download(
    store: RemoteStore, entry: RemoteEntry, local_root: str, progress: bool | None = None
) -> tuple[str, str]:
    """Download a committed remote checkpoint into a staging directory under
    ``local_root`` and verify every checksum. Returns ``(staging_dir, name)``; the caller
    moves it into place. Raises :class:`CheckpointCorruptError` or ``OSError``."""
    assert entry.manifest is not None
    m = entry.manifest
    staging = os.path.join(local_root, f"{STAGING_PREFIX}{entry.name}-{uuid.uuid4().hex[:12]}")
    os.makedirs(staging)
    try:
        for f in m.files:
            if "/" in f.path:
                os.makedirs(os.path.dirname(os.path.join(staging, f.path)), exist_ok=True)
        remote_blobs.download(store, m, local_root, staging)  # verified, before the manifest
        bar = Progress(m.total_bytes, f"downloading {entry.name} from {store.url}", bar=progress)
        try:
            store.fs.get(
                [store._path(entry.name, f.path) for f in m.files],
                [os.path.join(staging, f.path) for f in m.files],
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
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging, entry.name
