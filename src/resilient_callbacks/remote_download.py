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
from typing import TYPE_CHECKING, Any

from . import remote_blobs
from .catalog import Depth, verify, verify_entries
from .commit import STAGING_PREFIX, fsync_tree
from .errors import CheckpointCorruptError
from .manifest import MANIFEST_NAME
from .progress import Progress

if TYPE_CHECKING:
    from .manifest import FileEntry
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
    counts as arrived, and its checksum is verified with the others: one that fails it is
    fetched again, once (:func:`_fetch_kept_again`), before the checkpoint is called damaged.
    Without it, a new folder, removed when this raises."""
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
        left, kept = arrived(staging, m.files, f"{store.url}/{entry.name}")
        _get(store, entry, staging, left, progress)
        with open(os.path.join(staging, MANIFEST_NAME), "wb") as fh:
            fh.write(store.fs.cat_file(store._path(entry.name, MANIFEST_NAME)))
        for rel in [f.path for f in m.files] + [MANIFEST_NAME]:  # the manifest too
            with open(os.path.join(staging, rel), "rb+") as fh:
                os.fsync(fh.fileno())
        try:
            verify(staging, m, Depth.FULL)
        except CheckpointCorruptError as e:
            if not _fetch_kept_again(store, entry, staging, kept, e):
                raise
            verify(staging, m, Depth.FULL)
        fsync_tree(staging)  # (every folder: parts/<id>/ hold files too)
    except BaseException:
        if own:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging, entry.name


def _get(
    store: RemoteStore, entry: RemoteEntry, staging: str, files: list[FileEntry], progress: Any
) -> None:
    """Fetch ``files`` of ``entry`` into ``staging``, each overwritten, with a progress bar."""
    bar = Progress(
        sum(f.size for f in files), f"downloading {entry.name} from {store.url}", bar=progress
    )
    try:
        if files:
            store.fs.get(
                [store._path(entry.name, f.path) for f in files],
                [os.path.join(staging, f.path) for f in files],
                callback=bar.multi_callback(),
            )
    finally:
        bar.close()


def _fetch_kept_again(
    store: RemoteStore,
    entry: RemoteEntry,
    staging: str,
    kept: list[FileEntry],
    error: CheckpointCorruptError,
) -> bool:
    """The checksum verification failed (``error``): fetch again the files of ``kept`` (taken
    from an earlier try for their size) that fail it, and say so; False when none does (the
    damage is in what this try fetched, or in a blob: the checkpoint is damaged). A file an
    earlier try left with its size and other bytes (a transfer of that try still writing it
    after the try failed, a torn write) made the restore skip the checkpoint for an older one,
    where a try with a folder of its own fetched it whole."""
    bad = failing(staging, kept)
    if not bad:
        return False
    log.warning(
        "%s/%s: %s; %d file(s) kept from an earlier try fail their checksum: fetching them again",
        store.url,
        entry.name,
        error,
        len(bad),
    )
    for f in bad:
        os.unlink(os.path.join(staging, f.path))
    _get(store, entry, staging, bad, None)
    for f in bad:
        with open(os.path.join(staging, f.path), "rb+") as fh:
            os.fsync(fh.fileno())
    return True


def arrived(
    staging: str, files: list[FileEntry], where: str
) -> tuple[list[FileEntry], list[FileEntry]]:
    """``(left, kept)``: the files of ``files`` that ``staging`` does not hold whole yet, to
    fetch, and those an earlier try left there with the manifest's size (said, when any), whose
    checksums are still verified (:func:`failing`). Shared and node-local mode's retries."""
    left = [f for f in files if not _whole(os.path.join(staging, f.path), f.size)]
    if len(left) < len(files):
        log.warning(
            "%d of %d file(s) of %s arrived whole before the last try failed; fetching the "
            "other %d",
            len(files) - len(left),
            len(files),
            where,
            len(left),
        )
    return left, [f for f in files if f not in left]


def failing(staging: str, kept: list[FileEntry]) -> list[FileEntry]:
    """The files of ``kept`` (taken from an earlier try for their size) that fail their
    checksum: a transfer of that try still writing one after the try failed, a torn write."""
    bad = []
    for f in kept:
        try:
            verify_entries(staging, [f])
        except CheckpointCorruptError:
            bad.append(f)
    return bad


def _whole(path: str, size: int) -> bool:
    try:
        return os.path.getsize(path) == size
    except OSError:
        return False
