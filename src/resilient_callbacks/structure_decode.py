"""Reading a saved structure back: ``decode`` rebuilds Python values from a structure (see
:mod:`.structure` for its tags) and a table of loaded tensors, ``inline_per_rank`` puts a rank's
``PerRank`` nodes into the shared structure, and the node readers (``_node_items``,
``_node_seq``, ``_describe``) through which :mod:`.fit`, :mod:`.inplace` and
:mod:`.consolidate` walk a structure. Moved from ``structure.py`` unchanged; no collectives:
each rank reads its own part.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import mapped
from .errors import CheckpointMismatchError
from .layout_meta import TAG


@dataclass
class StatefulNode:
    """A decoded ``state_dict()`` result, to be passed to the live object's ``load_state_dict``."""

    type: str
    state: Any


def decode(
    node: Any,
    tensors: Mapping[str, torch.Tensor],
    per_rank: Mapping[str, Any] | None = None,
    keep_stateful: bool = False,
    memo: dict[int, Any] | None = None,
) -> Any:
    """Rebuild Python values from a structure. With ``keep_stateful`` a stateful node becomes a
    :class:`StatefulNode`; otherwise it becomes its plain state dict. ``memo``: each dict and
    list node's value by its ``id``, filled and used again (a restore's check, then its load;
    with the same arguments, the structure alive and unchanged)."""
    if memo is not None and id(node) in memo:
        return memo[id(node)]

    def rec(n: Any) -> Any:
        if not isinstance(n, (dict, list)):
            return n
        out = [rec(v) for v in n] if isinstance(n, list) else one(n)
        if memo is not None:
            memo[id(n)] = out
        return out

    def one(n: dict[str, Any]) -> Any:
        tag = n.get(TAG)
        if tag is None:
            return {k: rec(v) for k, v in n.items()}
        if tag == "tensor":
            t = tensors[n["key"]]
            if not n.get("numpy"):
                return t
            # an array is plain data, kept where it is put: never a view of a mapped file
            return t.numpy().copy() if mapped.is_mapped(t) else t.numpy()
        if tag == "dict":
            return {_hashable(rec(k)): rec(v) for k, v in n["items"]}
        if tag == "tuple":
            return tuple(rec(v) for v in n["items"])
        if tag == "size":
            return torch.Size(n["items"])
        if tag == "float":
            return float(n["value"])
        if tag == "set":
            return {_hashable(rec(v)) for v in n["items"]}
        if tag == "frozenset":
            return frozenset(_hashable(rec(v)) for v in n["items"])
        if tag == "dtype":
            dt = getattr(torch, n["name"], None)
            if not isinstance(dt, torch.dtype):
                raise CheckpointMismatchError(f"unknown torch dtype {n['name']!r} in checkpoint")
            return dt
        if tag == "device":
            return torch.device(n["name"])
        if tag == "bytes":
            return base64.b64decode(n["b64"])
        if tag == "np":
            return np.dtype(n["dtype"]).type(rec(n["value"]))
        if tag == "stateful":
            inner = rec(n["state"])
            return StatefulNode(n["type"], inner) if keep_stateful else inner
        if tag == "per_rank":
            if per_rank is None or n["id"] not in per_rank:
                raise CheckpointMismatchError(
                    f"per-rank state {n['id']!r} is missing for this rank in the checkpoint"
                )
            return rec(per_rank[n["id"]])
        if tag == "filepart":  # its files are read by the part itself
            return dict(n)
        raise CheckpointMismatchError(f"unknown node type {tag!r} in checkpoint structure")

    try:
        return rec(node)
    finally:
        # rec and one refer to each other through their closures: a cycle that kept ``tensors``
        # (views of the mapped checkpoint files, see mapped.py) alive until the cyclic GC ran
        rec = one = None  # type: ignore[assignment]


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    return v


def inline_per_rank(structure: Any, per_rank: Mapping[str, Any] | None) -> Any:
    """Replace the ``per_rank`` placeholders of a shared structure with this rank's nodes, so the
    result describes the whole state as seen by this rank."""

    def rec(n: Any) -> Any:
        if isinstance(n, list):
            return [rec(v) for v in n]
        if not isinstance(n, dict):
            return n
        if n.get(TAG) == "per_rank":
            if per_rank is None or n["id"] not in per_rank:
                raise CheckpointMismatchError(
                    f"per-rank state {n['id']!r} is missing for this rank in the checkpoint (was "
                    "it written by fewer ranks?): resume on the ranks that wrote it, or wrap an "
                    "object that works out its share from rank 0's state (a sharded "
                    "ResumableDataLoader) as PerRank(obj, new_ranks='rank0')"
                )
            return per_rank[n["id"]]
        if n.get(TAG) == "tensor":
            return n
        return {k: rec(v) for k, v in n.items()}

    return rec(structure)


def _node_items(n: Any) -> dict[Any, Any] | None:
    if isinstance(n, dict) and n.get(TAG) is None:
        return dict(n)
    if isinstance(n, dict) and n.get(TAG) == "dict":  # (a plain key, an int, is itself)
        items = n["items"]
        return {_hashable(decode(k, {})) if isinstance(k, (dict, list)) else k: v for k, v in items}
    return None


def _node_seq(n: Any) -> list[Any] | None:
    if isinstance(n, list):
        return n
    if isinstance(n, dict) and n.get(TAG) == "tuple":
        return list(n["items"])
    return None


def _describe(n: Any) -> str:
    if isinstance(n, dict):
        return f"a {n.get(TAG, 'dict')}"
    return f"a {type(n).__name__}"
