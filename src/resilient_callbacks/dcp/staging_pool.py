"""Host-buffer sets for ``dcp.async_save`` staging, each leased to one save until it is written.

A :class:`~.storage_writer.ResilientStorageWriter` reuses one set of host buffers from save to
save, so memory stays flat. A save staged while an earlier one has not written yet gets a set
of its own (memory for one more copy of the state, while both are in flight) instead of being
refused: a refusal that some ranks made and others did not left the ranks out of step (the next
save waited in DCP's collectives until the timeout), and a save that failed where the writer is
not told (a planner's error) kept the only set leased for good.

A lease ends when its save's ``write_data`` has written from it, or when DCP has dropped the
staged state (a save that failed before writing): every staged tensor is a new alias of its
buffer, and the lease ends with the last alias.

Thread contract: :meth:`BufferPool.lease` runs in the thread that calls ``dcp.async_save``;
:meth:`BufferPool.written` in DCP's background save thread; an alias's end in whichever thread
drops it. The pool's lock is re-entrant: garbage collection can end a lease while the same
thread holds it.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from ..snapshot import HostBuffers

log = logging.getLogger("resilient_callbacks")


class Lease:
    """One save's set of host buffers, from staging until it is written (or dropped)."""

    def __init__(self, pool: BufferPool, buffers: HostBuffers) -> None:
        self.pool = pool
        self.buffers = buffers
        self.storages: set[int] = set()  # addresses of the buffers this save staged into
        self._aliases = 0
        self._staging = True  # aliases are still being made: their count may pass through 0

    def alias(self, buf: torch.Tensor) -> torch.Tensor:
        """A new tensor object sharing ``buf``'s memory, for the staged state; the lease
        cannot end by garbage collection while one is alive."""
        view = buf.view(buf.shape)
        if buf.numel():
            self.storages.add(buf.untyped_storage().data_ptr())
        with self.pool._lock:
            self._aliases += 1
        weakref.finalize(view, self._dropped)
        return view

    def staged(self) -> None:
        """Every alias is made: from now on, the last one to go ends the lease."""
        with self.pool._lock:
            self._staging = False
            if self._aliases == 0:
                self.pool.release(self)

    def _dropped(self) -> None:
        with self.pool._lock:
            self._aliases -= 1
            if self._aliases == 0 and not self._staging:
                self.pool.release(self)


class BufferPool:
    """Sets of host buffers, one per save in flight; at most one idle set is kept."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._idle: list[HostBuffers] = [HostBuffers()]
        self._leased: list[Lease] = []

    def lease(self) -> Lease:
        with self._lock:
            if self._idle:
                buffers = self._idle.pop()
            else:
                log.info(
                    "dcp.async_save: %d earlier save(s) of this writer have not written their "
                    "state yet; this one stages into another set of host buffers (wait for a "
                    "save's future before the next to keep one set)",
                    len(self._leased),
                )
                buffers = HostBuffers()
            lease = Lease(self, buffers)
            self._leased.append(lease)
            return lease

    def release(self, lease: Lease) -> None:
        """End ``lease`` (a second call does nothing): its set is reused, or freed if an idle
        set is kept already."""
        with self._lock:
            if lease not in self._leased:
                return
            self._leased.remove(lease)
            if not self._idle:
                self._idle.append(lease.buffers)

    def written(self, storages: set[int]) -> None:
        """A save wrote the tensors at ``storages``: end the leases it staged into."""
        with self._lock:
            for lease in [x for x in self._leased if x.storages & storages]:
                self.release(lease)

    @property
    def in_flight(self) -> int:
        """Leases not ended: saves staged and not yet written (or not yet dropped)."""
        with self._lock:
            return len(self._leased)
