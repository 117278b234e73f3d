"""What files one checkpoint holds, and writing/reading one rank's part of them.

::

    step_000000060/
        manifest.json            written last, by the coordinator: the commit point
        shared.json              structure of the replicated state (rank 0)
        shared.safetensors       replicated tensors, written once (rank 0)
        rank_00000.json          this rank's PerRank parts and RNG states
        rank_00000.safetensors   their tensors
        rank_00001.json ...      one pair per rank
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointCorruptError
from .manifest import FileEntry, Manifest
from .structure import Encoded
from .tensorfile import (
    DirectBuffer,
    map_tensors_verified,
    read_verified,
    write_json,
    write_tensors,
)

SHARED_STRUCTURE = "shared.json"
SHARED_TENSORS = "shared.safetensors"
LAYOUT_VERSION = 1
PARALLEL_MIN = 64 << 20  # both tensor files at least this big: read them in parallel


def rank_structure(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def rank_tensors(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def write_part(
    staging: str,
    rank: int,
    shared: Encoded | None,
    local: Encoded,
    rng_info: dict[str, Any] | None,
    rng_tensors: dict[str, torch.Tensor],
    direct: bool = False,
    bounce: DirectBuffer | None = None,
) -> list[FileEntry]:
    """Write this rank's files into ``staging``; rank 0 also passes ``shared``. ``direct``:
    write the tensor files with O_DIRECT where possible (background saves), through
    ``bounce`` if given."""
    entries: list[FileEntry] = []
    if shared is not None:
        d = write_tensors(
            os.path.join(staging, SHARED_TENSORS),
            shared.tensors,
            {"format": "resilient_callbacks", "part": "shared"},
            direct=direct,
            bounce=bounce,
        )
        entries.append(FileEntry(SHARED_TENSORS, d.size, d.xxh3_64, rank, "tensors"))
        d = write_json(
            os.path.join(staging, SHARED_STRUCTURE),
            {"layout_version": LAYOUT_VERSION, "structure": shared.structure},
        )
        entries.append(FileEntry(SHARED_STRUCTURE, d.size, d.xxh3_64, rank, "structure"))
    tensors = dict(local.tensors)
    tensors.update(rng_tensors)
    d = write_tensors(
        os.path.join(staging, rank_tensors(rank)),
        tensors,
        {"format": "resilient_callbacks", "part": f"rank {rank}"},
        direct=direct,
        bounce=bounce,
    )
    entries.append(FileEntry(rank_tensors(rank), d.size, d.xxh3_64, rank, "tensors"))
    d = write_json(
        os.path.join(staging, rank_structure(rank)),
        {
            "layout_version": LAYOUT_VERSION,
            "rank": rank,
            "per_rank": local.per_rank,
            "rng": rng_info,
        },
    )
    entries.append(FileEntry(rank_structure(rank), d.size, d.xxh3_64, rank, "structure"))
    return entries


@dataclass
class LoadedPart:
    structure: Any
    per_rank: dict[str, Any]
    rng: dict[str, Any] | None
    tensors: dict[str, torch.Tensor]


def _entry(manifest: Manifest, name: str, where: str) -> FileEntry:
    for f in manifest.files:
        if f.path == name:
            return f
    raise CheckpointCorruptError(f"{where}: the manifest does not list {name}")


def read_part(path: str, manifest: Manifest, rank: int) -> LoadedPart:
    """Read and verify (size + checksum) the files this rank needs; tensors view the buffers."""
    import json

    def load_json(name: str) -> Any:
        buf = read_verified(os.path.join(path, name), _entry(manifest, name, path).digest)
        try:
            return json.loads(bytes(buf))
        except ValueError as e:
            raise CheckpointCorruptError(
                f"{os.path.join(path, name)}: unreadable JSON ({e})"
            ) from None

    def load_tensors(name: str) -> dict[str, torch.Tensor]:
        full = os.path.join(path, name)
        return map_tensors_verified(full, _entry(manifest, name, path).digest)

    shared = load_json(SHARED_STRUCTURE)
    if rank < manifest.world_size:
        local = load_json(rank_structure(rank))
        names = [SHARED_TENSORS, rank_tensors(rank)]
        sizes = [_entry(manifest, n, path).size for n in names]
        if min(sizes) >= PARALLEL_MIN:
            # two big files: read (and hash) them at once; each read releases the GIL
            with ThreadPoolExecutor(2, thread_name_prefix="rc-read") as pool:
                parts = list(pool.map(load_tensors, names))
        else:
            parts = [load_tensors(n) for n in names]
        tensors = parts[0]
        tensors.update(parts[1])
        per_rank, rng = local.get("per_rank") or {}, local.get("rng")
    else:
        tensors = load_tensors(SHARED_TENSORS)
        per_rank, rng = {}, None
    return LoadedPart(shared["structure"], per_rank, rng, tensors)
