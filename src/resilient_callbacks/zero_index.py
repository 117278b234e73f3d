"""What a DeepSpeed ZeroPart stores, read from its ranks' JSON indexes (moved from
:mod:`.consolidate`): the parts of a checkpoint that are ZeroParts, and, for
``resilient-ckpt inspect``, every tensor they hold with its whole shape."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from .dtype_codes import ST_CODES
from .errors import CheckpointCorruptError
from .manifest import Manifest
from .part_names import parts_of_format, stored_dir
from .tensor_headers import read_verified

ZERO_FORMAT = "zero-fragments/1"


def zero_part_ids(manifest: Manifest) -> list[str]:
    """The parts of a checkpoint written by the DeepSpeed adapter's ZeroPart."""
    return parts_of_format(manifest, ZERO_FORMAT)


def zero_indexes(path: str, manifest: Manifest, part_id: str) -> Iterator[tuple[str, Any]]:
    """``(file, index)`` of each rank's JSON index of ZeroPart ``part_id``, verified."""
    folder = stored_dir(manifest, part_id)
    entries = {f.path: f for f in manifest.files}
    index_names = sorted(
        p for p in entries if p.startswith(folder + "/rank_") and p.endswith(".json")
    )
    if not index_names:
        raise CheckpointCorruptError(f"{path}: part {part_id!r} lists no rank files")
    for rel in index_names:
        yield rel, json.loads(bytes(read_verified(os.path.join(path, rel), entries[rel].digest)))


def zero_tensors(
    path: str, manifest: Manifest, part_id: str, described: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """What ZeroPart ``part_id`` stores, for ``resilient-ckpt inspect``, as a ``dcp.Sharded``
    part describes its tensors: ``{name: {"dtype", "shape", "chunks"}}``, the whole tensor's
    shape and one chunk per rank holding a range of it. Each trained parameter's fp32 master
    (``fp32/NAME``) and optimizer moments (``exp_avg/NAME``, ...: fp32, as ZeRO keeps them
    beside the masters), and at ZeRO 3 each frozen parameter (``frozen/NAME``, the module's
    dtype, ``described["dtype"]``)."""
    frozen_code = ST_CODES.get(str(described.get("dtype")))
    out: dict[str, dict[str, Any]] = {}
    for _, index in zero_indexes(path, manifest, part_id):
        rank = index.get("rank")
        sections = (("params", index.get("keys") or [], "F32"), ("frozen", ["frozen"], frozen_code))
        for section, keys, code in sections:
            for name, rng in (index.get(section) or {}).items():
                for key in keys:
                    entry = out.setdefault(
                        f"{key}/{name}", {"dtype": code, "shape": rng["shape"], "chunks": []}
                    )
                    if rng["numel"]:
                        entry["chunks"].append([rank, int(rng["start"]), int(rng["numel"])])
    return out
