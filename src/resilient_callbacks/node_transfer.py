"""What a node leader's upload thread (:class:`~.node_upload.NodeUploader`) does with one node's
part of a checkpoint against the store: upload it under the node's mark and check every object
(:func:`upload_part`, :func:`check_part`), take note of a name another writer has
(:func:`part_taken`), and delete what it put of a part the coordinator dropped or moved
(:func:`delete_part`).

Which ranks call what: the upload thread of the :class:`~.node_upload.NodeUploader` on every
node leader, for its own node's files; nothing here is collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import time
from typing import TYPE_CHECKING

from . import remote_put
from .catalog import verify_entries
from .errors import CheckpointCorruptError
from .progress import Progress
from .redact import url_text
from .remote_claims import RemoteNameTaken, claim_part, part_mark
from .remote_objects import check_uploaded

if TYPE_CHECKING:
    from .node_upload import NodeUploader, UploadJob

log = logging.getLogger("resilient_callbacks")


def delete_part(up: NodeUploader, job: UploadJob) -> None:
    """This thread: delete this node's objects of ``job``'s checkpoint, which the
    coordinator dropped or moved (never committed: no manifest names them), and its mark.
    Once; what is left (an outage) lies without a manifest, invisible, until ``gc
    --remote``. A part that found its name taken put nothing there: nothing is deleted."""
    st = up.store
    if job.taken:
        return
    try:
        base = posixpath.join(st.root, job.remote_name)
        for f in job.files:
            with contextlib.suppress(FileNotFoundError):
                st.fs.rm_file(posixpath.join(base, f.path))
        # last: no other writer takes the name before (also a killed attempt's mark)
        with contextlib.suppress(FileNotFoundError):
            st.fs.rm_file(part_mark(st, job.remote_name, job.key, job.tag, up.node))
        if st.is_local:  # the folders it made, once empty (another node's files stay)
            dirs = {base}
            for f in job.files:
                parts = f.path.split("/")[:-1]
                dirs |= {posixpath.join(base, *parts[:i]) for i in range(1, len(parts) + 1)}
            for d in sorted(dirs, key=len, reverse=True):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        log.info("removed node %d's part of dropped %s from %s", up.node, job.remote_name, st.url)
    except Exception as e:
        log.warning(
            "remote %s: could not remove node %d's part of %s, which is not committed "
            "(gc --remote removes it): %s",
            st.url,
            up.node,
            job.remote_name,
            url_text(str(e)),
        )


def check_part(up: NodeUploader, local: str, job: UploadJob, rpaths: list[str]) -> None:
    """Each uploaded object of this node: its size, and its MD5 ETag where the store gives
    one (single-part objects up to 8 MiB). One HEAD per object: O(own files) requests per
    node, never a listing of the whole checkpoint (which would be O(N) per node)."""
    st = up.store
    for f, rpath in zip(job.files, rpaths, strict=True):
        # refresh: s3fs would answer from a cached listing of the parent, which the
        # coordinator's committer thread (the same filesystem object) may have taken
        # while this node's files were still being uploaded: a spurious "not found"
        info = st.fs.info(rpath, refresh=True)
        where = f"{st.url}/{job.remote_name}/{f.path}"
        check_uploaded(info, where, f.size, os.path.join(local, f.path))


def upload_part(up: NodeUploader, job: UploadJob) -> None:
    local = os.path.join(up.local_root, job.local_name)
    if not os.path.isdir(local):
        log.warning("remote: %s was removed locally before it was uploaded", job.local_name)
        with up._cond:
            up.skipped[job.remote_name] = "its local copy was removed before its upload"
        return
    try:  # the committed bytes, or nothing goes up: never a rotten file made durable
        verify_entries(local, job.files)
    except CheckpointCorruptError as e:
        with up._cond:
            up.skipped[job.remote_name] = f"its local copy is damaged ({e})"
        log.error(
            "remote: not uploading node %d's part of %s, its local copy is damaged: %s; "
            "it is not committed remotely",
            up.node,
            job.local_name,
            e,
        )
        return
    st = up.store
    t0 = time.perf_counter()
    log.info(
        "uploading node %d's part of %s (%d files) to %s",
        up.node,
        job.local_name,
        len(job.files),
        st.url,
    )
    rpaths = [posixpath.join(st.root, job.remote_name, f.path) for f in job.files]
    if job.mark is None:  # (a retry keeps the mark it put)
        try:
            job.mark = claim_part(st, job.remote_name, job.key, job.tag, up.node, job.files)
        except RemoteNameTaken as e:
            part_taken(up, job, e)
            return
    if st.is_local:
        for p in {posixpath.dirname(x) for x in rpaths}:
            st.fs.makedirs(p, exist_ok=True)
    progress = Progress(
        sum(f.size for f in job.files),
        f"uploading node {up.node}'s part of {job.local_name} to {st.url}",
        bar=False,
        log_every_s=30.0,
    )
    with up._transfer(progress):  # its last byte's time: wait() tells a stalled store
        lpaths = [os.path.join(local, f.path) for f in job.files]
        remote_put.put(st, lpaths, rpaths, progress)  # (counted, fenced)
        check_part(up, local, job, rpaths)
    if st.is_local:
        st._fsync_local(rpaths)
    with up._cond:
        if job.dropped:  # the coordinator dropped it meanwhile: never committed
            up._deletes.append(job)
        else:
            up._reports.append({"key": list(job.key), "name": job.remote_name})
            up._uploaded[job.key] = job
        up.counters.files += len(job.files)
        up.counters.bytes += sum(f.size for f in job.files)
        up.counters.checkpoints += 1
        up.counters.seconds += time.perf_counter() - t0
    log.info("uploaded node %d's part of %s to %s", up.node, job.local_name, st.url)


def part_taken(up: NodeUploader, job: UploadJob, e: RemoteNameTaken) -> None:
    """Another writer has ``job``'s name: nothing goes there; the coordinator is told, and
    moves the commit to a free name (:meth:`~.node_upload.NodeUploader.settle`). Held locally until then. Or it is
    this checkpoint, committed there already (``e.committed``): the coordinator is told."""
    if e.committed:  # (taken for another writer's, it was committed again as name-rN)
        log.info("remote: %s; node %d does not upload its part again", e, up.node)
        with up._cond:
            job.taken = True  # (nothing of it is ever deleted by this node)
            if not job.dropped:
                rep = {"key": list(job.key), "name": job.remote_name, "committed": 1}
                up._reports.append(rep)
                up._uploaded[job.key] = job
        return
    log.warning(
        "remote %s: node %d does not upload its part of %s there: %s; the checkpoint goes "
        "under another name",
        up.store.url,
        up.node,
        job.remote_name,
        url_text(str(e)),
    )
    with up._cond:
        job.taken = True
        if not job.dropped:
            up._reports.append({"key": list(job.key), "name": job.remote_name, "taken": 1})
            up._uploaded[job.key] = job
