"""What the CLI reads of a checkpoint written by ``dcp.save`` through
:class:`~.storage_writer.ResilientStorageWriter` (``dcp_metadata.json`` and ``dcp/rank_*``, no
``shared.json``): its keys for ``resilient-ckpt inspect``, and its whole tensors for
``resilient-ckpt export``.

Which ranks call what: one process, any number of ranks saved it; nothing here is collective
(``dcp.load`` runs with ``no_dist=True``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..dtypes import DTYPE_TO_ST
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from ..manifest import Manifest, read_manifest
from ..tensor_headers import read_verified
from .metadata_json import METADATA_NAME, from_json
from .storage_reader import ResilientStorageReader


def _metadata(path: str, manifest: Manifest) -> Metadata:
    """DCP's ``Metadata`` from ``dcp_metadata.json``, verified against the manifest."""
    (entry,) = [f for f in manifest.files if f.path == METADATA_NAME]
    buf = read_verified(os.path.join(path, METADATA_NAME), entry.digest)
    try:
        return from_json(json.loads(bytes(buf)))[0]
    except ValueError as e:
        raise CheckpointCorruptError(f"{path}/{METADATA_NAME}: malformed ({e})") from None


def keys(path: str, manifest: Manifest) -> list[dict[str, Any]]:
    """One row per key of the saved state dict, as ``inspect`` lists them: a tensor's dtype,
    global shape and number of chunks (the pieces the ranks wrote); an object as such (its
    value is JSON in a rank's ``dcp/rank_*.json``)."""
    rows: list[dict[str, Any]] = []
    for fqn, md in sorted(_metadata(path, manifest).state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            rows.append(
                {
                    "key": fqn,
                    "kind": "tensor",
                    "dtype": DTYPE_TO_ST[md.properties.dtype],
                    "shape": list(md.size),
                    "stored_as": "dcp/rank_*.safetensors",
                    "chunks": len(md.chunks),
                }
            )
        else:
            rows.append({"key": fqn, "kind": "object", "type": "dcp object (JSON)"})
    return rows


def whole_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` whole, under its state-dict key (DCP's
    flattened name, such as ``model.layer.weight`` or ``optim.state.layer.weight.exp_avg``),
    dtypes as saved: read through :class:`ResilientStorageReader` (every file verified) by DCP's
    own planner, which lays the ranks' chunks together."""
    out = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype)
        for fqn, md in _metadata(path, read_manifest(path)).state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    if not out:
        raise CheckpointMismatchError(f"{path} holds no tensors: there is nothing to export")
    reader = ResilientStorageReader(path, no_dist=True)
    reader.resumes = False  # a run saving here goes on numbering its own lineage
    planner = DefaultLoadPlanner(flatten_state_dict=False)  # the keys are DCP's flat names
    dcp.load(out, storage_reader=reader, planner=planner, no_dist=True)
    return out
