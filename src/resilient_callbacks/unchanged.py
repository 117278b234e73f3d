"""Which replicated tensors cannot have changed since the last committed save of this process,
so that an incremental save neither copies nor hashes them.

A tensor qualifies only when all of these hold:

- it is a frozen parameter (``requires_grad=False``) of a module in the state, and no optimizer
  holds it. Nothing else is trusted: parameters and optimizer state change at every step by
  design, and some kernels write in place without bumping the version counter below (a
  fused optimizer's step; BatchNorm's update of its running statistics), so buffers and plain
  tensors (a ``state_dict()`` put in the state) are hashed at every save;
- it is the same storage at the same place (data pointer, offset, shape, strides, dtype,
  device) as at the last committed save, and its autograd version counter, which every
  in-place operation bumps (``copy_``, ``add_``, an optimizer step, ``load_state_dict``), has
  not moved since that save snapshotted it;
- that save stored its bytes as a blob (its content key is known).

The tracker keeps a reference to each tensor it records, so its storage cannot be freed and
its address handed to another tensor (which would start with a fresh version counter). The
record lives in this process only: a new process hashes everything once.

What the version counter cannot see: writes through ``tensor.data`` (a separate counter) or
through another library's view of the memory (NumPy, DLPack, a kernel writing a raw pointer).
So each save also compares :data:`SAMPLE` elements spread over every tensor it would skip with
the same elements at the last save: a write to a whole tensor (an EMA copy updated through
``.data``) changes them and is caught; a write to a few elements (one embedding row) can
escape. A tracker that catches one warns once and from then on hints nothing (every tensor is
hashed, as with ``incremental="hash"``, which a run that writes frozen tensors that way passes
from the start: every tensor is then hashed at every save, still written only when its bytes
changed).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import statetree
from .blobs import BLOB_MIN, BlobSession, BlobStore
from .errors import caller_stacklevel
from .notices import on_this_rank

#: elements of a tensor compared at every save (one in every ``numel // SAMPLE``, and the last)
SAMPLE = 256


@dataclass(frozen=True)
class _Seen:
    tensor: torch.Tensor  # held: keeps the storage (and so its address) alive
    where: tuple[Any, ...]
    version: int
    key: str


def _where(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
    )


def _picks(t: torch.Tensor) -> torch.Tensor:
    """About :data:`SAMPLE` elements spread over ``t`` (and its last), as bytes on its device:
    compared at the next save to catch writes the version counter misses."""
    n = t.numel()
    step = max(1, n // SAMPLE) | 1  # odd: the picks move across a row's columns
    if t.is_contiguous():
        flat = t.view(-1)
        picked = torch.cat([flat[::step], flat[-1:]])
    else:  # (a transposed weight) the same elements, gathered by index
        # indices made on t's device (a CPU index copied to a GPU, or unravel_index's shape
        # tensors, would be host-to-device copies that each wait for the queued kernels), and
        # taken as integers of the element's size (``take`` has no float8 or uint16 kernel)
        idx = torch.arange(0, n, step, device=t.device)
        idx = torch.cat([idx, idx.new_full((1,), n - 1)])
        as_int = _SAME_SIZE_INT.get(t.element_size())
        picked = torch.take(t.view(as_int) if as_int is not None else t, idx)
    return picked.view(torch.uint8)


#: an integer dtype of each element size, to gather any dtype's elements as bits
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _written_unseen(seen: tuple[tuple[Any, ...], int], now: tuple[tuple[Any, ...], int]) -> bool:
    """Same place and version counter, but the sampled elements differ: written through
    ``.data``, NumPy or a kernel that does not move the counter."""
    (was, version), (where, now_version) = seen, now
    return version == now_version and was[:-1] == where[:-1] and was[-1] != where[-1]


def _warn_written_unseen(names: list[str], own: bool = False) -> None:
    """``own``: the tensors are this rank's own (a FilePart's shard, each rank's tracker):
    said by this rank, naming it; else the replicated state's (the coordinator's tracker)."""
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    msg = (
        f"incremental=True: frozen tensor(s) {shown} changed since the last save without "
        "their version counter moving (written through `.data`, NumPy, DLPack or a custom "
        "kernel), which is how incremental=True knows a tensor unchanged. The change was "
        f"found by comparing {SAMPLE} sampled elements of each tensor and this save stores "
        "it; a write to only a few elements can escape that sample. From now on this "
        "Checkpointer hashes every tensor at every save: pass incremental='hash' to do so "
        "from the start"
    )
    warnings.warn(on_this_rank(msg) if own else msg, UserWarning, stacklevel=caller_stacklevel())


def frozen_storages(state: Any) -> set[int]:
    """Data pointers of the storages of the frozen parameters (``requires_grad=False``) of the
    state's modules that no optimizer holds: the only tensors a save may know unchanged."""
    frozen: set[int] = set()
    for _, obj in statetree.leaves(state):
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                if not p.requires_grad:
                    frozen.add(getattr(p, "_local_tensor", p).untyped_storage().data_ptr())
    return frozen - optimizer_storages(statetree.optimizers(state))


