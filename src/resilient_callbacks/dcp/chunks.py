"""A sharded state dict as JSON + named tensors, and boxes of a global tensor.

:func:`split` turns a nested state dict (what ``get_state_dict`` returns: dicts keyed by FQN,
lists of ``param_groups``, tuples, numbers, tensors, DTensors) into a JSON-able *skeleton* in
which every tensor is replaced by a reference to its name, plus a flat ``{name: tensor}``
table; :func:`join` rebuilds the state dict from a skeleton and a function giving each named
tensor. A tensor's name is its path in the state dict (``model/0.weight``,
``optim/state/0.weight/exp_avg``), so names are the same whatever the number of ranks.

A :class:`Box` is a piece of a global tensor: its offsets and sizes in every dimension (DCP's
``ChunkStorageMetadata``). :func:`copy_overlap` copies what two boxes share, which is how a
rank assembles the local shard it needs from the chunks other ranks saved (resharding).

Nothing here unpickles: the only non-tensor values kept are JSON ones (and tuples, non-finite
floats, integer dict keys and NumPy arrays and scalars of bool, int and float dtypes, tagged);
anything else is refused with
:class:`~resilient_callbacks.errors.UnsupportedStateError` naming where it is.
"""

from __future__ import annotations

import base64
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointCorruptError, UnsupportedStateError

TAG = "__rc__"


def escape(key: str) -> str:
    """A state dict key as one part of a tensor name (``/`` separates the parts)."""
    return key.replace("%", "%25").replace("/", "%2F")


def unescape(part: str) -> str:
    """The key of one part of a tensor name (:func:`escape` undone)."""
    return part.replace("%2F", "/").replace("%25", "%")


