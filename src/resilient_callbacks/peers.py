"""Replicas on peer nodes (``replicas=1``, node-local mode): each node's leader keeps a copy of
its predecessor's committed files, so a replaced node restores from its peer without the remote.

Files travel between the two leaders as uint8 tensors over a gloo group (point-to-point
``isend``/``recv``), in pieces of at most :data:`CHUNK_BYTES`: each end holds one piece it sends
and one it receives, whatever the size of the files (a multi-GB shard held whole, twice over,
ran the host out of memory). They are written into a hidden staging
folder, verified against the node manifest (size + xxh3 checksum of every file) and renamed into
place: ``<dirpath>/.replicas/<ranks_AAAAA-BBBBB>/<checkpoint name>/``. A crash leaves at most a
``.staging-*`` folder there, removed by the next replication.

Which ranks call what: node leaders only, both ends of a pair at the same point (after the
local commit of a save: every leader sends to its successor and receives from its
predecessor; at restore: the holder sends, the replaced node receives).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from . import catalog
from .catalog import Depth
from .commit import STAGING_PREFIX, fsync_dir, fsync_tree
from .errors import CheckpointWriteError
from .filewrite import write_all
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .node_files import REMOTE_MANIFEST

log = logging.getLogger("resilient_callbacks")

REPLICAS_DIR = ".replicas"
# the most bytes of a file in memory at once on each end of a transfer (one piece sent, one
# received): a larger piece moves no faster over gloo (docs/performance.md)
CHUNK_BYTES = 64 << 20


def replica_root(dirpath: str, label: str) -> str:
    return os.path.join(dirpath, REPLICAS_DIR, label)


def _send_blob(data: bytes | None, dst: int, group: Any) -> list[Any]:
    """Send ``data`` to ``dst``; ``None``: this end could not read what it was to send here (a
    size of -1, nothing after it), so the other end still receives as many messages."""
    size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64)
    works = [torch.distributed.isend(size, dst, group=group)]
    if data:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works.append(torch.distributed.isend(t, dst, group=group))
    return works + [size] + ([t] if data else [])  # keep the buffers alive until waited


def _recv_blob(src: int, group: Any) -> bytes | None:
    size = torch.zeros(1, dtype=torch.int64)
    torch.distributed.recv(size, src, group=group)
    n = int(size.item())
    if n < 0:  # the sender failed to read it
        return None
    if not n:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
    torch.distributed.recv(buf, src, group=group)
    return bytes(buf.numpy().tobytes())


def _pieces(size: int) -> int:
    """How many pieces a file of ``size`` bytes travels in (-1: none, it was not sent)."""
    return max(0, -(-size // CHUNK_BYTES))


def _send_size(size: int, dst: int, group: Any) -> list[Any]:
    t = torch.tensor([size], dtype=torch.int64)
    return [torch.distributed.isend(t, dst, group=group), t]


def _recv_size(src: int, group: Any) -> int:
    t = torch.zeros(1, dtype=torch.int64)
    torch.distributed.recv(t, src, group=group)
    return int(t.item())


def _read_piece(fh: Any, into: memoryview) -> memoryview:
    """Fill ``into`` from ``fh``; a file that ends before (it shrank since its size was sent)
    raises."""
    got = 0
    while got < len(into):
        n = fh.readinto(into[got:])
        if not n:
            raise OSError(f"{fh.name} ended after {fh.tell()} bytes while being sent (changed?)")
        got += n
    return into


def _send_piece(piece: memoryview | None, dst: int, group: Any) -> list[Any]:
    """One piece of a file (``None``: a marker, this end could not read it): its length, then
    its bytes, sent from ``piece``'s own memory (kept alive until waited)."""
    works = _send_size(-1 if piece is None else len(piece), dst, group)
    if piece is not None:
        t = torch.frombuffer(piece, dtype=torch.uint8)
        works += [torch.distributed.isend(t, dst, group=group), t]
    return works


def _recv_piece(buf: torch.Tensor, src: int, group: Any) -> torch.Tensor | None:
    """One piece into the front of ``buf`` (a view of it; valid until the next piece), or
    ``None`` for the sender's marker."""
    n = _recv_size(src, group)
    if n < 0:
        return None
    view = buf[:n]
    torch.distributed.recv(view, src, group=group)
    return view


def _wait(handles: list[Any]) -> None:
    for h in handles:
        if hasattr(h, "wait"):
            h.wait()


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass
class _Ends:
    """One :func:`exchange` on this rank as its files go: why this end could not send or store
    so far (None: it could), whether the peer's end said it failed, and each end's one piece in
    memory (sent, received), made once and grown to the largest piece."""

    send_error: str | None
    recv_error: str | None
    peer_failed: bool
    out_buf: bytearray = field(default_factory=bytearray)
    in_buf: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))


