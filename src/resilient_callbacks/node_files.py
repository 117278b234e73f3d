"""The files of a node-local checkpoint (each node its own ``dirpath``, :mod:`.nodelocal`): which
are the replicated ``shared.*`` files every node's leader writes, which ranks' files a node needs,
the global file list of the remote checkpoint, and why a rank cannot load one node's part.
Plain functions of names and manifests, no collective: called on whichever rank the caller's
rank contract says (:mod:`.node_session`, :mod:`.node_restore`, :mod:`.node_download`,
:mod:`.node_recovery`, :mod:`.peers`, :mod:`.restore_load`).
"""

from __future__ import annotations

from typing import Any

from .compression import SUFFIX
from .manifest import FileEntry

REMOTE_MANIFEST = "remote_manifest.json"  # the coordinator's copy of the global manifest
SHARED_PATHS = ("shared.json", "shared.safetensors")


def is_shared(path: str) -> bool:
    """Whether ``path`` is one of the replicated ``shared.*`` files every node's leader writes,
    compressed (``shared.safetensors.zst``, ``compression=``) or not."""
    return path.removesuffix(SUFFIX) in SHARED_PATHS


def global_files(files: list[FileEntry]) -> list[FileEntry]:
    """The files of the remote (global) checkpoint: every rank's files, the replicated ones
    (written by each node's leader) once, as rank 0 wrote them."""
    out: dict[str, FileEntry] = {}
    for f in sorted(files, key=lambda f: f.rank):
        out.setdefault(f.path, f)
    return list(out.values())


def needed(ranks: Any, world_size: int | None) -> set[int]:
    """The ranks whose files a node running ``ranks`` needs of a checkpoint saved by
    ``world_size`` ranks: its own, and rank 0's for a rank the checkpoint has none of (a
    ``PerRank(..., new_ranks="rank0")`` state is read from rank 0's files)."""
    ranks = set(ranks)
    if world_size is None:
        return ranks
    mine = {r for r in ranks if r < world_size}
    return mine | {0} if len(mine) < len(ranks) else mine


def other_nodes_files(path: str, rank: int) -> str | None:
    """Why ``rank`` cannot load the checkpoint at ``path`` when it is one node's part that lacks
    the files this rank reads (its own, or rank 0's for a rank the save did not have): a
    resume on fewer nodes than the save, whose other nodes' disks this run does not see. None
    when it is not such a part."""
    from .manifest import read_manifest

    try:
        m = read_manifest(path)
    except Exception:
        return None
    node = m.extra.get("node")
    wanted = rank if rank < m.world_size else 0
    if not isinstance(node, dict) or any(f.rank == wanted for f in m.files):
        return None
    ranks = ", ".join(str(r) for r in node.get("ranks") or [])
    return (
        f"{path} is one node's part of a checkpoint saved by {m.world_size} ranks on "
        f"{node.get('nodes')} nodes, each with its own directory (node-local mode): it holds "
        f"the files of rank(s) {ranks}; rank {wanted}'s are on another node's disk, which this "
        "run does not see (it runs on fewer nodes than the save). A remote copy of it holds "
        "every rank's files and replaces this part, and a resume from it is exact; without "
        "one, resume on as many nodes as the save, each with its own directory"
    )