def split(state: Any, where: str | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)`` of a nested state dict; see the module docstring. ``where``: the
    name of ``state`` itself in errors (a key of the caller's state dict)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: tuple[str, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            name = "/".join(path)
            tensors[name] = obj
            return {TAG: "tensor", "name": name}
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) for k in obj) and TAG not in obj:
                return {k: walk(v, (*path, escape(k))) for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise UnsupportedStateError(
                        f"state dict key {k!r} at {'/'.join(path) or '<root>'} is not a str or "
                        "an int; it cannot be written as JSON"
                    )
                items.append([k, walk(v, (*path, escape(str(k))))])
            return {TAG: "dict", "items": items}
        if isinstance(obj, enum.Enum) or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
            # a member or a namedtuple would come back as its plain value: a silent change
            kind = type(obj)
            raise UnsupportedStateError(
                f"{'/'.join(path) or '<root>'}: a {kind.__module__}.{kind.__qualname__} would be "
                "loaded as its plain value (nothing is pickled, so its class cannot be kept); "
                "save the value (x.value, tuple(x)) or a dict"
            )
        if isinstance(obj, tuple):  # torch.Size too: loaded as a tuple of the same values
            return {TAG: "tuple", "items": [walk(v, (*path, str(i))) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(obj)]
        if isinstance(obj, float) and not math.isfinite(obj):
            return {TAG: "float", "value": repr(obj)}
        if obj is None or isinstance(obj, (bool, int, float, str)):  # numpy.float64: a float
            return obj
        if isinstance(obj, (np.ndarray, np.generic)):
            return _numpy(obj, "/".join(path) or "<root>")
        raise UnsupportedStateError(
            f"{'/'.join(path) or '<root>'}: a {type(obj).__qualname__} cannot be written as "
            "JSON (only tensors, DTensors, numbers, strings, None, lists, tuples and dicts are "
            "saved; nothing is pickled)"
        )

    return walk(state, (where,) if where else ()), tensors


def _numpy(obj: np.ndarray | np.generic, where: str) -> dict[str, Any]:
    """A NumPy array or scalar (``np.random.get_state()``'s key array, an ``np.int64`` count)
    as tagged JSON keeping its dtype and shape: bool, int and float ones up to 64 bits."""
    arr = np.asarray(obj)
    if arr.dtype.kind not in "biuf" or arr.dtype.itemsize > 8:
        what = "array" if isinstance(obj, np.ndarray) else "scalar"
        raise UnsupportedStateError(
            f"{where}: a NumPy {what} of dtype {arr.dtype} cannot be written as JSON (bool, int "
            "and float ones up to 64 bits can; convert it: .tolist(), .astype(...))"
        )
    little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {
        TAG: "numpy",
        "dtype": little.dtype.str,
        "shape": list(arr.shape),
        "scalar": isinstance(obj, np.generic),
        "b64": base64.b64encode(little.tobytes()).decode("ascii"),
    }


def held(obj: Any) -> Any:
    """A non-tensor leaf of a state dict as a staged copy keeps it: a NumPy array copied (it
    may change in place before a background save writes it), any other leaf as it is (the
    JSON-able ones are immutable; the rest are refused when written)."""
    return obj.copy() if isinstance(obj, np.ndarray) else obj


def join(skeleton: Any, tensor: Callable[[str], Any]) -> Any:
    """The state dict of ``skeleton``, each tensor reference replaced by ``tensor(name)``."""
    if isinstance(skeleton, list):
        return [join(v, tensor) for v in skeleton]
    if isinstance(skeleton, dict):
        tag = skeleton.get(TAG)
        if tag is None:
            return {k: join(v, tensor) for k, v in skeleton.items()}
        if tag == "tensor":
            return tensor(skeleton["name"])
        if tag == "tuple":
            return tuple(join(v, tensor) for v in skeleton["items"])
        if tag == "dict":
            return {k: join(v, tensor) for k, v in skeleton["items"]}
        if tag == "float":
            return float(skeleton["value"])
        if tag == "numpy":
            raw = base64.b64decode(skeleton["b64"])
            arr = np.frombuffer(raw, dtype=np.dtype(skeleton["dtype"])).reshape(skeleton["shape"])
            return arr[()] if skeleton["scalar"] else arr.copy()
        raise CheckpointCorruptError(f"unknown tag {tag!r} in a sharded state's JSON")
    return skeleton


@dataclass(frozen=True)
class Box:
    """A piece of a global tensor: where it starts (``offsets``) and how big it is (``sizes``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, offsets: Sequence[int], sizes: Sequence[int]) -> Box:
        return cls(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The box both share, or ``None`` when they share no element."""
        if len(self.sizes) != len(other.sizes):
            return None
        lo = [max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True)]
        hi = [
            min(a + s, b + t)
            for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        ]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None if self.sizes else Box((), ())  # a 0-d tensor: one shared element
        return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True)))