def _exchange_file(
    ends: _Ends,
    send_dir: str | None,
    send_name: str | None,
    staging: str | None,
    recv_name: str | None,
    dst: int | None,
    src: int | None,
    group: Any,
) -> None:
    """Both ends of an :func:`exchange`, for the files at one place of their lists: send
    ``send_name`` (in ``send_dir``) to ``dst`` and/or receive ``recv_name`` from ``src`` into
    ``staging`` (None: no file at that place on that side). Each file: its size, then its
    pieces (as many as the size says, on both ends: one that cannot read what it announced
    sends a marker in place of each piece left). What fails on either end is recorded in
    ``ends``, not raised, so both ends go on together."""
    fh_out = fh_in = None
    size_out = size_in = -1
    pending: list[Any] = []
    if send_name is not None:
        assert send_dir is not None
        if ends.send_error is None:
            try:
                fh_out = open(os.path.join(send_dir, send_name), "rb")  # noqa: SIM115
                size_out = os.fstat(fh_out.fileno()).st_size
            except Exception as e:
                ends.send_error = _why(e)
        pending = _send_size(size_out, dst, group)  # type: ignore[arg-type]
    if recv_name is not None:
        size_in = _recv_size(src, group)  # type: ignore[arg-type]
        ends.peer_failed = ends.peer_failed or size_in < 0
        if staging is not None and ends.recv_error is None and not ends.peer_failed:
            try:
                target = os.path.join(staging, recv_name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                fh_in = open(target, "wb", buffering=0)  # noqa: SIM115
            except Exception as e:
                ends.recv_error = _why(e)
    _wait(pending)
    if len(ends.out_buf) < min(CHUNK_BYTES, size_out):
        ends.out_buf = bytearray(min(CHUNK_BYTES, size_out))
    if ends.in_buf.numel() < min(CHUNK_BYTES, size_in):
        ends.in_buf = torch.empty(min(CHUNK_BYTES, size_in), dtype=torch.uint8)
    try:
        for k in range(max(_pieces(size_out), _pieces(size_in))):
            pending = []
            if k < _pieces(size_out):
                n = min(CHUNK_BYTES, size_out - k * CHUNK_BYTES)
                piece: memoryview | None = None
                if ends.send_error is None:
                    try:
                        piece = _read_piece(fh_out, memoryview(ends.out_buf)[:n])
                    except Exception as e:
                        ends.send_error = _why(e)
                pending = _send_piece(piece, dst, group)  # type: ignore[arg-type]
            if k < _pieces(size_in):
                got = _recv_piece(ends.in_buf, src, group)  # type: ignore[arg-type]
                if got is None:
                    ends.peer_failed = True
                elif fh_in is not None and ends.recv_error is None and not ends.peer_failed:
                    try:
                        write_all(fh_in, got.numpy().data)
                    except Exception as e:
                        ends.recv_error = _why(e)
            _wait(pending)
        if fh_in is not None and ends.recv_error is None and not ends.peer_failed:
            try:
                os.fsync(fh_in.fileno())
            except Exception as e:
                ends.recv_error = _why(e)
    finally:
        for fh in (fh_out, fh_in):
            if fh is not None:
                with contextlib.suppress(OSError):
                    fh.close()


def exchange(
    send_dir: str | None,
    dst: int | None,
    src: int | None,
    receive_into: str | None,
    group: Any,
) -> str | None:
    """Send the checkpoint folder ``send_dir`` (its manifest, every file it lists, and the
    coordinator's record of the global manifest where it has one) to rank ``dst`` and/or
    receive one from rank ``src`` into a staging folder under ``receive_into``; the received
    copy is verified and renamed to its own name there. Returns its path (or ``None`` when
    nothing was received). Both ends call it at the same point.

    Both ends also finish it together whatever fails on either one: an end that cannot read
    what it sends (a part file gone) sends a marker in its place, an end that cannot store what
    arrives (a full or read-only disk) receives the rest all the same, and each end's outcome
    reaches the other before either returns. Then both raise :class:`CheckpointWriteError`
    naming the rank whose end failed (``failed_ranks``): a failure on one end never leaves the
    other waiting in a receive until the process group's timeout."""
    me = torch.distributed.get_rank()
    send_error: str | None = None
    header: list[Any] = []
    sent_name = os.path.basename((send_dir or "").rstrip("/"))
    if send_dir is not None:
        try:
            m = read_manifest(send_dir)
            extra = (
                [REMOTE_MANIFEST] if os.path.exists(os.path.join(send_dir, REMOTE_MANIFEST)) else []
            )
            header = [sent_name, [*(f.path for f in m.files), *extra]]
        except Exception as e:
            send_error = _why(e)
    pending: list[Any] = []
    if dst is not None:
        said = header if send_error is None else {"error": send_error}
        pending += _send_blob(json.dumps(said).encode(), dst, group)
    peer_header: list[Any] | None = None
    peer_failed = False  # the sender's own status (below) says why
    if src is not None:
        got = json.loads(_recv_blob(src, group) or b"[]")
        peer_failed = isinstance(got, dict)
        peer_header = got if got and not peer_failed else None
    _wait(pending)
    files_out = [MANIFEST_NAME, *header[1]] if header and send_error is None else []
    files_in = [MANIFEST_NAME, *peer_header[1]] if peer_header else []
    received_name = peer_header[0] if peer_header else "its checkpoint"
    recv_error: str | None = None
    staging = final = None
    if peer_header is not None:
        try:
            assert receive_into is not None
            os.makedirs(receive_into, exist_ok=True)
            staging = os.path.join(
                receive_into, f"{STAGING_PREFIX}{peer_header[0]}-{uuid.uuid4().hex[:8]}"
            )
            os.makedirs(staging)
        except Exception as e:
            recv_error, staging = _why(e), None
    ends = _Ends(send_error, recv_error, peer_failed)
    try:
        for i in range(max(len(files_out), len(files_in))):
            send_name = files_out[i] if dst is not None and i < len(files_out) else None
            recv_name = files_in[i] if peer_header is not None and i < len(files_in) else None
            _exchange_file(ends, send_dir, send_name, staging, recv_name, dst, src, group)
        send_error, recv_error, peer_failed = ends.send_error, ends.recv_error, ends.peer_failed
        if staging is not None and recv_error is None and not peer_failed:
            try:
                catalog.verify(staging, read_manifest(staging), Depth.FULL)
                fsync_tree(staging)  # (every folder: parts/<id>/ hold files too)
                base = os.path.join(receive_into or "", received_name)
                final, n = base, 0
                while os.path.lexists(final):  # never replace a folder of that name
                    n += 1
                    final = f"{base}-{n}"
                os.rename(staging, final)
                fsync_dir(os.path.dirname(final))
            except Exception as e:
                recv_error, final = _why(e), None
        # each end's outcome to the other: the sender's, then the receiver's
        pending = []
        if dst is not None:
            pending += _send_blob(json.dumps(send_error).encode(), dst, group)
        peer_send = json.loads(_recv_blob(src, group) or b"null") if src is not None else None
        if src is not None:
            pending += _send_blob(json.dumps(recv_error).encode(), src, group)
        peer_recv = json.loads(_recv_blob(dst, group) or b"null") if dst is not None else None
        _wait(pending)
    except BaseException:
        if staging is not None and final is None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if staging is not None and final is None:
        shutil.rmtree(staging, ignore_errors=True)
    problems: list[tuple[int, str]] = []
    if dst is not None and send_error is not None:
        problems.append((me, f"rank {me} could not send {sent_name}: {send_error}"))
    elif dst is not None and peer_recv is not None:
        problems.append((dst, f"rank {dst} could not store {sent_name}: {peer_recv}"))
    if src is not None and peer_send is not None:
        problems.append((src, f"rank {src} could not send its checkpoint: {peer_send}"))
    elif src is not None and recv_error is not None:
        problems.append((me, f"rank {me} could not store {received_name}: {recv_error}"))
    if problems:
        raise CheckpointWriteError(
            "copying a checkpoint to a peer node's replicas failed: "
            + "; ".join(p for _, p in problems)
            + ". The checkpoint itself stays committed on each node's disk (and, once "
            "uploaded, in the remote); free space or fix the named rank's disk for the next "
            "one to be replicated.",
            tuple(sorted({r for r, _ in problems})),
        )
    return final


def list_replicas(dirpath: str, node: int | None = None) -> dict[str, list[tuple[str, Manifest]]]:
    """The replicas this node (``node``, named in what it says) holds: node label ->
    [(checkpoint folder, manifest)], valid ones (sizes checked) only. What is not a folder
    there (a stray file) is skipped with a warning naming it: it raised NotADirectoryError on
    this node only, and the other nodes waited for it in the restore's next collective."""
    root = os.path.join(dirpath, REPLICAS_DIR)
    out: dict[str, list[tuple[str, Manifest]]] = {}
    who = "" if node is None else f"node {node}: "
    if not os.path.lexists(root):
        return out
    if not os.path.isdir(root):
        log.warning("%s%s is not a folder: no replicas read from it (remove it)", who, root)
        return out
    for label in sorted(os.listdir(root)):
        path = os.path.join(root, label)
        if not os.path.isdir(path):
            log.warning(
                "%s%s is not a folder of a peer node's replicas: skipped (remove it)", who, path
            )
            continue
        for e in catalog.scan(path, Depth.SIZE):
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
