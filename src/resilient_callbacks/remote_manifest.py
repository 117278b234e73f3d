"""The remote commit point's one write: a manifest put into the store so that no reader ever
sees part of it (:func:`put_manifest`).

Which ranks call what: the process that commits remotely (the coordinator); nothing collective.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from typing import TYPE_CHECKING

from .manifest import MANIFEST_NAME
from .upload_thread import not_superseded

if TYPE_CHECKING:
    from .remote import RemoteStore


def put_manifest(st: RemoteStore, path: str, data: bytes) -> None:
    """The commit point: ``data`` as the manifest at ``path``. On a local filesystem
    (``file://``) written beside it, fsynced and renamed into place: a write cut off (a full
    disk, a kill) left a torn ``manifest.json``, a checkpoint committed and damaged; an object
    store's PUT is atomic. Raises where the next writer took the store over from this upload
    thread (:func:`.upload_thread.not_superseded`)."""
    not_superseded(st.url)
    if not st.is_local:
        st.fs.pipe_file(path, data)
        return
    tmp = posixpath.join(posixpath.dirname(path), f".{MANIFEST_NAME}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    st._fsync_local([path])
