"""Turning a training state into JSON + named tensors, and back, without pickle.

``encode`` walks a nested state (dicts, lists, tuples, objects with ``state_dict()``, tensors,
JSON-able values) and returns a JSON-able *structure* in which every tensor is replaced by a
reference to an entry of a flat ``{name: tensor}`` table. Tensors that are the same view of the
same storage (tied weights, aliases) are stored once and restored as one object.

``decode`` rebuilds Python values from a structure and a table of loaded tensors;
:func:`.inplace.apply` loads them *in place* into the live objects of a state, after
:func:`.fit.check_fits` has listed every key or shape that does not fit.

Tags: a JSON object with the key ``"__rc__"`` is a typed node (tuple, tensor, non-string dict
keys, non-finite float, ...). Plain dicts whose keys are all strings (and none is ``"__rc__"``)
stay plain JSON objects so the files remain readable.
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import mapped, module_versions
from .errors import CheckpointMismatchError, UnsupportedStateError
from .filepart import FilePart
from .layout_meta import TAG
from .optim import hookable, param_shapes
from .refusals import fix_for, refuse_int, refuse_numpy, refuse_stateful, refuse_tensor
from .wrapped import plain_module

_JSON_SCALARS = (bool, int, str, type(None))


class PerRank:
    """Marks a part of the state that differs between ranks (a data loader's position, a
    rank-local generator). It is written by every rank into its own file and restored on the
    same rank. Everything not marked is treated as replicated and written once, by rank 0.

    ``new_ranks``: what a rank the checkpoint has no files of (a resume on more ranks) loads:
    ``"refuse"`` (default: the resume is refused, nothing loaded) or ``"rank0"`` (rank 0's
    state, for an object that works out its own share from it, such as a sharded
    :class:`~resilient_callbacks.ResumableDataLoader`; a one-rank checkpoint acts so always)."""

    def __init__(self, obj: Any, *, new_ranks: str = "refuse") -> None:
        if new_ranks not in ("refuse", "rank0"):
            raise ValueError(f"PerRank(new_ranks={new_ranks!r}): 'refuse' or 'rank0'")
        self.obj = obj
        self.new_ranks = new_ranks

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r})"


class OptionalKeys(dict[str, Any]):
    """A dict of the state some of whose keys (``optional``) a checkpoint may lack: entries
    added to a state after checkpoints of it were written. Such a key missing from the
    checkpoint keeps its live value on restore; any other missing key is refused, as in a
    plain dict. Saved as a plain dict (the format does not change). The check goes through
    :meth:`missing_allowed`, the hook ``fit.check_fits`` asks of any dict of the state."""

    def __init__(self, *args: Any, optional: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.optional = frozenset(optional)

    def missing_allowed(self, missing: list[str]) -> bool:
        """Whether the checkpoint may lack every one of ``missing``: all are ``optional``."""
        return set(missing) <= self.optional


def gone_ranks(world_size: int, saved_world_size: int) -> str:
    """The ranks of a checkpoint that a run on ``world_size`` ranks has no process for."""
    first, last = world_size, saved_world_size - 1
    return f"rank {first}" if first == last else f"ranks {first} to {last}"


def gone_state(world_size: int, saved_world_size: int, per_rank: bool, rng: bool) -> list[str]:
    """What rank 0 of a restore on fewer ranks than the save says is not loaded: the ranks
    gone's ``PerRank`` state (``per_rank``: the checkpoint holds some) and RNG states (``rng``:
    it holds them and they are restored)."""
    if saved_world_size <= world_size:
        return []
    gone = gone_ranks(world_size, saved_world_size)
    said = f"the checkpoint was written by {saved_world_size} ranks, this run has {world_size}: "
    return [said + f"the PerRank state of {gone} is not loaded"] * per_rank + [
        said + f"the RNG states of {gone} are not loaded: their random streams (Python, NumPy, "
        "torch, CUDA) cannot be continued, so the run does not go on exactly as it would have "
        f"on {saved_world_size} ranks (rank 0's streams go on)"
    ] * rng


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` is saved as its state dict (``plain_module(obj).state_dict()``)."""
    return isinstance(obj, torch.Generator) or (
        not isinstance(obj, (torch.Tensor, Mapping, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def path_str(path: tuple[Any, ...]) -> str:
    """``('model', 'fc.weight')`` -> ``state['model']['fc.weight']``."""
    return "state" + "".join(f"[{p!r}]" for p in path)


class KeyPath:
    """A key path whose ``str()`` is :func:`path_str`'s, formatted only when asked: the
    refusals of a save name it in their errors, and formatting it for every tensor of every
    save cost as much as the checks themselves."""

    __slots__ = ("path",)

    def __init__(self, path: tuple[Any, ...]) -> None:
        self.path = path

    def __str__(self) -> str:
        return path_str(self.path)


@dataclass
class Encoded:
    """The result of encoding: a JSON-able structure plus the tensors it references."""

    structure: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    per_rank: dict[str, Any] = field(default_factory=dict)  # id -> structure (rank-local)


class _Encoder:
    def __init__(self, split_per_rank: bool) -> None:
        self.split_per_rank = split_per_rank
        self.tensors: dict[str, torch.Tensor] = {}
        self._alias: dict[tuple[Any, ...], str] = {}
        self.rank_tensors: dict[str, torch.Tensor] = {}
        self._rank_alias: dict[tuple[Any, ...], str] = {}
        self.per_rank: dict[str, Any] = {}
        self._in_rank = False
        self._part_paths: dict[str, tuple[Any, ...]] = {}  # PerRank/FilePart id -> its path
        self._open: set[int] = set()  # the containers on the path being encoded

    def part_id(self, path: tuple[Any, ...]) -> str:
        """The id of the PerRank or FilePart at ``path``: refused where another has it."""
        pid = part_id(path)
        other = self._part_paths.setdefault(pid, path)
        if other != path:
            raise UnsupportedStateError(
                f"{path_str(other)} and {path_str(path)} would share the id {pid!r} (the files "
                "of a FilePart, the per-rank state of a PerRank): one of them would be lost. "
                "Rename one of the keys (ids join the keys with '/' as strings)."
            )
        return pid

    def tensor_ref(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        refuse_tensor(t, KeyPath(path))  # the key path formatted only if it is refused
        t = t.detach()
        table, alias = (
            (self.rank_tensors, self._rank_alias) if self._in_rank else (self.tensors, self._alias)
        )
        if t.numel() > 0:
            ident = (
                t.device,
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
                t.is_conj(),  # x.conj() and x._neg_view() view x's bytes but hold other values
                t.is_neg(),
            )
            name = alias.get(ident)
            if name is not None:
                return {TAG: "tensor", "key": name}
        else:
            ident = None
        base = "/".join(map(str, path)) or "tensor"
        # valid UTF-8 (a lone surrogate in a key made a header other safetensors readers refuse)
        base = base.encode("utf-8", "backslashreplace").decode("utf-8")
        if self._in_rank:
            base = "@rank/" + base  # rank-local names never clash with shared ones
        elif base.startswith("@"):
            base = "@" + base
        name = base
        n = 1
        while name in table or name == "__metadata__":  # reserved by safetensors
            n += 1
            name = f"{base}#{n}"
        table[name] = t
        if ident is not None:
            alias[ident] = name
        return {TAG: "tensor", "key": name}

    def _enter(self, obj: Any, path: tuple[Any, ...]) -> None:
        """Before descending into the container ``obj``: refuse one that holds itself (JSON
        cannot, and the walk would never end). The caller discards its id once it is done."""
        if id(obj) in self._open:
            raise UnsupportedStateError(
                f"{path_str(path)} is a container that holds itself (a reference cycle back to "
                "one of the dicts or lists that lead to it); keep one reference to it, or "
                "break the cycle in your state_dict()."
            )
        self._open.add(id(obj))

    def encode(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, PerRank):
            if self._in_rank:
                raise UnsupportedStateError(f"{path_str(path)}: PerRank cannot be nested")
            rid = self.part_id(path)
            if not self.split_per_rank:
                return self.encode(obj.obj, path)
            self._in_rank = True
            try:
                self.per_rank[rid] = self.encode(obj.obj, path)
            finally:
                self._in_rank = False
            return {TAG: "per_rank", "id": rid}
        if isinstance(obj, FilePart):  # it writes its own files (see filepart.py)
            return {TAG: "filepart", "id": self.part_id(path)}
        if isinstance(obj, torch.Tensor):
            return self.tensor_ref(obj, path)
        if isinstance(obj, np.generic):  # before float: np.float64 subclasses float
            refuse_numpy(obj, KeyPath(path))
            return {TAG: "np", "dtype": obj.dtype.str, "value": self.encode(obj.item(), path)}
        if isinstance(obj, bool) or obj is None or isinstance(obj, str):
            return obj
        if isinstance(obj, int):
            refuse_int(obj, KeyPath(path))
            return int(obj)
        if isinstance(obj, float):
            if math.isfinite(obj):
                return float(obj)
            return {TAG: "float", "value": repr(obj)}
        if isinstance(obj, Mapping):
            self._enter(obj, path)
            if all(isinstance(k, str) for k in obj) and TAG not in obj:
                out: Any = {k: self.encode(v, (*path, k)) for k, v in obj.items()}
            else:
                out = {
                    TAG: "dict",
                    "items": [
                        [self.encode(k, (*path, "<key>")), self.encode(v, (*path, k))]
                        for k, v in obj.items()
                    ],
                }
            self._open.discard(id(obj))
            return out
        if isinstance(obj, torch.Size):
            return {TAG: "size", "items": [int(x) for x in obj]}
        if isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
            self._enter(obj, path)
            items = [self.encode(v, (*path, i)) for i, v in enumerate(obj)]
            self._open.discard(id(obj))
            return items if isinstance(obj, list) else {TAG: "tuple", "items": items}
        if isinstance(obj, (set, frozenset)):
            items = [self.encode(v, (*path, "<item>")) for v in obj]
            return {TAG: "frozenset" if isinstance(obj, frozenset) else "set", "items": items}
        if isinstance(obj, torch.dtype):
            return {TAG: "dtype", "name": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {TAG: "device", "name": str(obj)}
        if isinstance(obj, (bytes, bytearray)):
            return {TAG: "bytes", "b64": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, np.ndarray):  # bool, int, float up to float64 (what safetensors takes)
            refuse_numpy(obj, KeyPath(path))
            arr = obj if obj.flags.c_contiguous and obj.flags.writeable else obj.copy(order="C")
            ref = self.tensor_ref(torch.from_numpy(arr), path)  # 0-dim arrays stay 0-dim
            ref["numpy"] = True
            return ref
        if is_stateful(obj):
            refuse_stateful(obj, KeyPath(path))
            live, obj = obj, plain_module(obj)
            sd = obj.state_dict()
            # an optimizer wrapper (accelerate's) is recorded as the optimizer it steps
            kind = hookable(obj) if isinstance(obj, torch.optim.Optimizer) else obj
            kind = live if isinstance(live, torch.Generator) else kind
            node = {TAG: "stateful", "type": _qualname(kind), "state": self.encode(sd, path)}
            if isinstance(obj, torch.optim.Optimizer) and (shapes := param_shapes(obj)):
                node["param_shapes"] = shapes  # what its state belongs to (fit.py checks it)
            if versions := module_versions.recorded(sd):
                node[module_versions.FIELD] = versions  # what its loader reads it by
            return node
        raise UnsupportedStateError(
            f"{path_str(path)} has type {_qualname(obj)}, which cannot be saved without pickle. "
            + fix_for(obj)
        )


def part_id(path: tuple[Any, ...]) -> str:
    """The id of the FilePart or PerRank at ``path`` in a state: a FilePart's folder under
    ``parts/``, a PerRank's key in each rank's structure."""
    return "/".join(str(p) for p in path) or "root"


def _qualname(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def encode(state: Any, *, split_per_rank: bool = True) -> tuple[Encoded, Encoded]:
    """Encode ``state``. Returns ``(shared, rank_local)``: the replicated structure with its
    tensors, and the ``PerRank`` parts with theirs."""
    enc = _Encoder(split_per_rank)
    try:
        structure = enc.encode(state, ())
    except RecursionError:
        raise UnsupportedStateError(
            f"the state is nested deeper than Python's recursion limit "
            f"({sys.getrecursionlimit()}) lets it be saved and read back; flatten the deeply "
            "nested dicts/lists (e.g. a linked list as one list)."
        ) from None
    shared = Encoded(structure, enc.tensors)
    local = Encoded(None, enc.rank_tensors, enc.per_rank)
    return shared, local


# --------------------------------------------------------------------------- decoding


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


def _has_live_objects(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, PerRank, FilePart)) or is_stateful(obj):
        return True
    if isinstance(obj, Mapping):
        return any(_has_live_objects(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_live_objects(v) for v in obj)
    return False


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


def _short(keys: list[Any], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
