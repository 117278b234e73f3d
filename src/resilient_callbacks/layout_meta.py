"""A checkpoint's file names, and its tensors' names, dtypes and shapes read from their
headers, without torch (moved from :mod:`.layout`): ``resilient-ckpt inspect`` lists a
checkpoint's keys without importing torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .errors import CheckpointCorruptError
from .manifest import FileEntry, Manifest
from .tensor_headers import tensor_meta

# the key marking an encoded value (a tensor, a tuple, ...) in the structure JSON
# (:mod:`.structure`)
TAG = "__rc__"
SHARED_STRUCTURE = "shared.json"
SHARED_TENSORS = "shared.safetensors"

# a checkpoint written by ``dcp.save`` through ``dcp.ResilientStorageWriter`` has this file (its
# keys, as JSON) and no SHARED_STRUCTURE
DCP_METADATA = "dcp_metadata.json"


def rank_structure(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def rank_tensors(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def is_dcp_dropin(manifest: Manifest) -> bool:
    """Whether the checkpoint was written by ``dcp.save`` through ``ResilientStorageWriter``."""
    return any(f.path == DCP_METADATA for f in manifest.files)


def json_object(raw: bytes | bytearray, where: str) -> dict[str, Any]:
    """The JSON object the structure file ``where`` holds (``raw``: its bytes);
    :class:`CheckpointCorruptError` where it is no JSON, or JSON but no object."""
    import json

    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CheckpointCorruptError(f"{where}: unreadable JSON ({e})") from None
    if not isinstance(doc, dict):  # (its .get() was a traceback: 'list' object has no ...)
        raise CheckpointCorruptError(
            f"{where}: not a structure file (a JSON {type(doc).__name__}, not an object)"
        )
    return doc


def shared_refs(shared: Mapping[str, Any], path: str) -> dict[str, str]:
    """The blob references of the checkpoint at ``path`` whose shared structure file holds
    ``shared``; :class:`CheckpointCorruptError` where it names no structure or its blob
    references are no JSON object (a checkpoint no reader can load, whatever its checksums)."""
    if "structure" not in shared:
        raise CheckpointCorruptError(f"{path}: {SHARED_STRUCTURE} names no structure")
    refs = shared.get("blobs") or {}
    if not isinstance(refs, dict):
        raise CheckpointCorruptError(f"{path}: malformed blob references")
    return refs


def manifest_entry(manifest: Manifest, name: str, where: str) -> FileEntry:
    """The manifest's entry of ``name``, or of its compressed form ``name.zst``."""
    for f in manifest.files:
        if f.path == name or (f.codec and f.path == name + ".zst"):
            return f
    raise CheckpointCorruptError(f"{where}: the manifest does not list {name}")


def file_meta(path: str, entry: FileEntry) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` of one tensor file (or blob), reading only its header."""
    if entry.codec:
        from .tensor_headers import compressed_meta

        return compressed_meta(path)
    return tensor_meta(path)


def shared_meta(path: str, manifest: Manifest, refs: Mapping[str, str]) -> dict[str, Any]:
    """``{name: (dtype, shape)}`` of a checkpoint's replicated tensors, compressed or not, those
    stored as blobs (``refs``: tensor name -> blob name) included; headers only."""
    from .blobs import blob_path

    entry = manifest_entry(manifest, SHARED_TENSORS, path)
    meta: dict[str, Any] = file_meta(os.path.join(path, entry.path), entry)
    by_name = {b.path: b for b in manifest.blobs}
    for tname, bname in refs.items():
        b = by_name.get(bname)
        got = file_meta(blob_path(path, bname), b) if b is not None else {}
        if len(got) == 1:
            meta[tname] = next(iter(got.values()))
    return meta
