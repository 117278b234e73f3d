"""One rank's files of a ``dcp.save`` through :class:`~.storage_writer.ResilientStorageWriter`:
their names, what of the rank's plan goes into each, and writing them into the save's staging
directory.

Which ranks call what: every rank writes its own two files, from DCP's ``write_data``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import UnsupportedStateError
from ..filewrite import write_json
from ..manifest import FileEntry
from ..tensorfile import write_tensors
from .chunks import split
from .metadata_json import index_key

DCP_DIR = "dcp"


def rank_files(rank: int) -> tuple[str, str]:
    """The tensor file and the JSON file of ``rank``, relative to the checkpoint."""
    return f"{DCP_DIR}/rank_{rank:05d}.safetensors", f"{DCP_DIR}/rank_{rank:05d}.json"


def write_rank_files(
    staging: str, rank: int, tensors: dict[str, torch.Tensor], objects: dict[str, Any]
) -> list[FileEntry]:
    """Write ``rank``'s tensors (one safetensors file) and objects (one JSON file) into
    ``staging`` through the core's hashing writers. When a write fails (a full disk), what this
    rank wrote is removed at once: the failed save's staging directory kept the disk full until
    the next save or ``close()`` swept it."""
    tensor_name, json_name = rank_files(rank)
    files: list[FileEntry] = []
    os.makedirs(os.path.join(staging, DCP_DIR), exist_ok=True)
    try:
        if tensors:
            path = os.path.join(staging, tensor_name)
            d = write_tensors(path, tensors, {"format": "resilient_callbacks"})
            files.append(FileEntry(tensor_name, d.size, d.xxh3_64, rank))
        if objects:
            d = write_json(os.path.join(staging, json_name), objects)
            files.append(FileEntry(json_name, d.size, d.xxh3_64, rank, "structure"))
    except BaseException:
        for name in (tensor_name, json_name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(staging, name))
        raise
    return files


def collect_items(
    plan: SavePlan,
    planner: SavePlanner,
    tensors: dict[str, torch.Tensor],
    objects: dict[str, Any],
    results: list[WriteResult],
    storages: set[int],
) -> None:
    """Every rank, from ``write_data``: sort the items of this rank's ``plan`` into
    ``tensors`` (to its safetensors file) and ``objects`` (to its JSON file, as JSON
    skeletons), one ``WriteResult`` each into ``results``, and the storages read into
    ``storages`` (staged host buffers end their lease when written)."""
    tensor_name, json_name = rank_files(int(plan.storage_data["rank"]))
    for item in plan.items:
        key = index_key(item.index)
        if item.type == WriteItemType.BYTE_IO:
            lookup = getattr(planner, "lookup_object", None)
            if lookup is None:
                raise UnsupportedStateError(
                    f"{item.index.fqn}: the planner {type(planner).__name__} has no "
                    "lookup_object(); its objects would be pickled (use DefaultSavePlanner)"
                )
            skeleton, inner = split(lookup(item.index), where=item.index.fqn)
            if inner:
                raise UnsupportedStateError(
                    f"{item.index.fqn}: an object holding tensors (DCP writes a tensor as "
                    "a tensor only at the top level of the flattened state dict: keep "
                    "DefaultSavePlanner's flatten_state_dict=True, its default)"
                )
            objects[key] = skeleton
            results.append(WriteResult(item.index, 0, {"file": json_name, "key": key}))
        else:
            t = planner.resolve_data(item)
            assert isinstance(t, torch.Tensor)
            t = t.detach()
            if t.numel():
                storages.add(t.untyped_storage().data_ptr())
            if t.device.type != "cpu":
                t = t.to("cpu")
            tensors[key] = t.contiguous()
            nbytes = t.numel() * t.element_size()
            results.append(WriteResult(item.index, nbytes, {"file": tensor_name, "key": key}))
