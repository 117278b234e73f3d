"""Replicated chunks of a :class:`~.sharded.Sharded` save whose copies differ between the
ranks holding them: said at the save.

A chunk several ranks hold -- a ``Replicate`` placement: a tensor-parallel plan's replicated
bias, the replicate dimension of HSDP -- is written once, by the lowest rank holding it
(:func:`.chunks.index_of_ranks`), and a restore gives that copy to every rank. The copies are
equal while training keeps them so. A rank that changed its copy alone (an in-place change
outside the optimizer on some ranks, gradients not all-reduced across the replicas) leaves
copies that differ; the save kept the lowest rank's in silence, and a resumed run went on
differently from one that was not stopped.

At each save every rank holding a replicated chunk of the model hashes a sample of its copy
(:data:`SAMPLE` evenly spaced elements, gathered where the tensor lives: one small gather per
chunk, one device-to-host copy in all), and one all-reduce of two int64 per replicated chunk
finds the chunks whose copies differ; rank 0 warns, naming them. A copy that differs only
outside its sample is not seen: a cheap check, not a proof. Model tensors only: the optimizer's
state follows its parameters, and FSDP1's step counters are 0-d chunks of every rank.

Which ranks call what: :meth:`Replicas.of` on every rank when the chunk index is gathered (from
the same gathered lists: the same answer everywhere); :meth:`Replicas.check` on every rank at
every save, on the training thread: collective exactly when the layout has replicated chunks
of the model, which every rank knows alike.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from .. import dist
from ..errors import AT_CALLER, warn_and_log
from .views import MODEL

log = logging.getLogger("resilient_callbacks")

SAMPLE = 256  # elements of each copy compared
_NONE = -(1 << 62)  # (in the all-reduce) a rank that does not hold the chunk
_MASK = (1 << 62) - 1


@dataclass
class Replicas:
    """The replicated chunks of the model in the last gathered chunk index."""

    # (tensor name, ranks holding the chunk), one per replicated chunk, in the same order on
    # every rank
    chunks: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    mine: list[tuple[int, str]] = field(default_factory=list)  # (position, this rank's key)
    said: frozenset[str] = frozenset()  # the tensors last warned about (said once)

    @classmethod
    def of(cls, per_rank: Sequence[Mapping[str, Any]], rank: int) -> Replicas:
        """From every rank's ``{name: (dtype, shape, [[offsets, sizes, key], ...])}``."""
        held: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, str]]] = {}
        for r, theirs in enumerate(per_rank):
            for name, (_, _, chunks) in theirs.items():
                if not name.startswith(MODEL):
                    continue
                for offsets, sizes, key in chunks:
                    if math.prod(sizes) > 0:
                        box = (name, tuple(offsets), tuple(sizes))
                        held.setdefault(box, []).append((r, key))
        replicated = sorted(box for box, ranks in held.items() if len(ranks) > 1)
        out = cls()
        for i, box in enumerate(replicated):
            out.chunks.append((box[0], tuple(r for r, _ in held[box])))
            out.mine += [(i, key) for r, key in held[box] if r == rank]
        return out

    def check(self, local: Mapping[str, torch.Tensor]) -> None:
        """Every rank (collective when there are replicated chunks): warn, on rank 0, naming
        the replicated tensors whose copies differ (``local``: this rank's tensors by key)."""
        if not self.chunks:
            return
        n = len(self.chunks)
        digests = [_NONE] * n
        mine = [(i, local[key]) for i, key in self.mine if key in local]
        try:  # (whatever happens here, this rank reaches the all-reduce the others are in)
            _digests(mine, digests)
        except Exception as e:
            log.info("Sharded: the copies of replicated tensors are not compared: %r", e)
            digests = [_NONE] * n
        highest = dist.max_each(digests + [_NONE if d == _NONE else -d for d in digests])
        differ: dict[str, set[int]] = {}
        for (name, ranks), hi, lo in zip(self.chunks, highest[:n], highest[n:], strict=True):
            if hi != -lo:  # (the highest and the lowest digest of its holders)
                differ.setdefault(name, set()).update(ranks)
        names = frozenset(differ)
        if names == self.said:
            return
        self.said = names
        if not names:
            return
        said = ", ".join(
            f"{name} (ranks {', '.join(map(str, sorted(differ[name])))})"
            for name in sorted(names)[:5]
        )
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        warn_and_log(
            log,
            f"replicated tensors differ between the ranks holding them: {said}{more}. The "
            "checkpoint keeps the copy of the lowest rank holding each, and a restore gives it "
            "to every rank: a resumed run will not go on as this one. The copies of a "
            "replicated DTensor diverge when a rank changes its copy alone (an in-place change "
            "outside the optimizer on some ranks, gradients not all-reduced across the "
            "replicas); keep them equal before saving (e.g. torch.distributed.broadcast of "
            f"the local tensor from one rank). (Compared on {SAMPLE} evenly spaced elements "
            "of each copy.)",
            UserWarning,
            stacklevel=AT_CALLER,
            warn=dist.rank() == 0,
        )


def _digests(mine: list[tuple[int, torch.Tensor]], digests: list[int]) -> None:
    """Set ``digests[i]`` to the digest of the sample of each ``(i, tensor)`` of ``mine``."""
    if not mine:
        return
    at: dict[tuple[int, str], torch.Tensor] = {}  # (tensors of a model share sizes)
    samples = [_sample(t, at) for _, t in mine]
    host = torch.cat(samples).cpu()
    start = 0
    for (i, _), s in zip(mine, samples, strict=True):
        raw = host[start : start + s.numel()].numpy()
        digests[i] = xxhash.xxh3_64_intdigest(raw.tobytes()) & _MASK
        start += s.numel()


def _sample(t: torch.Tensor, at: dict[tuple[int, str], torch.Tensor] | None = None) -> torch.Tensor:
    """The bytes of :data:`SAMPLE` evenly spaced elements of ``t`` (all of a smaller one), on
    its device: 1-D, uint8. ``at``: the positions by number of elements and device, reused."""
    t = t.detach()
    n = t.numel()
    if n <= SAMPLE:
        flat = t.reshape(-1)
    else:
        key = (n, str(t.device))
        where = None if at is None else at.get(key)
        if where is None:
            where = (
                torch.arange(SAMPLE, dtype=torch.int64, device=t.device) * (n - 1) // (SAMPLE - 1)
            )
            if at is not None:
                at[key] = where
        flat = torch.take(t, where)
    return flat.contiguous().view(torch.uint8).reshape(-1)
