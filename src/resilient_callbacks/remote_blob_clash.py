"""What an upload does where the remote blob store already holds a blob of one of its names
with other contents (:func:`.remote_blob_put.upload`): another size (:func:`check_torn`), or the
size but other bytes (:func:`check_other_bytes`). Either raises where a committed remote
checkpoint or another run's upload in progress holds those bytes, else says so loudly (the
caller uploads the local blob again).

Which ranks call what: only the coordinator talks to the remote store.
"""

from __future__ import annotations

import logging
import posixpath
from typing import TYPE_CHECKING

from .blobs import BLOBS_DIR
from .manifest import Manifest

if TYPE_CHECKING:
    from .remote import RemoteStore

log = logging.getLogger("resilient_callbacks")


def check_torn(
    store: RemoteStore,
    clash: list[str],
    have: dict[str, int],
    run_id: str,
    marker: str,
    local_dir: str,
) -> None:
    """Blobs of the names ``clash`` are on the remote (sizes ``have``) with another size than
    the local ones: raise unless none of them is held by a committed remote checkpoint (one
    whose manifest lists it with the size it has there: another writer's valid bytes of that
    name) or by another run's fresh in-flight marker; then they are torn copies (a killed
    upload of this run left them, or damage that every checkpoint naming them shares)."""
    from .remote_blobs import _markers  # (remote_blobs imports this module)

    named: set[str] = set()
    for e in store.scan():
        if e.manifest is not None:
            named.update(b.path for b in e.manifest.blobs if have.get(b.path) == b.size)
    mine = posixpath.basename(marker)
    for name, (fresh, blobs, owner) in _markers(store).items():
        if fresh and name != mine and owner != run_id:
            named.update(blobs)
    held = [c for c in clash if c in named]
    if held:  # never replace a blob remote checkpoints may name with other bytes
        raise OSError(
            f"{store.url}/{BLOBS_DIR} holds {', '.join(held)} with another size than "
            f"{local_dir} has, named by a remote checkpoint or another run's upload; not "
            "replacing it. Remove the remote checkpoints that name it or upload to another URL."
        )
    log.warning(
        "remote %s: %s %s another size than the local copy and no remote checkpoint holds "
        "it at that size (an upload killed part-way left it, or it was damaged); uploading it "
        "again",
        store.url,
        ", ".join(f"{BLOBS_DIR}/{c}" for c in clash),
        "has" if len(clash) == 1 else "have",
    )


def check_other_bytes(
    store: RemoteStore, other: list[str], manifest: Manifest, marker: str, local_dir: str
) -> None:
    """Blobs of the names ``other`` are on the remote with the local size but other bytes:
    raise where a committed remote checkpoint records one with other bytes (another run or
    another zstd version encoded the same tensor differently: valid bytes for those
    checkpoints) or another run's fresh in-flight marker names it; else it is damaged in place
    or a leftover: say so loudly, and the caller uploads it again (which repairs the remote
    checkpoints that record it with the local bytes)."""
    from .remote_blobs import _markers  # (remote_blobs imports this module)

    ours = {b.path: (b.size, b.xxh3_64) for b in manifest.blobs}
    held: dict[str, list[str]] = {}
    repaired: set[str] = set()
    for e in store.scan():
        for b in e.manifest.blobs if e.manifest is not None else ():
            if b.path in ours and b.path in other:
                if (b.size, b.xxh3_64) != ours[b.path]:
                    held.setdefault(b.path, []).append(e.name)
                else:
                    repaired.add(e.name)
    mine = posixpath.basename(marker)
    for name, (fresh, blobs, owner) in _markers(store).items():
        if not fresh or name == mine or owner == manifest.run_id:
            continue
        for n in set(blobs) & set(other):
            held.setdefault(n, []).append(f"an upload in progress of run {owner}")
    if held:
        raise OSError(
            f"{store.url}/{BLOBS_DIR} holds "
            + "; ".join(f"{n} (recorded by {', '.join(sorted(w))})" for n, w in held.items())
            + f" with the size of the blob in {local_dir} but other bytes (another run writing "
            "to this URL, or another zstd version, stored the same tensor differently); not "
            "replacing them. Give this run a remote URL of its own, or remove those "
            "checkpoints (resilient-ckpt gc --remote)."
        )
    log.warning(
        "remote %s: %s %s the size of the local blob but other bytes (damaged in place, or "
        "left by an interrupted or foreign write); uploading the local blob again%s",
        store.url,
        ", ".join(f"{BLOBS_DIR}/{n}" for n in other),
        "has" if len(other) == 1 else "have",
        f" (repairs {', '.join(sorted(repaired))})" if repaired else "",
    )
