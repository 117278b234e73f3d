"""The layout hash of a save's replicated structure (``session.layout``), moved from
:mod:`.structure` unchanged."""

from __future__ import annotations

import json
from typing import Any

import xxhash

from .layout_meta import TAG


def layout_hash(structure: Any) -> str:
    """A hash of what a restore requires of every rank's replicated state: the keys (and list
    lengths) of the containers that hold live objects (tensors, modules, optimizers, stateful
    objects, parts), and those objects' kinds. Plain data is not looked into:
    its values and keys may differ between ranks (rank 0's are saved; a restore merges it)."""

    def skeleton(n: Any) -> tuple[bool, Any]:  # (holds a live object, its skeleton)
        if isinstance(n, list):
            items = [skeleton(v) for v in n]
            live = any(x for x, _ in items)
            return live, [s for _, s in items] if live else "plain"
        if not isinstance(n, dict):
            return False, "plain"
        tag = n.get(TAG)
        if tag is None:
            kids = {k: skeleton(v) for k, v in n.items()}
            live = any(x for x, _ in kids.values())
            return live, {k: s for k, (_, s) in kids.items()} if live else "plain"
        if tag == "stateful":  # its own load_state_dict judges its state
            return True, ["stateful", n.get("type")]
        if tag in ("tensor", "per_rank", "filepart"):
            return True, tag
        return False, "plain"

    try:
        text = json.dumps(skeleton(structure)[1], sort_keys=True)
    finally:
        skeleton = None  # type: ignore[assignment]  # (a self-referring closure: no cycle)
    return xxhash.xxh3_64_hexdigest(text.encode())
