"""This rank's piece of a sharded tensor in a state dict, whichever kind holds it:

- a ``DTensor``: FSDP2 (``fully_shard``), tensor parallelism, and FSDP1 given a ``device_mesh``;
- a ``ShardedTensor``: FSDP1 without a device mesh (as Lightning's ``FSDPStrategy`` and
  accelerate set it up), whose sharded state dict chunks every tensor along its first dimension;
  a rank may hold no piece of a small tensor.

:class:`~resilient_callbacks.dcp.sharded.Sharded` saves each piece with its box of the global
tensor (:class:`~.chunks.Box`) and at restore rebuilds the same kind of tensor around the
assembled local piece. Everything here is local to the rank: no collectives.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeGuard, TypeVar, cast

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from ..errors import UnsupportedStateError
from .chunks import Box

F = TypeVar("F", bound=Callable[..., Any])


def quiet(fn: F) -> F:
    """``fn`` without torch's "Please use DTensor instead and we are deprecating ShardedTensor"
    warning, which every read of a ShardedTensor's shape or dtype gives (FSDP1's own state dict
    code included): a user of FSDP1 did not choose ShardedTensors, and cannot act on it. For
    methods that run on the training thread (``catch_warnings`` is process-wide)."""

    @functools.wraps(fn)
    def quieter(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*deprecating ShardedTensor", category=FutureWarning
            )
            return fn(*args, **kwargs)

    return cast(F, quieter)


def is_sharded(t: Any) -> TypeGuard[DTensor | ShardedTensor]:
    return isinstance(t, (DTensor, ShardedTensor))


def _piece(name: str, t: ShardedTensor) -> Any:
    """The one local shard of ``t`` (``None`` when this rank holds none)."""
    shards = t.local_shards()
    if len(shards) > 1:
        raise UnsupportedStateError(
            f"{name}: a ShardedTensor with {len(shards)} local shards on one rank is not "
            "supported (FSDP1's chunking gives each rank at most one)"
        )
    return shards[0] if shards else None


def box_of(name: str, t: DTensor | ShardedTensor) -> Box:
    """The box of the global tensor that this rank's piece of ``t`` holds (empty when none)."""
    if isinstance(t, ShardedTensor):
        piece = _piece(name, t)
        if piece is None:
            return Box.of([0] * t.dim(), [0] * t.dim())
        return Box.of(piece.metadata.shard_offsets, piece.metadata.shard_sizes)
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise UnsupportedStateError(
            f"{name}: a DTensor whose local shard is {len(chunks)} pieces of the global tensor "
            "is not supported (one piece per rank is: Shard and Replicate placements)"
        )
    return Box.of(chunks[0].offsets, chunks[0].sizes)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local piece of a DTensor or ShardedTensor (``t`` itself otherwise; an empty tensor
    for a ShardedTensor this rank holds no piece of). Reads a DTensor's local tensor directly:
    ``to_local()`` is an autograd function, about 35 us a call, paid for every tensor twice at
    every save (a quarter of what a save blocks for at 120 tensors)."""
    if isinstance(t, ShardedTensor):
        piece = _piece("tensor", t)
        return piece.tensor if piece is not None else torch.empty(0, dtype=t.dtype)
    if not isinstance(t, DTensor):
        return t
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t.to_local()


def layout(t: DTensor | ShardedTensor) -> dict[str, Any]:
    """What the manifest records of how the state is sharded (for people; restore reads the
    boxes, not this)."""
    if isinstance(t, ShardedTensor):
        shards = t.metadata().shards_metadata
        return {"shape": [len(shards)], "dim_names": [], "placements": ["ShardedTensor"]}
    return {
        "shape": list(t.device_mesh.shape),
        "dim_names": list(t.device_mesh.mesh_dim_names or ()),
        "placements": [str(p) for p in t.placements],
    }


def rebuild(target: DTensor | ShardedTensor, piece: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``target``'s kind and layout whose piece on this rank is ``piece``, on
    ``piece``'s device (a host copy of a GPU tensor stays on the host); ``target`` is left as
    it is."""
    if isinstance(target, ShardedTensor):
        return _sharded_tensor(target, piece)
    return DTensor.from_local(
        piece,
        target.device_mesh,
        target.placements,
        run_check=False,
        shape=target.shape,
        stride=target.stride(),
    )


def _sharded_tensor(target: ShardedTensor, piece: torch.Tensor) -> ShardedTensor:
    """As ``ShardedTensor.cpu()`` builds its copy: when this rank's piece moved to another
    device (a host copy), every placement names that device."""
    from torch.distributed._shard.sharded_tensor import Shard

    meta = target.metadata()
    mine = _piece("tensor", target)
    pieces = []
    if mine is not None:
        shard_meta = mine.metadata
        if mine.tensor.device != piece.device:
            shard_meta = _placed(shard_meta, piece.device)
            meta = copy.deepcopy(meta)
            meta.shards_metadata = [_placed(m, piece.device) for m in meta.shards_metadata]
        pieces.append(Shard(piece, shard_meta))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        pieces,
        sharded_tensor_metadata=meta,
        process_group=target._process_group,
        init_rrefs=target._init_rrefs,
    )


def _placed(meta: Any, device: torch.device) -> Any:
    """A copy of a ``ShardMetadata`` whose placement names ``device``."""
    meta = copy.deepcopy(meta)
    if meta.placement is not None:
        meta.placement._device = device
    return meta


class BoxCache:
    """This rank's box of a sharded tensor, a DTensor's cached by layout (computing it costs
    more than the rest of ``Sharded.describe()`` together: DTensor's ``__create_chunk_list__``
    recomputes the shard sizes; a ShardedTensor carries its box)."""

    def __init__(self) -> None:
        self._boxes: dict[tuple[Any, ...], Box] = {}  # DTensor layout -> this rank's box

    def __call__(self, name: str, t: DTensor | ShardedTensor) -> Box:
        if not isinstance(t, DTensor):
            return box_of(name, t)
        mesh = t.device_mesh
        coordinate = mesh.get_coordinate()
        key: tuple[Any, ...] = (
            tuple(t.shape),
            tuple(t.placements),
            id(mesh),
            tuple(mesh.shape),
            tuple(coordinate) if coordinate is not None else None,
        )
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = box_of(name, t)
        return box
