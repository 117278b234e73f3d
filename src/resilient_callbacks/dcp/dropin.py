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

from ..errors import CheckpointCorruptError, CheckpointMismatchError
from ..manifest import Manifest, read_manifest
from ..tensorfile import ST_TO_DTYPE, read_verified
from .metadata_json import METADATA_NAME
from .storage_reader import ResilientStorageReader


def _metadata(path: str, manifest: Manifest) -> dict[str, Any]:
    """``dcp_metadata.json``, verified against the manifest."""
    (entry,) = [f for f in manifest.files if f.path == METADATA_NAME]
    buf = read_verified(os.path.join(path, METADATA_NAME), entry.digest)
    try:
        doc = json.loads(bytes(buf))
        entries = doc["state_dict"]
        if not isinstance(entries, dict):
            raise TypeError("state_dict is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointCorruptError(f"{path}/{METADATA_NAME}: malformed ({e})") from None
    return entries


def keys(path: str, manifest: Manifest) -> list[dict[str, Any]]:
    """One row per key of the saved state dict, as ``inspect`` lists them: a tensor's dtype,
    global shape and number of chunks (the pieces the ranks wrote); an object as such (its
    value is JSON in a rank's ``dcp/rank_*.json``)."""
    rows: list[dict[str, Any]] = []
    for fqn, e in sorted(_metadata(path, manifest).items()):
        if isinstance(e, dict) and e.get("kind") == "tensor":
            rows.append(
                {
                    "key": fqn,
                    "kind": "tensor",
                    "dtype": e.get("dtype"),
                    "shape": e.get("size"),
                    "stored_as": "dcp/rank_*.safetensors",
                    "chunks": len(e.get("chunks") or []),
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
    entries = _metadata(path, read_manifest(path))
    out: dict[str, torch.Tensor] = {}
    for fqn, e in entries.items():
        if isinstance(e, dict) and e.get("kind") == "tensor":
            dtype = ST_TO_DTYPE.get(str(e.get("dtype")))
            if dtype is None:
                raise CheckpointCorruptError(f"{path}: {fqn} has an unknown dtype {e.get('dtype')}")
            out[fqn] = torch.empty([int(d) for d in e.get("size") or []], dtype=dtype)
    if not out:
        raise CheckpointMismatchError(f"{path} holds no tensors: there is nothing to export")
    reader = ResilientStorageReader(path, no_dist=True)
    planner = DefaultLoadPlanner(flatten_state_dict=False)  # the keys are DCP's flat names
    dcp.load(out, storage_reader=reader, planner=planner, no_dist=True)
    return out
