"""A sampler whose position is part of the checkpoint, so resume continues mid-epoch without
replaying batches.

The order of epoch ``e`` is a permutation drawn from ``seed + e`` alone, so it does not depend on
the global RNG and can be recomputed in O(len) on resume; the position is the number of indices
handed out in the current epoch. ``load_state_dict`` jumps straight there: no batch is loaded
twice, however far into the epoch the run stopped.

Prefer :class:`ResumableDataLoader`, which wraps the sampler and avoids two traps of a
hand-built loop. With a plain ``DataLoader`` and :class:`ResumableSampler`, the sampler's
position counts indices it has *yielded*: exact with ``num_workers=0``, ahead of the loop with
worker prefetching. And a plain ``DataLoader`` draws a seed from the global torch RNG each time
an iterator is created, which a resumed run does at a different point: pass
``generator=torch.Generator()`` to it, or dropout and other random streams diverge after resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


class ResumableSampler(Sampler[int]):
    """Shuffled (or sequential) indices over ``num_samples`` items, resumable mid-epoch.

    With ``num_replicas``/``rank`` it shards each epoch's order like ``DistributedSampler``
    (padding by wrapping around so every rank gets the same count); its state is then per-rank:
    wrap it in :class:`~resilient_callbacks.PerRank` in the checkpointed state.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if num_samples < 0:
            raise ValueError("num_samples must be >= 0")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.position = 0  # indices yielded so far in this epoch
        self._on_set_epoch: Callable[[int], None] | None = None  # the owning loader's set_epoch

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        if self.num_replicas > 1 and order:
            total = -(-len(order) // self.num_replicas) * self.num_replicas
            order = (order * (total // len(order) + 1))[:total]
            order = order[self.rank : total : self.num_replicas]
        return order

    def __len__(self) -> int:
        if self.num_replicas > 1:
            return -(-self.num_samples // self.num_replicas)
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.position < len(order):
            i = order[self.position]
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (the ``DistributedSampler`` convention). Inside a
        :class:`ResumableDataLoader` this moves the loader too (frameworks such as Lightning
        announce epochs through ``loader.sampler.set_epoch``)."""
        if self._on_set_epoch is not None:
            self._on_set_epoch(epoch)
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def set_position(self, epoch: int, consumed: int) -> None:
        """Record that ``consumed`` samples of ``epoch`` were really used (for prefetching loaders)."""
        self.epoch, self.position = int(epoch), int(consumed)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler {key}={getattr(self, key)!r} here but {state[key]!r} in "
                    "the checkpoint: the data changed, so the saved position means nothing"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position is checkpointable: put it in the state and a resumed run
    continues with the next batch the interrupted run had not yet trained on, mid-epoch, without
    loading any batch twice.

    It fixes the two traps that make a hand-built resumable loop silently inexact:

    - position is counted in batches *handed to the training loop*, not indices drawn by the
      sampler, so worker prefetching (``num_workers > 0``) does not skip samples on resume;
    - every ``DataLoader`` draws a base seed when an iterator is created (at each epoch start and,
      on resume, once more); a plain ``DataLoader`` draws it from the global torch RNG, which
      shifts dropout and every other random stream of the resumed run. This loader draws it from
      a private generator seeded from ``(seed, epoch)``, so worker seeds are reproducible too.

    Order: epoch ``e`` is a permutation drawn from ``seed + e`` (see :class:`ResumableSampler`);
    with ``num_replicas``/``rank`` each rank gets its shard and the state is per-rank (wrap the
    loader in :class:`~resilient_callbacks.PerRank`).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        for bad in ("sampler", "batch_sampler", "generator"):
            if kwargs.get(bad) is not None:
                raise ValueError(f"ResumableDataLoader makes its own {bad}; do not pass {bad}=")
        self._seed = int(seed)
        sampler = ResumableSampler(
            len(dataset), shuffle=shuffle, seed=seed, num_replicas=num_replicas, rank=rank
        )
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            generator=torch.Generator(),
            **kwargs,
        )
        self.epoch = 0
        self.batches_consumed = 0  # batches handed to the loop in the current epoch
        sampler._on_set_epoch = self.set_epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        sampler.set_position(self.epoch, self.batches_consumed * self.batch_size)
        assert self.generator is not None
        self.generator.manual_seed((self._seed * 1_000_003 + self.epoch) % (2**63))
        return self._iterate(super().__iter__())

    def _iterate(self, it: Iterator[Any]) -> Iterator[Any]:
        for batch in it:
            self.batches_consumed += 1
            yield batch
        self.epoch += 1
        self.batches_consumed = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.batches_consumed = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        assert isinstance(self.sampler, ResumableSampler)
        return {
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert isinstance(self.sampler, ResumableSampler)
        if state["batch_size"] != self.batch_size:
            raise ValueError(
                f"ResumableDataLoader batch_size={self.batch_size} here but {state['batch_size']} "
                "in the checkpoint; the saved position counts batches of the old size"
            )
        self.sampler.load_state_dict(state["sampler"])
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"])
