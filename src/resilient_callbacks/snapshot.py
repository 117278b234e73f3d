"""The snapshot: a consistent copy of the state's tensors in host buffers reused across saves.

The training thread blocks only while tensors are copied into host memory; writing, checksums
and commit then run in the background on the copies, while training changes the originals.
Buffers are allocated once per tensor (by name, shape and dtype) and reused by every later
save, so memory does not grow from save to save. Tensors on a GPU are copied into pinned
buffers with non-blocking copies on a side stream; :meth:`Snapshot.wait` synchronizes before
anything reads them.

Overlapped mode: parameters and optimizer state change only at the optimizer step, so their
copy may run in the background while the next forward/backward runs; the training loop waits
only right before the next optimizer step (``Checkpointer.wait_for_snapshot()``). Everything
else (buffers such as BatchNorm statistics, which forward passes change, RNG states, small
values) is copied before ``save`` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .structure import PerRank, is_stateful


class HostBuffers:
    """Host copies of tensors, allocated once per name and reused while shape/dtype match."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        b = self._bufs.get(name)
        if b is None or b.shape != like.shape or b.dtype != like.dtype:
            pin = like.device.type == "cuda" and torch.cuda.is_available()
            b = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
            self._bufs[name] = b
        return b

    def keep_only(self, names: Iterable[str]) -> None:
        """Free buffers of tensors that are no longer in the state."""
        wanted = set(names)
        for k in [k for k in self._bufs if k not in wanted]:
            del self._bufs[k]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def optimizer_step_storages(state: Any) -> set[int]:
    """Storage addresses of tensors that only an optimizer step changes: the parameters of the
    modules in ``state`` and the state tensors of its optimizers."""
    out: set[int] = set()

    def rec(obj: Any) -> None:
        if isinstance(obj, PerRank):
            rec(obj.obj)
        elif isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                out.add(p.untyped_storage().data_ptr())
        elif isinstance(obj, torch.optim.Optimizer):
            for s in obj.state.values():
                for v in s.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        out.add(v.untyped_storage().data_ptr())
        elif isinstance(obj, Mapping):
            for v in obj.values():
                rec(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                rec(v)
        elif is_stateful(obj):
            return

    rec(state)
    return out


class Snapshot:
    """Copies of a set of tensors, taken now (``overlap=False``) or partly in the background."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        buffers: HostBuffers,
        *,
        overlap_storages: set[int] | None = None,
    ) -> None:
        self.copies: dict[str, torch.Tensor] = {}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._event: Any = None
        later: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        cuda = [t for t in tensors.values() if t.device.type == "cuda"]
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        for name, t in tensors.items():
            buf = buffers.get(name, t)
            self.copies[name] = buf
            deferred = (
                overlap_storages is not None
                and t.numel() > 0
                and t.untyped_storage().data_ptr() in overlap_storages
            )
            if deferred:
                later.append((name, t, buf))
            elif t.device.type == "cuda" and stream is not None:
                with torch.cuda.stream(stream):
                    buf.copy_(t.detach(), non_blocking=True)
            else:
                buf.copy_(t.detach())
        if stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(stream)
        if later:
            self._thread = threading.Thread(
                target=self._copy_later, args=(later, stream), name="rc-snapshot", daemon=True
            )
            self._thread.start()

    def _copy_later(self, items: list[tuple[str, torch.Tensor, torch.Tensor]], stream: Any) -> None:
        try:
            for _, t, buf in items:
                if t.device.type == "cuda" and stream is not None:
                    with torch.cuda.stream(stream):
                        buf.copy_(t.detach(), non_blocking=True)
                else:
                    buf.copy_(t.detach())
            if stream is not None:
                stream.synchronize()
        except BaseException as e:  # re-raised by wait()
            self._error = e

    def wait(self) -> None:
        """Block until every copy is complete (and raise if one failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return self._thread is None and self._event is None