def narrow(t: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    for dim, (o, s, base) in enumerate(zip(box.offsets, box.sizes, origin.offsets, strict=True)):
        t = t.narrow(dim, o - base, s)
    return t


def copy_overlap(dst: torch.Tensor, dst_box: Box, src: torch.Tensor, src_box: Box) -> int:
    """Copy the elements ``src`` (holding ``src_box``) shares with ``dst`` (holding
    ``dst_box``) into ``dst``; return how many."""
    common = dst_box.intersect(src_box)
    if common is None:
        return 0
    if tuple(src.shape) != src_box.sizes:
        raise CheckpointCorruptError(
            f"a saved chunk has shape {list(src.shape)}, its index says {list(src_box.sizes)}"
        )
    narrow(dst, common, dst_box).copy_(narrow(src, common, src_box))
    return common.numel


def first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` that share an element, or ``None`` when no two do. The chunks of an
    honest index never overlap (a replica is written once), so a sum of their sizes counts
    each element once only when this finds nothing. A sweep along the first dimension: only
    boxes whose first-dimension ranges overlap are compared (for shards of rows, neighbours)."""
    live = [b for b in boxes if b.numel]
    if live and not live[0].sizes:  # 0-d: any two are the one element
        return (live[0], live[1]) if len(live) > 1 else None
    live.sort(key=lambda b: b.offsets[0])
    active: list[Box] = []
    for b in live:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > b.offsets[0]]
        for a in active:
            if a.intersect(b) is not None:
                return a, b
        active.append(b)
    return None


def check_index(index: Any, world_size: int) -> None:
    """Raise :class:`CheckpointCorruptError` where the saved chunk index (from a manifest,
    which has no checksum of its own) cannot describe what the ranks saved: an entry not
    shaped as written, a chunk outside its tensor or of a rank that did not save, chunks too
    small to cover their tensor, two chunks that overlap (then a sum of their sizes counts some
    elements twice and can hide a gap). Checked before anything loads, so the restore falls
    back."""

    def bad(name: Any, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"the chunk index of {name!r} is damaged: {why}")

    if not isinstance(index, dict):
        raise CheckpointCorruptError("the chunk index is damaged: not a mapping")
    for name, entry in index.items():
        if not isinstance(entry, dict):
            raise bad(name, "not a mapping")
        shape, chunks = entry.get("shape"), entry.get("chunks")
        if not (isinstance(shape, list) and _ints(shape) and isinstance(chunks, list)):
            raise bad(name, "no shape or chunk list")
        covered, boxes = 0, []
        for c in chunks:
            if not (isinstance(c, list) and len(c) in (3, 4) and _ints(c[1]) and _ints(c[2])):
                raise bad(name, f"chunk {c!r}")
            r, offsets, sizes = c[0], c[1], c[2]
            if not (isinstance(r, int) and 0 <= r < world_size):
                raise bad(name, f"chunk of rank {r!r} ({world_size} rank(s) saved)")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise bad(name, f"chunk {offsets}+{sizes} of a {len(shape)}-d tensor")
            if any(o < 0 or o + z > d for o, z, d in zip(offsets, sizes, shape, strict=True)):
                raise bad(name, f"chunk {offsets}+{sizes} outside the tensor's shape {shape}")
            covered += math.prod(sizes)
            boxes.append(Box.of(offsets, sizes))
        if covered < math.prod(shape):
            raise bad(name, f"chunks of {covered} elements cannot cover {math.prod(shape)}")
        overlap = overlap_problem(boxes)
        if overlap is not None:
            raise bad(name, overlap)


def overlap_problem(boxes: Sequence[Box]) -> str | None:
    """Which two of ``boxes`` (saved chunks of one tensor) overlap, said, or ``None``."""
    both = first_overlap(boxes)
    if both is None:
        return None
    a, b = both
    return f"chunks {list(a.offsets)}+{list(a.sizes)} and {list(b.offsets)}+{list(b.sizes)} overlap"


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def index_of_ranks(
    per_rank: Sequence[Mapping[str, Any]], rank: int
) -> tuple[dict[str, Any], set[str]]:
    """The chunk index of every rank (``per_rank[r]``: rank r's ``{name: (dtype, shape,
    chunks)}``), and the keys of the chunks ``rank`` writes: a chunk several ranks hold (a
    replicated placement) is written by the lowest of them; empty chunks by none."""
    index: dict[str, dict[str, Any]] = {}
    owned: set[str] = set()
    for r, theirs in enumerate(per_rank):
        for name, (dtype, shape, chunks) in theirs.items():
            entry = index.setdefault(name, {"dtype": dtype, "shape": shape, "chunks": []})
            if entry["dtype"] != dtype or entry["shape"] != shape:
                raise UnsupportedStateError(
                    f"{name}: rank {r} holds a {dtype} {shape} tensor, a lower rank a "
                    f"{entry['dtype']} {entry['shape']} one"
                )
            for offsets, sizes, key in chunks:
                if Box.of(offsets, sizes).numel == 0:
                    continue
                if any(c[1] == offsets and c[2] == sizes for c in entry["chunks"]):
                    continue  # a replica of a chunk a lower rank writes
                entry["chunks"].append([r, offsets, sizes] + ([key] if key != name else []))
                if r == rank:
                    owned.add(key)
    return index, owned
