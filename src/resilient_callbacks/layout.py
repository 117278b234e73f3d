"""What files one checkpoint holds, and writing/reading one rank's part of them.

::

    step_000000060/
        manifest.json            written last, by the coordinator: the commit point
        shared.json              structure of the replicated state (rank 0)
        shared.safetensors       replicated tensors, written once (rank 0)
        rank_00000.json          this rank's PerRank parts and RNG states
        rank_00000.safetensors   their tensors
        rank_00001.json ...      one pair per rank

With ``incremental=True`` the replicated tensors of at least ``blobs.BLOB_MIN`` bytes are not
in ``shared.safetensors`` but in the run's blob store; ``shared.json`` maps each to its blob
(``"blobs": {name: blob}``) and the manifest lists the blobs. With compression a tensor file is
``<name>.safetensors.zst`` (see :mod:`.compression`).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .errors import CheckpointCorruptError, CheckpointMismatchError
from .filewrite import write_json
from .layout_meta import (
    SHARED_STRUCTURE,
    SHARED_TENSORS,
    is_dcp_dropin,
    json_object,
    manifest_entry,
    rank_structure,
    rank_tensors,
    shared_refs,
)
from .manifest import FileEntry, Manifest
from .structure import Encoded
from .tensor_headers import read_verified
from .tensorfile import (
    DirectBuffer,
    FileDigest,
    map_tensors_verified,
    write_tensors,
)

if TYPE_CHECKING:
    from .blobs import BlobSession

LAYOUT_VERSION = 1  # 2: shared.json maps tensors to blobs ("blobs")
PARALLEL_MIN = 64 << 20  # both tensor files at least this big: read them in parallel


def write_part(
    staging: str,
    rank: int,
    shared: Encoded | None,
    local: Encoded,
    rng_info: dict[str, Any] | None,
    rng_tensors: dict[str, torch.Tensor],
    direct: bool = False,
    bounce: DirectBuffer | None = None,
    blobs: BlobSession | None = None,
    compress: tuple[int, bool] | None = None,
) -> list[FileEntry]:
    """Write this rank's files into ``staging``; rank 0 also passes ``shared``. ``direct``:
    write the tensor files with O_DIRECT where possible (background saves), through
    ``bounce`` if given. ``blobs`` (rank 0, ``incremental=True``): the large replicated
    tensors go to the run's blob store (their entries, kind ``"blob"``, are returned too).
    ``compress``: ``(zstd level, byte-shuffle)`` to compress the tensor files."""
    entries: list[FileEntry] = []

    def tensor_file(name: str, tensors: dict[str, torch.Tensor], part: str) -> None:
        meta = {"format": "resilient_callbacks", "part": part}
        if compress is None:
            d: FileDigest = write_tensors(
                os.path.join(staging, name), tensors, meta, direct=direct, bounce=bounce
            )
            entries.append(FileEntry(name, d.size, d.xxh3_64, rank, "tensors"))
            return
        from .compression import SUFFIX, write_tensors_compressed

        d, codec = write_tensors_compressed(
            os.path.join(staging, name + SUFFIX),
            tensors,
            meta,
            level=compress[0],
            with_shuffle=compress[1],
        )
        entries.append(FileEntry(name + SUFFIX, d.size, d.xxh3_64, rank, "tensors", codec))

    if shared is not None:
        inline, refs = dict(shared.tensors), dict[str, str]()
        if blobs is not None:
            inline, refs, blob_entries = blobs.split(shared.tensors)
            entries.extend(blob_entries)
        tensor_file(SHARED_TENSORS, inline, "shared")
        doc: dict[str, Any] = {"layout_version": LAYOUT_VERSION, "structure": shared.structure}
        if refs:
            doc["layout_version"] = 2
            doc["blobs"] = refs
        d = write_json(os.path.join(staging, SHARED_STRUCTURE), doc)
        entries.append(FileEntry(SHARED_STRUCTURE, d.size, d.xxh3_64, rank, "structure"))
    tensors = dict(local.tensors)
    tensors.update(rng_tensors)
    tensor_file(rank_tensors(rank), tensors, f"rank {rank}")
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


def load_tensor_file(path: str, entry: FileEntry) -> dict[str, torch.Tensor]:
    """Read one tensor file (or blob) of a checkpoint, verified against its entry."""
    if entry.codec:
        from .compression import read_tensors_compressed

        return read_tensors_compressed(path, entry.digest, entry.codec)
    return map_tensors_verified(path, entry.digest)


def load_blobs(
    path: str, manifest: Manifest, refs: dict[str, str], referrer: str = SHARED_STRUCTURE
) -> dict[str, torch.Tensor]:
    """The tensors ``refs`` (tensor name -> blob name; read from the checkpoint's file
    ``referrer``) maps to, each blob verified. Distinct tensors whose bytes were equal share a
    blob; each gets its own copy (aliases of one tensor are one name: :mod:`.structure`)."""
    from .blobs import blob_path

    by_name = {b.path: b for b in manifest.blobs}
    loaded: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for tname, bname in refs.items():
        entry = by_name.get(bname)
        if entry is None:
            raise CheckpointCorruptError(
                f"{path}: {referrer} refers to the blob {bname}, which the manifest does not list"
            )
        if bname not in loaded:
            got = load_tensor_file(blob_path(path, bname), entry)
            if len(got) != 1:
                raise CheckpointCorruptError(f"{blob_path(path, bname)}: not a blob")
            loaded[bname] = out[tname] = next(iter(got.values()))
        else:  # another tensor of the same bytes: not the same tensor
            out[tname] = loaded[bname].clone()
    return out


def read_json(path: str, manifest: Manifest, name: str) -> dict[str, Any]:
    """The JSON file ``name`` of the checkpoint at ``path`` (a structure file: a JSON object),
    verified against its manifest."""
    buf = read_verified(os.path.join(path, name), manifest_entry(manifest, name, path).digest)
    return json_object(bytes(buf), os.path.join(path, name))


def read_part(path: str, manifest: Manifest, rank: int, borrow: Collection[str] = ()) -> LoadedPart:
    """Read and verify (size + checksum) the files this rank needs; tensors view the buffers.
    ``borrow``: the ids of the per-rank states a rank the checkpoint has no files of takes from
    rank 0 (``PerRank(new_ranks="rank0")``). A valid checkpoint written by ``dcp.save``
    through ``ResilientStorageWriter`` is refused (:class:`CheckpointMismatchError`: no
    fallback past it, nothing loaded), naming the reader that loads it."""
    if is_dcp_dropin(manifest):
        raise CheckpointMismatchError(
            f"{path} was written by dcp.save through ResilientStorageWriter, which a Checkpointer "
            "(or a framework callback) does not restore: load it with dcp.load(state_dict, "
            f"storage_reader=ResilientStorageReader({os.path.dirname(path)!r})) (docs/fsdp.md), "
            "or give the Checkpointer a directory of its own"
        )

    def load_tensors(name: str) -> dict[str, torch.Tensor]:
        entry = manifest_entry(manifest, name, path)
        return load_tensor_file(os.path.join(path, entry.path), entry)

    # the structure files are checked first (small): a corrupt one is said before any tensor
    # file or blob is read and hashed
    shared = read_json(path, manifest, SHARED_STRUCTURE)
    refs = shared_refs(shared, path)
    if rank < manifest.world_size:
        local = read_json(path, manifest, rank_structure(rank))
        names = [SHARED_TENSORS, rank_tensors(rank)]
        sizes = [manifest_entry(manifest, n, path).size for n in names]
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
        per_rank, rng = {}, None
        if borrow:  # a rank the checkpoint has no files of: rank 0's, of these states
            first = read_json(path, manifest, rank_structure(0)).get("per_rank") or {}
            per_rank = {k: v for k, v in first.items() if k in borrow}
        tensors = load_tensors(SHARED_TENSORS)
        if borrow:
            tensors.update(load_tensors(rank_tensors(0)))  # "@rank/" names: no clash
    if refs:
        tensors.update(load_blobs(path, manifest, refs))
    return LoadedPart(shared["structure"], per_rank, rng, tensors)
