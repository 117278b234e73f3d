"""Pinned host buffers for many tensors in few allocations.

torch's caching host allocator (what ``pin_memory=True`` uses) rounds every pinned allocation
up to a power of two and keeps the block for reuse (``CachingHostAllocator.h``: "Round up the
allocation to the nearest power of two"). One allocation per saved tensor would therefore lock
up to twice the state's bytes in host memory: GPT-2's 154 MB embedding takes a 256 MB block, and
GPT-2 small with its AdamW state (445 tensors, 1.65 GB) would lock 2.75 GB (1.67x; packed:
1.68 GB, 1.02x -- the allocator's rule applied to the sizes, not a measurement on a GPU).
:func:`pinned_group` packs the tensors' buffers into slabs (first
fit, largest first) whose size is the power of two of the largest buffer (at most
``SLAB_MAX``), each buffer a view starting on a page boundary, so that only the last slab's own
rounding remains.

The views behave as separate pinned tensors: ``copy_(t, non_blocking=True)`` into one is an
asynchronous copy (its pointer lies in page-locked memory), and the allocator records the copy's
stream on the slab's block, which is not handed out again while any view of it is alive or a
copy into it is pending.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ALIGN = 4096  # every buffer starts on a page
SLAB_MAX = 1 << 30  # larger buffers get an allocation of their own


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pack(sizes: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """The slabs for buffers of ``sizes`` bytes: ``(slab bytes, [(index, offset), ...])``.
    First fit, largest first, into slabs of the power of two of the largest size (at most
    ``SLAB_MAX``); a buffer larger than that gets a slab of its own."""
    order = sorted((i for i, n in enumerate(sizes) if n > 0), key=lambda i: -sizes[i])
    if not order:
        return []
    cap = min(SLAB_MAX, _pow2(sizes[order[0]]))
    slabs: list[list] = []  # [used, [(index, offset)], room for more]
    for i in order:
        need = sizes[i] + (-sizes[i] % ALIGN)
        if need > cap:
            slabs.append([sizes[i], [(i, 0)], False])
            continue
        for s in slabs:
            if s[2] and s[0] + need <= cap:
                s[1].append((i, s[0]))
                s[0] += need
                break
        else:
            slabs.append([need, [(i, 0)], True])
    return [(used, placed) for used, placed, _ in slabs]


def pinned_group(
    specs: Sequence[tuple[torch.Size, torch.dtype]], *, pin: bool = True
) -> list[torch.Tensor]:
    """An empty host tensor for each ``(shape, dtype)`` of ``specs``, in that order, packed into
    slabs (see :func:`pack`); pinned unless ``pin`` is False. Empty tensors are allocated on
    their own (nothing to pin)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    out: list[torch.Tensor | None] = [None] * len(specs)
    for used, placed in pack(sizes):
        slab = torch.empty(used, dtype=torch.uint8, pin_memory=pin)
        for i, offset in placed:
            shape, dtype = specs[i]
            out[i] = slab[offset : offset + sizes[i]].view(dtype).view(shape)
    for i, (shape, dtype) in enumerate(specs):
        if out[i] is None:
            out[i] = torch.empty(shape, dtype=dtype)
    return [t for t in out if t is not None]
