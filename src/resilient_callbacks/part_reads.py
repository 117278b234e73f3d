"""The restore side of a :class:`~.filepart.FilePart` at the core: what the manifest says of
a part (:func:`part_info`), and the files a rank of it asked for, read and verified
(:func:`read_part_files`; :func:`read_part_tensors`, a part file with its blobs resolved, for
restore and export). Which ranks call what: every rank, for itself, at restore; no collective.
"""

from __future__ import annotations

import json
import os

import torch

from .errors import CheckpointCorruptError, CheckpointMismatchError
from .filepart import FilePart, PartInfo, PartReader, _check_name
from .manifest import FileEntry, Manifest
from .part_names import PARTS_EXTRA, stored_dir
from .tensor_headers import read_verified
from .tensorfile import map_tensors_verified


def read_part_files(path: str, manifest: Manifest, part: FilePart, info: PartInfo) -> PartReader:
    """Read and verify the files ``part`` says this rank needs. Raises
    :class:`CheckpointCorruptError` naming a file that is not listed, missing or damaged."""
    folder = stored_dir(manifest, info.part_id)
    entries = {f.path: f for f in manifest.files}
    reader = PartReader(info)
    for name in names_to_read(part, info):
        rel = f"{folder}/{_check_name(name)}"
        entry = entries.get(rel)
        if entry is None:
            raise CheckpointCorruptError(f"{path}: the manifest does not list {rel}")
        full = os.path.join(path, *rel.split("/"))
        if entry.kind == "structure":
            buf = read_verified(full, entry.digest)
            try:
                reader._json[name] = json.loads(bytes(buf))
            except ValueError as e:
                raise CheckpointCorruptError(f"{full}: unreadable JSON ({e})") from None
        else:
            reader._tensors[name] = read_part_tensors(path, manifest, entry)
    return reader


def names_to_read(part: FilePart, info: PartInfo) -> list[str]:
    """``part.files_to_read(info)``, where an error other than a refusal
    (:class:`CheckpointMismatchError`) or damage (an ``OSError``, as
    :class:`CheckpointCorruptError`) is a refusal naming it: it comes from the live objects the
    part holds (an engine, a model, an optimizer asked for its state) or the part's code, not
    from the checkpoint's files, which are read and verified after it. Taken for damage, it
    made the restore skip valid checkpoints one after another, each failing the same way."""
    try:
        return part.files_to_read(info)
    except (CheckpointMismatchError, OSError):
        raise
    except Exception as e:
        raise CheckpointMismatchError(
            f"part {info.part_id!r} ({type(part).__name__}) cannot prepare its restore: "
            f"files_to_read() raised {type(e).__name__}: {e}. The error comes from this run's "
            "live objects or the part's code, before any of the checkpoint's files is read: "
            "nothing was loaded, and no older checkpoint is tried (it would meet the same "
            "error). Fix its cause and run again"
        ) from e


def read_part_tensors(path: str, manifest: Manifest, entry: FileEntry) -> dict[str, torch.Tensor]:
    """The tensors of the part file ``entry`` of the checkpoint at ``path``, verified, with
    those it stores as blobs (``incremental=True``) read from them, each verified too."""
    from .layout import load_blobs
    from .part_blobs import parse_refs

    full = os.path.join(path, *entry.path.split("/"))
    meta: dict[str, str] = {}
    tensors = map_tensors_verified(full, entry.digest, meta)
    refs = parse_refs(meta, full)
    if refs:
        tensors.update(load_blobs(path, manifest, refs, entry.path))
    return tensors


def part_info(
    part_id: str, manifest: Manifest, rank: int, world_size: int, partial: bool = False
) -> PartInfo:
    prefix = stored_dir(manifest, part_id) + "/"
    listed = {f.path[len(prefix) :]: f.rank for f in manifest.files if f.path.startswith(prefix)}
    described = manifest.extra.get(PARTS_EXTRA)
    saved = described.get(part_id) if isinstance(described, dict) else None
    return PartInfo(
        part_id,
        rank,
        world_size,
        manifest.world_size,
        listed,
        dict(saved) if isinstance(saved, dict) else {},
        partial,
    )
