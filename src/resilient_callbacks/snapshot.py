"""The snapshot: a consistent copy of the state's tensors in host buffers reused across saves.

The training thread blocks only while tensors are copied into host memory; writing, checksums
and commit then run in the background on the copies, while training changes the originals.
Buffers are allocated once per tensor (by name, shape and dtype) and reused by every later
save, so memory does not grow from save to save.

Tensors on a GPU are copied into pinned buffers by non-blocking copies on a side stream (one per
device), so the CPU does not wait for the copy engine. The cut is consistent all the same:

- the side stream first waits for the current stream, so the copies read what every kernel
  launched before the save has written;
- the current stream then waits (on the GPU, not the CPU) for an event recorded after the
  copies, so every kernel launched after ``save`` returns -- the optimizer step, ``zero_()``, an
  in-place ``add_``, ``load_state_dict`` -- runs after the copies have read the saved tensors;
- each saved tensor is marked used by the side stream (``record_stream``), so a tensor freed
  right after the save is not handed to a new allocation until the copy has read it;
- the background writer waits for the copies on the host (:meth:`Snapshot.wait_host`) before it
  reads a buffer: a blocking-sync event (the thread sleeps, it does not spin a core while the
  copy runs), waited for with the copy's device current (a thread starts on device 0, and a
  CUDA call there would create a context on GPU 0 for every rank of the node).

Work that writes a saved tensor on *another* stream must be ordered after the current stream
(``other.wait_stream(torch.cuda.current_stream())`` after the save), as CUDA requires of any
cross-stream use; collectives launched after the save (DDP's buffer broadcast, FSDP) do that.

Overlapped mode: the parameters an optimizer in the state steps, and its state, change only at
that step, so their copy may run in the background while the next forward/backward runs (a
parameter no optimizer there steps, such as an EMA copy, is not deferred, nor one a SAM-style
two-pass optimizer writes in its ``first_step()``); the training loop waits
only right before the next optimizer step (``Checkpointer.wait_for_snapshot()``, which the
optimizers in the state call from a step pre-hook). On a GPU that wait is again a GPU-side wait:
the optimizer's kernels are ordered after the copy and the CPU does not block. Everything else
(buffers such as BatchNorm statistics, which forward passes change, RNG states, small values) is
copied, or ordered before every later kernel, before ``save`` returns. On the CPU the deferred
copies run in a helper thread that the optimizer step joins.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from . import statetree
from .optim import two_pass_base
from .pinned import pinned_group


def _make(specs: list[tuple[str, torch.Size, torch.dtype, bool]]) -> dict[str, torch.Tensor]:
    """A host buffer per ``(name, shape, dtype, of a CUDA tensor)``: pinned (packed into slabs)
    for CUDA tensors where CUDA is available, else ordinary memory with every page touched."""
    cuda = torch.cuda.is_available()
    pinned = [(name, shape, dtype) for name, shape, dtype, on_gpu in specs if on_gpu and cuda]
    made = dict(
        zip(
            [name for name, _, _ in pinned],
            pinned_group([(shape, dtype) for _, shape, dtype in pinned]),
            strict=True,
        )
    )
    for name, shape, dtype, _ in specs:
        if name not in made:
            b = torch.empty(shape, dtype=dtype)
            if b.numel():  # one byte per page: the kernel maps each page now, not in the copy
                b.reshape(-1).view(torch.uint8).numpy()[::4096] = 0
            made[name] = b
    return made


class HostBuffers:
    """Host copies of tensors, allocated once per name and reused while shape/dtype match.

    The first save would otherwise pay for allocating (and faulting in) a host copy of the whole
    state on the training thread: seconds for a few GB. :meth:`allocate_in_background` does it in
    a helper thread from the tensors' shapes, before the first save is due; :meth:`get` waits
    for that thread, so a save never sees a half-made set.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._filler: threading.Thread | None = None
        self._filler_error: BaseException | None = None

    def allocate_in_background(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Start allocating a buffer for each tensor (no-op if buffers exist or are coming)."""
        if self._bufs or self._filler is not None or not tensors:
            return
        specs = [(name, t.shape, t.dtype, t.device.type == "cuda") for name, t in tensors.items()]
        self._filler = threading.Thread(
            target=self._allocate, args=(specs,), name="rc-host-buffers", daemon=True
        )
        self._filler.start()

    def _allocate(self, specs: list[tuple[str, torch.Size, torch.dtype, bool]]) -> None:
        made: dict[str, torch.Tensor] = {}
        try:
            made = _make(specs)
        except BaseException as e:  # e.g. out of memory: the save allocates (and reports) itself
            self._filler_error = e
        self._bufs = made

    def ensure(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Allocate, together, the buffers ``tensors`` lack (new names, or another shape or
        dtype): pinned ones packed into few allocations (:mod:`.pinned`; such an allocation is
        freed once none of its buffers is kept). Returns the buffer of each of ``tensors``
        (checked here once: a snapshot of many tensors need not :meth:`get` each again)."""
        self.wait_allocated()
        specs = [
            (name, t.shape, t.dtype, t.device.type == "cuda")
            for name, t in tensors.items()
            if (b := self._bufs.get(name)) is None or b.shape != t.shape or b.dtype != t.dtype
        ]
        if specs:
            self._bufs.update(_make(specs))
        return {name: self._bufs[name] for name in tensors}

    def wait_allocated(self) -> None:
        """Wait for a background allocation to finish (a failed one is dropped, not raised)."""
        filler = self._filler
        if filler is not None:
            filler.join()
            self._filler = None

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        self.wait_allocated()
        b = self._bufs.get(name)
        if b is None or b.shape != like.shape or b.dtype != like.dtype:
            pin = like.device.type == "cuda" and torch.cuda.is_available()
            b = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
            self._bufs[name] = b
        return b

    def existing(self, name: str) -> torch.Tensor | None:
        """The buffer of ``name`` as it is (None if there is none), without allocating."""
        self.wait_allocated()
        return self._bufs.get(name)

    def keep_only(self, names: Iterable[str]) -> None:
        """Free buffers of tensors that are no longer in the state."""
        self.wait_allocated()
        wanted = set(names)
        for k in [k for k in self._bufs if k not in wanted]:
            del self._bufs[k]

    @property
    def nbytes(self) -> int:
        self.wait_allocated()
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def step_storages(
    modules: Iterable[torch.nn.Module],
    optimizers: Iterable[torch.optim.Optimizer],
    local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    others: Iterable[Any] = (),
) -> set[int]:
    """Storage addresses of tensors that only an optimizer step changes: the parameters of
    ``modules`` that one of ``optimizers`` steps (in a param group, requiring grad), and the
    optimizers' state tensors. Not a parameter no optimizer here steps (an EMA or teacher
    model, frozen or in no group: its owner may write it in place
    before the next step, which alone waits for deferred copies), nor buffers, which forward
    passes change, nor 0-d values such as ``step``, copied at once. ``local`` maps a tensor to
    the one whose storage is copied (a DTensor to its local shard). Nor the parameters and
    state of a two-pass wrapper (:func:`.optim.two_pass_base`, among ``optimizers`` and
    ``others``, the state's other objects): its ``first_step()`` writes them in place outside
    any ``step()``, right after the save."""
    optimizers = list(optimizers)
    stepped: set[int] = set()
    out: set[int] = set()
    written_outside: set[int] = set()
    for w in [*optimizers, *others]:
        base = two_pass_base(w)
        if base is not None:
            for group in base.param_groups:
                written_outside.update(
                    local(p).untyped_storage().data_ptr() for p in group["params"]
                )
    for o in optimizers:
        if two_pass_base(o) is not None:
            continue  # (its own state too: first_step() may write it in place)
        for group in o.param_groups:
            for p in group["params"]:
                if p.requires_grad:  # a frozen one (an EMA in AdamW(self.parameters())) is not
                    stepped.add(local(p).untyped_storage().data_ptr())
        for s in o.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out.add(local(v).untyped_storage().data_ptr())
    stepped -= written_outside
    for m in modules:
        for p in m.parameters():
            ptr = local(p).untyped_storage().data_ptr()
            if ptr in stepped:
                out.add(ptr)
    return out


def optimizer_step_storages(state: Any) -> set[int]:
    """:func:`step_storages` of the modules and optimizers in ``state``."""
    objs = [obj for _, obj in statetree.leaves(state)]
    return step_storages(
        (o for o in objs if isinstance(o, torch.nn.Module)),
        (o for o in objs if isinstance(o, torch.optim.Optimizer)),
        others=(o for o in objs if not isinstance(o, torch.optim.Optimizer)),
    )


_SIDE_STREAMS: dict[tuple[int, bool], Any] = {}


def _side_stream(device: torch.device, deferred: bool = False) -> Any:
    """Two copy streams per CUDA device, reused by every save (streams are never freed): one
    for the copies the training stream waits for at once, one for the deferred (overlapped)
    copies. On one stream, a second snapshot's immediate copies (a save makes one per FilePart
    and one for the rest) would queue behind the first's deferred ones, and the training
    stream, waiting for them, would wait for the deferred copies too."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get((index, deferred))
    if stream is None:
        stream = _SIDE_STREAMS[(index, deferred)] = torch.cuda.Stream(device=index)
    return stream


def _mark_used_by(t: torch.Tensor, stream: Any) -> None:
    """Keep ``t``'s memory from reuse until ``stream``'s queued work is done."""
    # memory not from the caching allocator (RuntimeError) is not recycled by it either
    with contextlib.suppress(RuntimeError):
        t.record_stream(stream)


def _order_after(stream: Any, event: Any) -> None:
    """Make work queued on ``stream`` from now on wait (on the GPU) for ``event``."""
    stream.wait_event(event)


class Snapshot:
    """Copies of a set of tensors, taken now (``overlap_storages=None``) or partly in the
    background (tensors whose storage is in ``overlap_storages``).

    Thread contract: the training thread constructs it and calls :meth:`wait_device` (the
    ordering the next optimizer step needs); the background writer calls :meth:`wait_host`
    before it reads :attr:`copies`. Both may be called any number of times, from either thread.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        buffers: HostBuffers,
        *,
        overlap_storages: set[int] | None = None,
    ) -> None:
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # (device, event): the host waits for these before reading copies
        self._host_events: list[tuple[torch.device, Any]] = []
        self._device_waits: list[tuple[torch.device, Any]] = []  # deferred GPU copies
        cpu_later: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        gpu: dict[torch.device, tuple[list[Any], list[Any]]] = {}  # device -> (now, later)
        # what is missing, allocated together
        self.copies: dict[str, torch.Tensor] = buffers.ensure(tensors)
        with torch.no_grad():  # (copy_ of a tensor that requires grad records no graph)
            for name, t in tensors.items():
                buf = self.copies[name]
                deferred = (
                    overlap_storages is not None
                    and t.numel() > 0
                    and t.untyped_storage().data_ptr() in overlap_storages
                )
                if t.device.type == "cuda":
                    now, later = gpu.setdefault(t.device, ([], []))
                    (later if deferred else now).append((t, buf))
                elif deferred:
                    cpu_later.append((name, t, buf))
                else:
                    buf.copy_(t)
        for device, (now, later) in gpu.items():
            self._copy_on_side_stream(device, now, later)
        if cpu_later:
            self._thread = threading.Thread(
                target=self._copy_later, args=(cpu_later, None), name="rc-snapshot", daemon=True
            )
            self._thread.start()

    def _copy_on_side_stream(
        self,
        device: torch.device,
        now: list[tuple[torch.Tensor, torch.Tensor]],
        later: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Enqueue one device's copies; order the current stream after the ``now`` ones."""
        with torch.cuda.device(device):
            main = torch.cuda.current_stream(device)
            for deferred, items in ((False, now), (True, later)):
                if not items:
                    continue
                side = _side_stream(device, deferred)
                # copy what every kernel launched so far has written (the deferred copies also
                # start after the immediate ones, which the training stream now waits for)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    for t, buf in items:
                        buf.copy_(t.detach(), non_blocking=True)
                        _mark_used_by(t, side)
                    done = torch.cuda.Event(blocking=True)
                    done.record(side)
                self._host_events.append((device, done))
                if deferred:
                    self._device_waits.append((device, done))
                else:
                    _order_after(main, done)  # later kernels on the training stream run after

    def _copy_later(self, items: list[tuple[str, torch.Tensor, torch.Tensor]], stream: Any) -> None:
        """The deferred copies of CPU tensors (helper thread)."""
        try:
            for _, t, buf in items:
                buf.copy_(t.detach())
        except BaseException as e:  # raised by wait_host()
            self._error = e

    def _join(self, raising: bool = True) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()
        if raising and self._error is not None:
            raise self._error

    def wait_device(self) -> None:
        """Order what comes next after the deferred copies: the training stream of each GPU waits
        for them on the GPU (the CPU does not block); deferred CPU copies are joined. A copy
        that failed is not raised here (in an optimizer's step hook): :meth:`wait_host` raises
        it in the background save, which fails as any background save does."""
        for device, event in self._device_waits:
            _order_after(torch.cuda.current_stream(device), event)
        self._join(raising=False)

    def wait_host(self) -> None:
        """Block until every copy is complete in host memory (and raise if one failed)."""
        self._join()
        for device, event in self._host_events:
            with torch.cuda.device(device):
                event.synchronize()

    def wait(self) -> None:
        """Both waits: the copies are complete and later GPU work is ordered after them."""
        self.wait_device()
        self.wait_host()
