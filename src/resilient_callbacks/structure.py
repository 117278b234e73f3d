"""Turning a training state into JSON + named tensors, and back, without pickle.

``encode`` walks a nested state (dicts, lists, tuples, objects with ``state_dict()``, tensors,
JSON-able values) and returns a JSON-able *structure* in which every tensor is replaced by a
reference to an entry of a flat ``{name: tensor}`` table. Tensors that are the same view of the
same storage (tied weights, aliases) are stored once and restored as one object.

:func:`.structure_decode.decode` rebuilds Python values from a structure and a table of loaded
tensors; :func:`.inplace.apply` loads them *in place* into the live objects of a state, after
:func:`.fit.check_fits` has listed every key or shape that does not fit. The marks a state may
hold (``PerRank``, ``OptionalKeys``) are :mod:`.state_marks`'s.

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

from . import module_versions
from .errors import UnsupportedStateError
from .filepart import FilePart
from .layout_meta import TAG
from .optim import hookable, param_shapes
from .refusals import fix_for, refuse_int, refuse_numpy, refuse_stateful, refuse_tensor
from .state_marks import PerRank
from .wrapped import plain_module

_JSON_SCALARS = (bool, int, str, type(None))


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


def _has_live_objects(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, PerRank, FilePart)) or is_stateful(obj):
        return True
    if isinstance(obj, Mapping):
        return any(_has_live_objects(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_live_objects(v) for v in obj)
    return False
