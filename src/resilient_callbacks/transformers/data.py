"""Start the Trainer's training data at a batch inside an epoch, without replaying the batches
before it.

The Trainer resumes mid-epoch with accelerate's ``skip_first_batches``: it iterates the epoch
from its start and throws the first batches away (older versions loaded each skipped batch, which
took hours on large datasets). Here the *batch sampler* of the Trainer's own data loader learns to
start at local batch ``c`` of an epoch: it computes the epoch's index order once (what the start of
any epoch costs) and yields batch ``c`` onwards by slicing that order. No skipped batch is built,
loaded or collated, and the work does not depend on ``c``.

The order must be the one the interrupted run used. Samplers whose order is a function of the
epoch (accelerate's ``SeedableRandomSampler``, the default; ``SequentialSampler``;
``DistributedSampler``) are recomputed as they are. Samplers that draw from the global torch RNG
(a plain ``RandomSampler``, ``LengthGroupedSampler``) are recomputed with the torch RNG state they
saw when the epoch began, which is saved with every checkpoint. A sampler with its own
``generator`` (a ``WeightedRandomSampler`` or ``SubsetRandomSampler`` built with ``generator=g``,
a ``RandomSampler`` of a loader with ``generator=g``) is recomputed from that generator's state at
the epoch's start, and the generator is given the state it had at the save: both are saved too
(:meth:`ResumableBatches.generator_states`).

How: the class of the data loader's batch sampler object is swapped for a subclass that adds this
ability (:func:`make_resumable`), so the Trainer, accelerate and every other reference keep using
the same object; without a pending start position it iterates exactly as before.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from . import collator_rng
from .collator_rng import b64, from_b64

# Python's, NumPy's global and torch's CPU random states (what collating in the main process
# can draw from; CUDA streams are not: a collator runs on the CPU), and with a collator that
# has a generator of its own (collator_rng.py), its state as a fourth
CpuRng = tuple[Any, ...]


def cpu_rng(collator: Any = None) -> CpuRng:
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    return states if collator is None else (*states, collator_rng.get(collator))


def set_cpu_rng(states: CpuRng, collator: Any = None) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if collator is not None and len(states) > 3:
        collator_rng.put(collator, states[3])


def encode_cpu_rng(states: CpuRng) -> dict[str, Any]:
    """``states`` as plain JSON values (no pickle), for the checkpoint."""
    version, internal, gauss = states[0]
    kind, keys, pos, has_gauss, cached = states[1]
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, b64(torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.uint8))),
                  int(pos), int(has_gauss), float(cached)],
        "torch": b64(states[2]),
    }  # fmt: skip
    if len(states) > 3:
        out["collator"] = collator_rng.encode(states[3])
    return out


def decode_cpu_rng(saved: dict[str, Any]) -> CpuRng:
    version, internal, gauss = saved["python"]
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    np_keys = from_b64(keys).numpy().view(np.uint32).copy()
    states = (
        (version, tuple(internal), gauss),
        (kind, np_keys, pos, has_gauss, cached),
        from_b64(saved["torch"]),
    )
    if isinstance(saved.get("collator"), dict):
        return (*states, collator_rng.decode(saved["collator"]))
    return states


class _ListBatches:
    """A batch sampler over a list of batches (feeds accelerate's sharding logic a few batches)."""

    def __init__(self, batches: list[list[int]], batch_size: int | None, drop_last: bool) -> None:
        self.batches = batches
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _with_rng(fn: Callable[[], Any], rng_state: torch.Tensor | None) -> Any:
    """Run ``fn`` with the global torch RNG set to ``rng_state``; the RNG is left unchanged."""
    saved = torch.get_rng_state()
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    try:
        return fn()
    finally:
        torch.set_rng_state(saved)


class ResumableBatches:
    """The methods added to the class of a batch sampler by :func:`make_resumable`.

    ``resume_at(c, rng_state)`` makes the next iteration yield from local batch ``c`` of the
    epoch. Every iteration records the torch RNG state at its start (``epoch_rng``), which is
    what a later resume of this epoch needs to recompute the order.

    (Not a mixin base: CPython refuses ``__class__`` assignment to a class with an extra base,
    so each resumable class is the original class plus these methods, see :func:`_subclass`.)
    """

    _rc_base: Any
    _rc_skip: int
    _rc_replay_rng: torch.Tensor | None
    _rc_replay_gen: torch.Tensor | None  # the sampler's generator at the resumed epoch's start
    _rc_gen_now: torch.Tensor | None  # ... and at the save
    epoch_rng: torch.Tensor | None
    epoch_gen: torch.Tensor | None  # the sampler's own generator at this epoch's start
    _rc_first: CpuRng | None  # the CPU random states to collate a resumed epoch's first batch
    record_rng: bool  # record the CPU random states before each batch (main-process loading)
    handed: int  # index in its epoch of the batch handed out last (with record_rng)
    before_batch: CpuRng | None  # the CPU random states right before it was handed out
    collator: Any  # the data collator with a generator of its own (collator_rng.py), or None
    fast_forwards: int  # how many resumed iterations used direct slicing (not materializing)

    def resume_at(
        self, batches: int, rng_state: torch.Tensor | None, first: CpuRng | None = None
    ) -> None:
        """The next iteration starts at local batch ``batches`` of the epoch whose order was
        drawn from ``rng_state``; ``first``: the CPU random states the uninterrupted run
        collated that batch from (it was fetched ahead, before the save), if known."""
        self._rc_skip = int(batches)
        self._rc_replay_rng = rng_state
        self._rc_first = first

    def generator_states(self) -> dict[str, str] | None:
        """The sampler's own generator (None: it has none), base64 of its state at this
        epoch's start and now: a resume recomputes the epoch's order from the first and
        continues from the second (:meth:`resume_generator`)."""
        g = sampler_generator(self)
        if g is None or self.epoch_gen is None:
            return None
        return {"epoch": b64(self.epoch_gen), "now": b64(g.get_state())}

    def resume_generator(self, states: dict[str, str] | None) -> None:
        """After a restore: the sampler's generator takes its state at the save; a resume
        inside the epoch draws the epoch's order from its state at the epoch's start."""
        g = sampler_generator(self)
        if g is None or not states:
            return
        self._rc_gen_now = from_b64(states["now"])
        self._rc_replay_gen = from_b64(states["epoch"])
        g.set_state(self._rc_gen_now)

    def __iter__(self) -> Iterator[Any]:
        """Yields the batches; with :attr:`record_rng`, records before each one its index in
        the epoch (:attr:`handed`) and the CPU random states (:attr:`before_batch`), which
        the collating of that batch in this process draws from. After ``resume_at(..., first=
        states)`` the first batch is collated from those states, and the random streams are
        put back as they were when it was asked for, when the loader asks for the next one."""
        first, self._rc_first = self._rc_first, None
        index = self._rc_skip
        for batch in self._epoch_batches():
            if self.record_rng:
                self.handed, self.before_batch = index, cpu_rng(self.collator)
            index += 1
            if first is None:
                yield batch
                continue
            now = cpu_rng(self.collator)
            if self.record_rng:
                self.before_batch = first
            set_cpu_rng(first, self.collator)
            first = None
            yield batch  # collated here, as the uninterrupted run collated it
            set_cpu_rng(now, self.collator)  # (not on close: that may come at any later time)

    def _epoch_batches(self) -> Iterator[Any]:
        skip, replay = self._rc_skip, self._rc_replay_rng
        gen, now = self._rc_replay_gen, self._rc_gen_now
        self._rc_skip, self._rc_replay_rng = 0, None
        self._rc_replay_gen = self._rc_gen_now = None
        own = sampler_generator(self)
        if skip <= 0:
            # The body of this generator runs at the loader's first request for a batch, right
            # before the sampler draws its order: that is the state a resume must replay.
            self.epoch_rng = torch.get_rng_state()
            self.epoch_gen = own.get_state() if own is not None else None
            yield from self._rc_base.__iter__(self)
            return
        self.epoch_rng = replay.clone() if replay is not None else torch.get_rng_state()
        if own is not None and gen is not None and now is not None:
            own.set_state(gen)  # the epoch's order is drawn from its start state ...
            self.epoch_gen = gen
            batches = self._batches_from(skip, replay)
            first = next(batches, None)  # (the order is drawn at the first batch)
            own.set_state(now)  # ... and the generator goes on from the save's state
            if first is not None:
                yield first
                yield from batches
            return
        self.epoch_gen = own.get_state() if own is not None else None
        yield from self._batches_from(skip, replay)

    def _batches_from(self, skip: int, rng: torch.Tensor | None) -> Iterator[Any]:
        base = self._rc_base
        if base is BatchSampler or (base is BatchSamplerShard and self._plain_shard()):
            self.fast_forwards += 1
            if base is BatchSampler:
                order = _with_rng(lambda: list(self.sampler), rng)  # type: ignore[attr-defined]
                yield from _plain_batches(order, self.batch_size, self.drop_last, skip)  # type: ignore[attr-defined]
            else:
                yield from self._shard_batches(skip, rng)
            return
        # Any other batch sampler: build the epoch's batches (indices only; no sample is loaded)
        # and start at the position.
        batches = _with_rng(lambda: list(base.__iter__(self)), rng)
        yield from batches[skip:]

    # -- accelerate's BatchSamplerShard(BatchSampler(sampler)), split_batches=False ------------

    def _plain_shard(self) -> bool:
        inner = getattr(self, "batch_sampler", None)
        return (
            not getattr(self, "split_batches", True)
            and type(inner) is BatchSampler
            and inner.batch_size is not None
        )

    def _shard_batches(self, skip: int, rng: torch.Tensor | None) -> Iterator[list[int]]:
        """The batches ``BatchSamplerShard`` yields for this process, from the ``skip``-th on.

        Global batch ``i`` is ``order[i*bs:(i+1)*bs]``; rounds of ``P`` global batches whose last
        batch is full give local batch ``j = round`` to process ``rank``. Only the end of the
        epoch (an incomplete last round, padding from the first round) needs accelerate's own
        logic: it is run on the first round plus the last one, which reproduces it exactly."""
        inner: BatchSampler = self.batch_sampler  # type: ignore[attr-defined]
        procs: int = self.num_processes  # type: ignore[attr-defined]
        rank: int = self.process_index  # type: ignore[attr-defined]
        even: bool = self.even_batches  # type: ignore[attr-defined]
        bs = int(inner.batch_size)
        order = _with_rng(lambda: list(inner.sampler), rng)
        n = len(order)
        total = n // bs if inner.drop_last else -(-n // bs)

        def batch(i: int) -> list[int]:
            return order[i * bs : (i + 1) * bs]

        last_full = total > 0 and len(batch(total - 1)) == bs
        rounds = total // procs
        if total % procs == 0 and not last_full:
            rounds -= 1
        rounds = max(rounds, 0)

        def shard(batches: list[list[int]]) -> list[list[int]]:
            return list(
                BatchSamplerShard(
                    _ListBatches(batches, bs, inner.drop_last),
                    num_processes=procs,
                    process_index=rank,
                    split_batches=False,
                    even_batches=even,
                )
            )

        if rounds == 0:  # fewer than two rounds in the epoch: small, run accelerate's logic
            yield from shard([batch(i) for i in range(total)])[skip:]
            return
        for j in range(skip, rounds):
            yield batch(j * procs + rank)
        first_round = [batch(i) for i in range(procs)]
        last_round = [batch(i) for i in range(rounds * procs, total)]
        tail = shard(first_round + last_round)[1:]  # [0] is the first round's batch
        yield from tail[max(0, skip - rounds) :]


def _plain_batches(
    order: list[int], batch_size: int, drop_last: bool, skip: int
) -> Iterator[list[int]]:
    n = len(order)
    total = n // batch_size if drop_last else -(-n // batch_size)
    for j in range(skip, total):
        yield order[j * batch_size : (j + 1) * batch_size]


_METHODS = (
    "resume_at",
    "generator_states",
    "resume_generator",
    "__iter__",
    "_epoch_batches",
    "_batches_from",
    "_plain_shard",
    "_shard_batches",
)


def _subclass(base: type, name: str | None = None) -> type:
    ns: dict[str, Any] = {m: ResumableBatches.__dict__[m] for m in _METHODS}
    ns["_rc_base"] = base
    ns["__module__"] = __name__
    ns["__doc__"] = (
        f"{base.__name__} that can start an epoch at a given batch (see ResumableBatches)."
    )
    cls = type(name or f"Resumable{base.__name__}", (base,), ns)
    cls.__qualname__ = cls.__name__
    return cls


ResumableBatchSampler = _subclass(BatchSampler, "ResumableBatchSampler")
ResumableBatchSamplerShard = _subclass(BatchSamplerShard, "ResumableBatchSamplerShard")

_CLASSES: dict[type, type] = {
    BatchSampler: ResumableBatchSampler,
    BatchSamplerShard: ResumableBatchSamplerShard,
}


def is_resumable(batch_sampler: Any) -> bool:
    return "_rc_base" in type(batch_sampler).__dict__


def make_resumable(batch_sampler: Any) -> Any:
    """Give ``batch_sampler`` (in place) the ability to start an epoch at a given batch."""
    if is_resumable(batch_sampler):
        return batch_sampler
    base = type(batch_sampler)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = _subclass(base)
    batch_sampler.__class__ = cls
    batch_sampler._rc_skip = 0
    batch_sampler._rc_replay_rng = batch_sampler._rc_replay_gen = batch_sampler._rc_gen_now = None
    batch_sampler.epoch_rng = batch_sampler.epoch_gen = None
    batch_sampler.fast_forwards = 0
    batch_sampler._rc_first = batch_sampler.before_batch = None
    batch_sampler.record_rng, batch_sampler.handed = False, -1
    batch_sampler.collator = None
    return batch_sampler


def sampler_generator(batch_sampler: Any) -> torch.Generator | None:
    """The ``torch.Generator`` the index sampler under ``batch_sampler`` draws its order from
    (its ``generator``; under accelerate's ``BatchSamplerShard``, the inner sampler's), or None."""
    inner = getattr(batch_sampler, "batch_sampler", None)
    holder = inner if inner is not None and hasattr(inner, "sampler") else batch_sampler
    g = getattr(getattr(holder, "sampler", None), "generator", None)
    return g if isinstance(g, torch.Generator) else None


def generator_at(state: torch.Tensor) -> torch.Generator:
    """A new generator at a copy of ``state``."""
    g = torch.Generator()
    g.set_state(state.clone())
    return g
