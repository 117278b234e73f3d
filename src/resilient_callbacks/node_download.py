"""Node-local mode's restore from the remote tier (docs/multinode.md): a node that lacks a
checkpoint downloads only its own ranks' files of it (and the replicated ``shared.*``),
verifies them and commits them as a local checkpoint.

Which ranks call what: :func:`download` is called by a node's leader only (from
:meth:`~.node_restore.NodeRestorer.restore`, which says which node fetches what); nothing
collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

from . import catalog, remote_blobs, stall
from .blobs import TMP_PREFIX, key_of, store_dir
from .catalog import Depth
from .commit import STAGING_PREFIX
from .errors import CheckpointCorruptError
from .filewrite import encode_json, write_bytes
from .layout import SHARED_STRUCTURE
from .manifest import FileEntry, Manifest
from .node_files import REMOTE_MANIFEST, is_shared, needed
from .nodelocal import NodeDirectory
from .part_blobs import parse_refs
from .remote_download import arrived, failing
from .tensor_headers import header_bytes, parse_header, zstd

if TYPE_CHECKING:
    from .remote import RemoteStore

log = logging.getLogger("resilient_callbacks")


def download(d: NodeDirectory, name: str, c: dict[str, Any]) -> tuple[str, int, int]:
    """Leader: fetch this node's ranks' files (and the replicated ones) of the remote
    checkpoint ``name``, verify every checksum, and commit them as a local checkpoint. An
    incremental checkpoint (one a run with a shared ``dirpath`` uploaded) brings the blobs
    this node's files name (:func:`_read_by`) into the node's ``dirpath/blobs``, each
    verified (the node's retention deletes them once no checkpoint there names them)."""
    topo = d.topology
    assert d.remote is not None
    st = d.remote
    m = stall.run(lambda: st.read_manifest(name), f"reading {st.url}/{name}", preemptible=True)
    if [m.run_id, m.seq, m.step] != [*c["key"], c["step"]]:
        raise CheckpointCorruptError(f"{st.url}/{name} is another checkpoint now")
    ranks = needed(topo.node_ranks, m.world_size)
    need = [f for f in m.files if f.rank in ranks or is_shared(f.path)]
    staging = os.path.join(d.dirpath, f"{STAGING_PREFIX}{name}-{uuid.uuid4().hex[:12]}")
    os.makedirs(staging)
    pins = [key_of(b.path) for b in m.blobs]
    d.blobs.pin(pins)  # (no collection between their download and the commit)
    try:
        for f in need:
            os.makedirs(os.path.dirname(os.path.join(staging, f.path)), exist_ok=True)
        log.warning(  # (each node's leader says its own: naming the node)
            "restoring node %d's %d file(s) of step %d from the remote copy %s/%s",
            topo.node,
            len(need),
            m.step,
            st.url,
            name,
        )
        part = f"node {topo.node}'s part of {st.url}/{name}"  # (each leader says its own)
        what = f"downloading {part}"

        def fetch(files: list[FileEntry]) -> list[FileEntry]:  # (the files kept)
            return stall.tried_again(  # an error that may pass: each try given up once no
                lambda: stall.run(  # byte arrived for the outage limit, its progress logged
                    lambda: _get(st, name, staging, files, part),
                    what,
                    lambda: stall.on_disk(
                        d.dirpath, os.path.basename(staging), {f.path: f.size for f in files}
                    ),
                    preemptible=True,  # (a request ends it: node_restore raises it on every rank)
                ),
                what,
            )

        kept = fetch(need)
        # kept files checked before _read_by reads them for the blobs they name (a damaged
        # shared.json could name too few; the verification after checks only those)
        if bad := failing(staging, kept):
            log.warning(
                "%d file(s) of %s kept from an earlier try fail their checksum: fetching them "
                "again",
                len(bad),
                part,
            )
            for f in bad:
                os.unlink(os.path.join(staging, f.path))
            fetch(bad)
        blobs = _read_by(staging, need, m)
        if blobs:
            mine = dataclasses.replace(m, blobs=blobs)
            _blobs(d, mine, staging, f"downloading the blobs of {st.url}/{name}")
        raw = encode_json(m.to_json())  # (the remote manifest, kept beside the node's own)
        node_m = Manifest.from_json(json.loads(raw))  # (a copy)
        node_m.files, node_m.blobs = need, blobs
        node_m.extra = dict(m.extra)
        node_m.extra["node"] = {
            "ranks": sorted(ranks),
            "nodes": len(topo.nodes),
            "remote_name": name,
        }
        if m.blobs:  # (node_recovery: never uploaded again, its blobs are on no node)
            node_m.extra["node"]["remote_blobs"] = len(m.blobs)
        catalog.verify(staging, node_m, Depth.FULL)
        write_bytes(os.path.join(staging, REMOTE_MANIFEST), raw)
        final = d.commit.commit(staging, m.step, encode_json(node_m.to_json()))
    except BaseException:
        d.commit.abort(staging)
        raise
    finally:
        d.blobs.unpin(pins)
    return final, len(need), sum(f.size for f in need)


def _get(
    st: RemoteStore, name: str, staging: str, need: list[FileEntry], part: str
) -> list[FileEntry]:
    """Fetch the files of ``need`` (``part``: this node's, named so) that ``staging`` does not
    hold whole yet: a try after one that failed part-way (a 5xx burst, a reset) fetches only
    what did not arrive. A file of the manifest's size counts as arrived; every checksum is
    verified after the download. Returns the files it kept (checked, and those that fail fetched again: :func:`.remote_download.failing`)."""
    left, kept = arrived(staging, need, part)
    if left:
        st.fs.get(
            [f"{st.root}/{name}/{f.path}" for f in left],
            [os.path.join(staging, f.path) for f in left],
        )
    return kept


def _read_by(staging: str, need: list[FileEntry], m: Manifest) -> list[FileEntry]:
    """The blobs of ``m`` that this node's files ``need`` (downloaded into ``staging``) refer
    to: the replicated tensors' (``shared.json``'s ``"blobs"``) and the part files' (their
    safetensors metadata), the only places a checkpoint names a blob. A blob's manifest entry
    names one rank that wrote it, not every rank that reads it (ranks with the same bytes
    share one). Every blob of ``m`` where a file cannot be read for its references (a damaged
    download: the checksum verification after names it)."""
    if not m.blobs:
        return []
    names: set[str] = set()
    try:
        for f in need:
            full = os.path.join(staging, *f.path.split("/"))
            if f.path == SHARED_STRUCTURE:
                with open(full, "rb") as fh:
                    refs = json.loads(fh.read()).get("blobs") or {}
                names.update(str(v) for v in refs.values())
            elif f.kind == "tensors":
                meta: dict[str, str] = {}
                with contextlib.ExitStack() as stack:
                    fh = stack.enter_context(open(full, "rb"))
                    if f.codec:
                        fh = stack.enter_context(zstd().ZstdDecompressor().stream_reader(fh))
                    header, _ = parse_header(header_bytes(fh, full), full)
                meta.update(header.get("__metadata__") or {})
                names.update(parse_refs(meta, full).values())
    except Exception as e:  # (every blob: nothing this node's ranks read is missed)
        log.info("fetching every blob of the checkpoint: %s: %s", type(e).__name__, e)
        return list(m.blobs)
    mine = [b for b in m.blobs if b.path in names]
    log.info("fetching %d of the %d blob(s) the checkpoint names", len(mine), len(m.blobs))
    return mine


def _blobs(d: NodeDirectory, m: Manifest, staging: str, what: str) -> None:
    """The blobs ``m`` names, into the node's store (:func:`.remote_blobs.download`: each
    verified before it is renamed into place), given up once no byte has arrived for
    :func:`.stall.limit_s`, tried again after an error that may pass."""
    assert d.remote is not None
    st = d.remote

    def moved() -> tuple[int | None, str]:
        if staging in remote_blobs.DIGESTING:
            return None, "reading a blob back to verify it"  # local work, not the store
        stored, doing = stall.on_disk(store_dir(d.dirpath), TMP_PREFIX, {})
        own, _ = stall.on_disk(d.dirpath, os.path.basename(staging), {})  # (its own copies)
        return stored + own, doing

    stall.tried_again(
        lambda: stall.run(lambda: remote_blobs.download(st, m, d.dirpath, staging), what, moved),
        what,
    )