def optimizer_storages(optimizers: Any) -> set[int]:
    """Storage addresses of what ``optimizers`` change (their parameters and state), taking a
    DTensor's local shard."""
    ptrs: set[int] = set()

    def add(t: torch.Tensor) -> None:
        ptrs.add(getattr(t, "_local_tensor", t).untyped_storage().data_ptr())

    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                add(p)
        for st in opt.state.values():
            for v in st.values() if isinstance(st, Mapping) else ():
                if isinstance(v, torch.Tensor):
                    add(v)
    return ptrs


Watched = tuple[torch.Tensor, tuple[Any, ...], int]


def watch_all(tensors: Mapping[str, torch.Tensor], trusted: set[int] | None) -> dict[str, Watched]:
    """``{name: (t, where, version)}`` of the ``tensors`` an incremental save may come to know
    unchanged: blob-sized, dense tensors with a version counter in a ``trusted`` storage (None:
    the caller vouches for them). ``where`` ends with a sample of the tensor's bytes
    (:func:`_picks`), taken now, with the version; the samples of one device come to the host
    in one copy."""
    found: dict[str, Watched] = {}
    picks: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if t.numel() * t.element_size() < BLOB_MIN or t.is_sparse:
            continue
        try:
            version = t._version
            where = _where(t)
            if trusted is not None and where[0] not in trusted:
                continue
            picked = _picks(t)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue  # inference tensors have no counter; a DTensor, no storage of its own
        found[name] = (t, where, version)
        picks.setdefault(t.device, []).append((name, picked))
    out: dict[str, Watched] = {}
    for items in picks.values():
        try:
            host = torch.cat([p for _, p in items]).cpu().numpy()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # a device whose bytes cannot be read: never known unchanged
        at = 0
        for name, p in items:
            t, where, version = found[name]
            out[name] = (t, (*where, host[at : at + p.numel()].tobytes()), version)
            at += p.numel()
    return out


