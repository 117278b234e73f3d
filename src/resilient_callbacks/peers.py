"""Replicas on peer nodes (``replicas=1``, node-local mode): each node's leader keeps a copy of
its predecessor's committed files, so a replaced node restores from its peer without the remote.

Files travel between the two leaders as uint8 tensors over a gloo group (point-to-point
``isend``/``recv``: one file in memory at a time on each side), are written into a hidden staging
folder, verified against the node manifest (size + xxh3 checksum of every file) and renamed into
place: ``<dirpath>/.replicas/<ranks_AAAAA-BBBBB>/<checkpoint name>/``. A crash leaves at most a
``.staging-*`` folder there, removed by the next replication.

Which ranks call what: node leaders only, both ends of a pair at the same point (after the
local commit of a save: every leader sends to its successor and receives from its
predecessor; at restore: the holder sends, the replaced node receives).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from typing import Any

import torch

from . import catalog
from .catalog import Depth
from .commit import STAGING_PREFIX, fsync_dir, fsync_tree
from .filewrite import write_bytes
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .nodelocal import REMOTE_MANIFEST

log = logging.getLogger("resilient_callbacks")

REPLICAS_DIR = ".replicas"


def replica_root(dirpath: str, label: str) -> str:
    return os.path.join(dirpath, REPLICAS_DIR, label)


def _send_blob(data: bytes, dst: int, group: Any) -> list[Any]:
    size = torch.tensor([len(data)], dtype=torch.int64)
    works = [torch.distributed.isend(size, dst, group=group)]
    if data:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works.append(torch.distributed.isend(t, dst, group=group))
    return works + [size] + ([t] if data else [])  # keep the buffers alive until waited


def _recv_blob(src: int, group: Any) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    torch.distributed.recv(size, src, group=group)
    n = int(size.item())
    if not n:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
    torch.distributed.recv(buf, src, group=group)
    return bytes(buf.numpy().tobytes())


def _wait(handles: list[Any]) -> None:
    for h in handles:
        if hasattr(h, "wait"):
            h.wait()


def exchange(
    send_dir: str | None,
    dst: int | None,
    src: int | None,
    receive_into: str | None,
    group: Any,
) -> str | None:
    """Send the checkpoint folder ``send_dir`` (its manifest, every file it lists, and the
    coordinator's record of the global manifest where it has one) to rank ``dst`` and/or
    receive one from rank ``src`` into a staging folder under ``receive_into``; the received copy is verified and renamed to its own name there. Returns its path (or
    ``None`` when nothing was received). Both ends call it at the same point."""
    header: list[Any] = []
    if send_dir is not None:
        m = read_manifest(send_dir)
        extra = [REMOTE_MANIFEST] if os.path.exists(os.path.join(send_dir, REMOTE_MANIFEST)) else []
        header = [os.path.basename(send_dir.rstrip("/")), [*(f.path for f in m.files), *extra]]
    pending: list[Any] = []
    if dst is not None:
        pending += _send_blob(json.dumps(header).encode(), dst, group)
    peer_header = json.loads(_recv_blob(src, group)) if src is not None else None
    _wait(pending)
    files_out = [MANIFEST_NAME, *header[1]] if header else []
    files_in = [MANIFEST_NAME, *peer_header[1]] if peer_header else []
    staging = None
    if peer_header is not None:
        assert receive_into is not None
        os.makedirs(receive_into, exist_ok=True)
        staging = os.path.join(
            receive_into, f"{STAGING_PREFIX}{peer_header[0]}-{uuid.uuid4().hex[:8]}"
        )
        os.makedirs(staging)
    try:
        for i in range(max(len(files_out), len(files_in))):
            pending = []
            if dst is not None and i < len(files_out):
                assert send_dir is not None
                with open(os.path.join(send_dir, files_out[i]), "rb") as fh:
                    pending = _send_blob(fh.read(), dst, group)
            if staging is not None and i < len(files_in):
                data = _recv_blob(src, group)  # type: ignore[arg-type]
                target = os.path.join(staging, files_in[i])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                write_bytes(target, data)
            _wait(pending)
        if staging is None:
            return None
        m = read_manifest(staging)
        catalog.verify(staging, m, Depth.FULL)
        fsync_tree(staging)  # (every folder: parts/<id>/ hold files too)
        base = os.path.join(receive_into or "", peer_header[0] if peer_header else "")
        final, n = base, 0
        while os.path.lexists(final):  # never replace a folder of that name
            n += 1
            final = f"{base}-{n}"
        os.rename(staging, final)
        fsync_dir(os.path.dirname(final))
        return final
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def list_replicas(dirpath: str) -> dict[str, list[tuple[str, Manifest]]]:
    """The replicas this node holds: node label -> [(checkpoint folder, manifest)], valid ones
    (sizes checked) only."""
    root = os.path.join(dirpath, REPLICAS_DIR)
    out: dict[str, list[tuple[str, Manifest]]] = {}
    try:
        labels = os.listdir(root)
    except FileNotFoundError:
        return out
    for label in labels:
        for e in catalog.scan(os.path.join(root, label), Depth.SIZE):
            if e.manifest is not None and e.status is catalog.Status.VALID:
                out.setdefault(label, []).append((e.path, e.manifest))
    return out


def prune(root: str, keep: int) -> None:
    """Keep the ``keep`` newest replicas of one node (and no staging leftovers)."""
    entries = catalog.scan(root, Depth.NONE)
    for e in entries:
        if e.manifest is None:
            shutil.rmtree(e.path, ignore_errors=True)
    done = [e for e in entries if e.manifest is not None]
    for e in done[: max(0, len(done) - keep)]:
        shutil.rmtree(e.path, ignore_errors=True)
