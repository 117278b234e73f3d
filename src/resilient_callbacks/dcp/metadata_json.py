"""DCP's checkpoint ``Metadata`` as JSON, and back, without pickle.

``dcp.save`` with its own ``FileSystemWriter`` pickles ``Metadata`` into ``.metadata``; a tampered
file then runs code at ``dcp.load``. :class:`~.storage_writer.ResilientStorageWriter` writes
``dcp_metadata.json`` instead: for every key of the state dict, either a tensor (dtype, global
size, chunks) or an object (written as JSON by the writer), the planner's data (the flattening
mappings of ``DefaultSavePlanner``: paths of str and int) and where each item is stored (a file
and a key in it). Anything that is not JSON is refused with
:class:`~resilient_callbacks.errors.UnsupportedStateError`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..dtypes import DTYPE_TO_ST, ST_TO_DTYPE, unsupported
from ..errors import CheckpointCorruptError, UnsupportedStateError
from ..layout_meta import DCP_METADATA
from .chunks import Box, join, overlap_problem, split

FORMAT = "resilient_callbacks.dcp.metadata/1"
METADATA_NAME = DCP_METADATA


def index_key(index: MetadataIndex) -> str:
    """The key of an item in its safetensors file: the FQN and the chunk's offsets."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _plain(value: Any, what: str) -> Any:
    skeleton, tensors = split(value)
    if tensors:
        raise UnsupportedStateError(f"{what} holds tensors; it cannot be written as JSON")
    return skeleton


def to_json(metadata: Metadata, storage: dict[MetadataIndex, dict[str, Any]]) -> dict[str, Any]:
    """``metadata`` (and where each item is, ``storage``) as a JSON-able dict."""
    entries: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            if dtype not in DTYPE_TO_ST:
                raise UnsupportedStateError(unsupported(fqn, dtype))
            entries[fqn] = {
                "kind": "tensor",
                "dtype": DTYPE_TO_ST[dtype],
                "size": list(md.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            entries[fqn] = {"kind": "object"}
        else:
            raise UnsupportedStateError(f"{fqn}: unknown DCP storage metadata {type(md).__name__}")
    sm = metadata.storage_meta
    return {
        "format": FORMAT,
        "version": metadata.version,
        "state_dict": entries,
        "planner_data": _plain(metadata.planner_data, "the planner's data"),
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        },
        "storage": [
            [idx.fqn, None if idx.offset is None else list(idx.offset), idx.index, where]
            for idx, where in storage.items()
        ],
    }


def from_json(d: Any) -> tuple[Metadata, dict[MetadataIndex, dict[str, Any]]]:
    """The ``Metadata`` and storage table written by :func:`to_json`."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{METADATA_NAME} is not DCP metadata written as JSON")
    try:
        entries: dict[str, Any] = {}
        for fqn, e in d["state_dict"].items():
            if e["kind"] == "tensor":
                _check_chunks(fqn, e["size"], e["chunks"])
                entries[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=ST_TO_DTYPE[e["dtype"]]),
                    torch.Size(e["size"]),
                    [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in e["chunks"]],
                )
            else:
                entries[fqn] = BytesStorageMetadata()
        planner_data = join(d["planner_data"], lambda n: None)
        if isinstance(planner_data, dict):  # DefaultSavePlanner: {flat key: path tuple}
            planner_data = {
                k: tuple(v) if isinstance(v, list) else v for k, v in planner_data.items()
            }
        sm = d.get("storage_meta")
        storage = {
            MetadataIndex(fqn, None if off is None else torch.Size(off), index): where
            for fqn, off, index, where in d["storage"]
        }
        meta = Metadata(
            entries,
            planner_data=planner_data,
            storage_data=storage,
            storage_meta=None if sm is None else StorageMeta(**sm),
            version=d.get("version"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorruptError(f"{METADATA_NAME}: malformed ({type(e).__name__}: {e})") from e
    return meta, storage


def _check_chunks(fqn: str, size: list[int], chunks: list[Any]) -> None:
    """Raise where saved chunks of a tensor lie outside it or overlap, as DCP's save validates
    its plan (a hand-edited file, sealed again, may not): DCP's load plans its reads from them
    without checking, and an overlap can stand for a gap whose values it leaves as they were.
    (Coverage is not required: DCP checks it only for saves of several ranks.)"""
    if not size:  # a 0-d tensor: DCP does not check these either
        return
    boxes = [Box.of(o, s) for o, s in chunks]
    outside = [
        b
        for b in boxes
        if len(b.sizes) != len(size)
        or any(o < 0 or o + z > d for o, z, d in zip(b.offsets, b.sizes, size, strict=True))
    ]
    problem = f"chunk {outside[0]} outside the tensor's size {size}" if outside else None
    problem = problem or overlap_problem(boxes)
    if problem is not None:
        raise CheckpointCorruptError(f"{METADATA_NAME}: {fqn}: {problem}")