class UnchangedTracker:
    """Per Checkpointer (coordinator): the frozen tensors of the last committed save."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}
        self.distrusts = False  # a write the version counter missed was seen: hint nothing

    def observe(
        self, tensors: Mapping[str, torch.Tensor], state: Any
    ) -> tuple[dict[str, str], dict[str, tuple[torch.Tensor, tuple[Any, ...], int]]]:
        """Training thread, at a save: ``(hints, watch)``. ``hints``: tensor name -> content key
        of the tensors that cannot have changed since the last committed save; ``watch``: the
        frozen tensors of this save as they are now, to :meth:`record` once it committed."""
        if self.distrusts:
            return {}, {}
        trusted = frozen_storages(state)
        hints: dict[str, str] = {}
        watch: dict[str, tuple[torch.Tensor, tuple[Any, ...], int]] = {}
        unseen: list[str] = []
        for name, w in watch_all(tensors, trusted).items():
            watch[name] = w
            _, where, version = w
            seen = self._seen.get(name)
            if seen is not None and seen.where == where and seen.version == version:
                hints[name] = seen.key
            elif seen is not None and _written_unseen((seen.where, seen.version), w[1:]):
                unseen.append(name)
        if unseen:
            _warn_written_unseen(unseen)
            self.distrusts, self._seen = True, {}
            return {}, {}
        return hints, watch

    def record(
        self,
        watch: Mapping[str, tuple[torch.Tensor, tuple[Any, ...], int]],
        keys: Mapping[str, str],
    ) -> None:
        """A save committed: remember the content keys of its frozen tensors."""
        self._seen = {
            name: _Seen(t, where, version, keys[name])
            for name, (t, where, version) in watch.items()
            if name in keys
        }

    def forget(self) -> None:
        self._seen = {}


def begin_incremental(
    store: BlobStore,
    tracker: UnchangedTracker | None,
    tensors: Mapping[str, torch.Tensor],
    state: Any,
) -> tuple[BlobSession, dict[str, tuple[torch.Tensor, tuple[Any, ...], int]] | None]:
    """Coordinator, training thread, at an incremental save: the save's use of the blob store,
    with the tensors known unchanged (pinned, so they stay stored, and checked present), and
    what the tracker must record once the save committed (None with ``incremental="hash"``)."""
    session = BlobSession(store)
    if tracker is None:
        return session, None
    hints, watch = tracker.observe(tensors, state)
    store.pin(hints.values())
    session._pinned.extend(hints.values())
    session.hints = {k: v for k, v in hints.items() if store.lookup(v) is not None}
    return session, watch


# ----------------------------------------------------------------------------- FileParts


@dataclass(frozen=True)
class _Kept:
    tensor: torch.Tensor  # the live tensor, held (see the module docstring)
    where: tuple[Any, ...]
    version: int
    buffer: torch.Tensor  # the host buffer its bytes were copied into at that save
    key: str


Sig = tuple[int, torch.dtype, tuple[int, ...]]


def buffer_sig(t: torch.Tensor) -> Sig:
    """A host copy's identity within one save: its address, dtype and shape."""
    return t.data_ptr(), t.dtype, tuple(t.shape)


class PartTracker:
    """Per FilePart, every rank (``incremental=True``): which tensors the part passes to
    ``CaptureBuffers.copy`` cannot have changed since the last committed save *and* still have
    their bytes in the same host buffer, so that the save neither copies nor hashes them.

    A tensor qualifies only when the part vouches for it (``copy(frozen=True)``: a frozen
    parameter), its place and version counter are those of that save, and the host buffer of
    its name is the very one its bytes were copied into at that save (a buffer freed and made
    again holds nothing)."""

    def __init__(self) -> None:
        self._seen: dict[str, _Kept] = {}
        self.distrusts = False  # a write the version counter missed was seen: hint nothing

    def unchanged(
        self,
        name: str,
        watched: tuple[torch.Tensor, tuple[Any, ...], int],
        buffer: torch.Tensor | None,
    ) -> str | None:
        """The content key of ``name`` (``watched``: its entry in :func:`watch_all`'s answer now) if it is
        unchanged and ``buffer`` still holds it."""
        seen = self._seen.get(name)
        if seen is None or self.distrusts:
            return None
        _, where, version = watched
        if _written_unseen((seen.where, seen.version), (where, version)):
            _warn_written_unseen([name], own=True)
            self.distrusts, self._seen = True, {}
            return None
        if buffer is None or buffer is not seen.buffer:
            return None
        return seen.key if (seen.where, seen.version) == (where, version) else None

    def record(
        self,
        watched: Mapping[str, tuple[torch.Tensor, tuple[Any, ...], int, torch.Tensor]],
        keys: Mapping[Sig, str],
    ) -> None:
        """A save committed: remember its watched tensors that it stored as blobs (``keys``:
        :func:`buffer_sig` of a host copy -> its content key)."""
        self._seen = {}
        if self.distrusts:
            return
        for name, (t, where, version, buf) in watched.items():
            key = keys.get(buffer_sig(buf))
            if key is not None:
                self._seen[name] = _Kept(t, where, version, buf, key)
