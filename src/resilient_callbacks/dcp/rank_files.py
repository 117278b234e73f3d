"""One rank's files of a ``dcp.save`` through :class:`~.storage_writer.ResilientStorageWriter`:
their names, and writing them into the save's staging directory.

Which ranks call what: every rank writes its own two files, from DCP's ``write_data``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from ..manifest import FileEntry
from ..tensorfile import write_json, write_tensors

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
