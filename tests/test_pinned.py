"""Pinned host buffers packed into slabs (:mod:`resilient_callbacks.pinned`): every buffer placed
once, page-aligned, without overlap; the views behave as separate tensors; and saves whose host
buffers are such views restore exactly. (Pinning itself needs CUDA: here the same slabs are
made of ordinary memory; ``tests/test_gpu.py`` saves through pinned ones.)"""

from __future__ import annotations

import itertools
import random

import torch

from resilient_callbacks import Checkpointer, snapshot
from resilient_callbacks.pinned import ALIGN, SLAB_MAX, _pow2, pack, pinned_group


def test_pack_places_every_buffer_once_aligned_and_without_overlap():
    rng = random.Random(0)
    sizes = [rng.choice([0, 1, 3, 4096, 5000, 1 << 20, 3 << 20, 7_340_033]) for _ in range(300)]
    sizes += [SLAB_MAX + 1, 2 * SLAB_MAX]  # larger than a slab: one of their own
    slabs = pack(sizes)
    placed = sorted(i for _, p in slabs for i, _ in p)
    assert placed == [i for i, n in enumerate(sizes) if n > 0]
    cap = SLAB_MAX
    for used, p in slabs:
        spans = sorted((off, off + sizes[i]) for i, off in p)
        assert all(off % ALIGN == 0 for off, _ in spans)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert spans[-1][1] <= used
        assert used <= cap or len(p) == 1
    # the allocator's power-of-two rounding, per slab, costs far less than per buffer
    small = sizes[:-2]
    rounded = sum(_pow2(u) for u, _ in pack(small))
    assert rounded < 1.1 * sum(small) < sum(_pow2(n) for n in small if n)


def test_views_are_separate_tensors_of_their_shapes_and_dtypes():
    specs = [
        (torch.Size([3, 5]), torch.float32),
        (torch.Size([7]), torch.bfloat16),
        (torch.Size([]), torch.int64),
        (torch.Size([0, 4]), torch.float32),
        (torch.Size([9]), torch.bool),
        (torch.Size([2, 2]), torch.complex64),
        (torch.Size([1000]), torch.int8),
    ]
    bufs = pinned_group(specs, pin=False)
    assert [(b.shape, b.dtype) for b in bufs] == specs
    assert all(b.is_contiguous() for b in bufs)
    for i, b in enumerate(bufs):
        b.fill_(i + 1 if b.dtype != torch.bool else True)
    for i, b in enumerate(bufs):
        if b.numel():
            want = torch.full_like(b, i + 1 if b.dtype != torch.bool else True)
            assert torch.equal(b, want), i


def test_saves_into_slab_views_restore_exactly(tmp_path, monkeypatch):
    """Every host buffer a view into shared slabs (as for CUDA tensors): the background save
    copies into them, the writer reads them, and a second save reuses them."""

    def packed(specs):
        names = [name for name, *_ in specs]
        return dict(
            zip(names, pinned_group([(s, d) for _, s, d, _ in specs], pin=False), strict=True)
        )

    monkeypatch.setattr(snapshot, "_make", packed)
    torch.manual_seed(0)
    state = {
        "w": torch.randn(300, 70),
        "half": torch.randn(33).bfloat16(),
        "flags": torch.rand(17) > 0.5,
        "count": torch.tensor(5),
        "empty": torch.empty(0, 3),
        "ints": torch.arange(1000, dtype=torch.int8),
    }
    expected = {}
    with Checkpointer(tmp_path / "ck", keep_last=2, preemption=False) as ck:
        ck.save(1, state)
        ck.flush()
        for v in state.values():
            if v.dtype == torch.bool:
                v.logical_not_()
            elif v.numel():
                v.add_(1)
        expected = {k: v.clone() for k, v in state.items()}
        ck.save(2, state)
        for v in state.values():  # changed at once: the save holds the values at step 2
            if v.dtype != torch.bool and v.numel():
                v.mul_(-1)
        ck.flush()
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        assert ck.restore(fresh) == 2
    for k, v in expected.items():
        assert torch.equal(fresh[k], v), k
