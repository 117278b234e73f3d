"""``ResumableSampler``: indices over a dataset, resumable mid-epoch, drawn exactly as the stock
samplers draw them (``RandomSampler`` from the global RNG or a generator, ``DistributedSampler``
with or without ``set_epoch``, ``SequentialSampler``), and the re-sharding of an epoch resumed
on another number of ranks. :class:`~resilient_callbacks.data.ResumableDataLoader` is built on
it (see :mod:`resilient_callbacks.data`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

log = logging.getLogger("resilient_callbacks")


def _draw_seed(generator: torch.Generator | None = None) -> int:
    """The int64 draw ``RandomSampler`` and the ``DataLoader`` iterator make (global if None)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class ResumableSampler(Sampler[int]):
    """Indices over ``num_samples`` items, resumable mid-epoch, drawn as the stock sampler
    draws them:

    - ``shuffle=True`` and no ``seed``/``generator``: ``RandomSampler(data)``: at its first index
      each epoch it draws a seed from the global torch RNG; the seed is recorded in the state.
    - ``seed=s`` or ``generator=g``: ``RandomSampler(data, generator=g)`` with
      ``g = torch.Generator().manual_seed(s)``: the permutation comes from ``g``, which advances
      from epoch to epoch; its states are recorded.
    - ``num_replicas=W`` (even 1), ``rank=r``: ``DistributedSampler(data, W, r, shuffle, seed)``
      (``drop_last=False``): epoch ``e``'s order is drawn from ``seed + e`` alone (from ``seed``
      in every epoch with ``reshuffle=False``: ``set_epoch`` never called); the state is
      per-rank: wrap it in :class:`~resilient_callbacks.PerRank` in the checkpointed state.
    - ``shuffle=False``: ``SequentialSampler`` (sharded like ``DistributedSampler`` with
      ``num_replicas``).

    ``position`` counts the indices handed out in the current epoch. Used alone under a stock
    ``DataLoader``, that is exact with ``num_workers=0`` only, and the ``DataLoader`` itself
    draws a seed from the global RNG whenever an iterator is created (again, at another point,
    in a resumed run): prefer :class:`ResumableDataLoader`.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        num_replicas: int | None = None,
        rank: int = 0,
        reshuffle: bool = True,
    ) -> None:
        if not isinstance(num_samples, int) or isinstance(num_samples, bool):
            raise TypeError(
                f"ResumableSampler(num_samples, ...) takes the number of samples (an int), not "
                f"a {type(num_samples).__name__}: ResumableSampler(len(dataset), seed=...)"
            )
        if num_samples < 0:
            raise ValueError("num_samples must be >= 0")
        if num_replicas is None:
            if rank != 0:
                raise ValueError(f"rank={rank} needs num_replicas")
        elif not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        if seed is not None and generator is not None:
            raise ValueError("pass seed= or generator=, not both")
        if num_replicas is not None and generator is not None:
            raise ValueError(
                "with num_replicas the order is DistributedSampler's, drawn from seed + epoch: "
                "pass seed=, not generator="
            )
        if not reshuffle and num_replicas is None:
            raise ValueError("reshuffle=False is DistributedSampler's order: it needs num_replicas")
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.reshuffle = reshuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.generator: torch.Generator | None = None
        if not shuffle:
            self.order = "sequential"
        elif num_replicas is not None:
            self.order = "distributed"
        elif seed is not None or generator is not None:
            self.order = "generator"
            self.generator = (
                generator if generator is not None else torch.Generator().manual_seed(int(seed))  # type: ignore[arg-type]
            )
        else:
            self.order = "global"
        self.seed = int(seed) if seed is not None else (0 if num_replicas is not None else None)
        self.epoch = 0
        self.position = 0  # indices yielded so far in this epoch
        self._drawn: int | None = None  # the epoch whose order was drawn
        self._epoch_seed: int | None = None  # global: the seed that epoch drew
        self._epoch_state: torch.Tensor | None = None  # generator: its state before the draw
        self._tail: int | None = None  # generator: the epoch whose trailing draw was made
        self._on_set_epoch: Callable[[int], None] | None = None  # the owning loader's set_epoch
        # inside a ResumableDataLoader: the loader sets the position before each iteration it
        # makes; an iteration not so announced is another loader's (accelerator.prepare(loader),
        # skip_first_batches(loader)), whose batches the loader's position does not count
        self._announced = False
        self.iterated_elsewhere = False
        # an epoch resumed on another number of ranks or batch size: its rest, re-sharded
        # (see load_resharded); [num_replicas, samples consumed] per re-sharding
        self._reshards: list[list[int]] = []
        self._reshard_epoch: int | None = None
        self._reshard_len = 0

    def _indices(self) -> list[int]:
        """This epoch's order. Its first call in an epoch draws as the stock sampler does at its
        first index; later calls (a resumed or re-entered epoch) recompute it, drawing nothing."""
        n = self.num_samples
        if self.order in ("sequential", "distributed"):
            if self.order == "sequential":
                order = list(range(n))
            else:
                g = torch.Generator()
                g.manual_seed(int(self.seed) + (self.epoch if self.reshuffle else 0))  # type: ignore[arg-type]
                order = torch.randperm(n, generator=g).tolist()
            if self._reshard_epoch == self.epoch:
                for replicas, consumed in self._reshards:
                    order = _padded(order, replicas)[consumed:]
            if self.num_replicas is not None:
                order = _padded(order, self.num_replicas)[self.rank :: self.num_replicas]
            return order
        if n == 0:
            return []
        fresh = self._drawn != self.epoch
        self._drawn = self.epoch
        if self.order == "global":
            if fresh:
                self._epoch_seed = _draw_seed()
            g = torch.Generator()
            g.manual_seed(int(self._epoch_seed))  # type: ignore[arg-type]
            return torch.randperm(n, generator=g).tolist()
        assert self.generator is not None
        if fresh:
            self._epoch_state = self.generator.get_state()
            return torch.randperm(n, generator=self.generator).tolist()
        g = torch.Generator()
        g.set_state(self._epoch_state)  # type: ignore[arg-type]
        return torch.randperm(n, generator=g).tolist()

    def __len__(self) -> int:
        if self._reshard_epoch == self.epoch:
            return self._reshard_len
        if self.num_replicas is not None:
            return -(-self.num_samples // self.num_replicas)
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if self._on_set_epoch is not None and not self._announced:
            self.iterated_elsewhere = True
        self._announced = False
        order = self._indices()
        epoch = self.epoch
        while self.position < len(order):
            i = order[self.position]
            self.position += 1
            yield i
        if self.order == "generator" and self._tail != epoch and self.num_samples:
            # RandomSampler draws one more permutation (of length 0 after slicing) when asked for
            # an index past its last: the generator advances by it too.
            torch.randperm(self.num_samples, generator=self.generator)
            self._tail = epoch
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

    def set_position(self, epoch: int, consumed: int, *, fresh: bool = False) -> None:
        """Record that ``consumed`` samples of ``epoch`` were really used (for prefetching
        loaders). ``fresh``: the epoch starts anew, so its order is drawn again."""
        self.epoch, self.position = int(epoch), int(consumed)
        self._announced = True
        if fresh:
            if self._drawn == self.epoch:
                self._drawn = None
            if self._tail == self.epoch:
                self._tail = None

    def state_dict(self) -> dict[str, Any]:
        return self.state_at(self.epoch, self.position)

    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """The state as of ``position`` indices into ``epoch`` (a loader's view of its sampler,
        which prefetching workers may have run ahead)."""
        state: dict[str, Any] = {
            "order": self.order,
            "epoch": int(epoch),
            "position": int(position),
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "drawn": self._drawn == epoch,
        }
        if self.order == "distributed":
            state["reshuffle"] = self.reshuffle
        if self._reshards and self._reshard_epoch == epoch:
            state["reshards"] = [list(r) for r in self._reshards]
        if self.order == "global":
            state["epoch_seed"] = self._epoch_seed if self._drawn == epoch else None
        elif self.order == "generator":
            assert self.generator is not None
            current = self.generator.get_state()
            drawn = self._drawn == epoch and self._epoch_state is not None
            state["epoch_rng"] = self._epoch_state.clone() if drawn else current  # type: ignore[union-attr]
            state["rng"] = current
            state["tail_drawn"] = self._tail == epoch
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_compatible(state)
        if state.get("num_replicas") != self.num_replicas:
            raise ValueError(
                f"ResumableSampler num_replicas={self.num_replicas} here but "
                f"{state.get('num_replicas')} in the checkpoint: its position is one rank's "
                "share of another sharding (ResumableDataLoader re-shards the rest of the epoch)"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._set_reshards(state.get("reshards") or [])
        drawn = bool(state.get("drawn", False))
        self._drawn = self.epoch if drawn else None
        if self.order == "global":
            self._epoch_seed = state.get("epoch_seed")
            if drawn and self._epoch_seed is None:
                self._drawn = None
        elif self.order == "generator":
            assert self.generator is not None
            self._epoch_state = state["epoch_rng"].clone()
            self.generator.set_state(state["rng"].clone())
            self._tail = self.epoch if state.get("tail_drawn") else None

    def check_compatible(self, state: dict[str, Any]) -> None:
        """Raise ValueError unless ``state`` orders the same data the same way (any sharding)."""
        order = state.get("order", "distributed" if state.get("shuffle") else "sequential")
        if order != self.order:
            raise ValueError(
                f"ResumableSampler orders its data by {self.order!r} here but the checkpoint was "
                f"written with {order!r} ({_ORDER_HINT.get(order, '')}); construct it as the "
                "interrupted run did (seed/generator/num_replicas)"
            )
        if order == "distributed" and "reshuffle" not in state and not self.reshuffle:
            # written before reshuffle existed, when every epoch was reshuffled: keep the order
            # the run began with (a DeepSpeed run that upgraded mid-way)
            log.info("ResumableSampler: the checkpoint reshuffled every epoch; so does this run")
            self.reshuffle = True
        if order == "distributed" and state.get("reshuffle", True) != self.reshuffle:
            raise ValueError(
                f"ResumableSampler reshuffle={self.reshuffle} here but "
                f"{state.get('reshuffle', True)} in the checkpoint: epochs after the first would "
                "come in another order; construct it as the interrupted run did"
            )
        for key in ("num_samples", "shuffle", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler {key}={getattr(self, key)!r} here but {state[key]!r} in "
                    "the checkpoint: the data changed, so the saved position means nothing"
                )

    def load_resharded(self, state: dict[str, Any], consumed: int) -> int:
        """Continue ``state``'s epoch, saved by ``state['num_replicas']`` ranks that together had
        taken its first ``consumed`` samples, on this sampler's ranks: the rest of the epoch's
        order is sharded as ``DistributedSampler`` shards a whole one. Returns the number of
        samples left in the epoch (0: it was over)."""
        self.epoch = int(state["epoch"])
        self.position = 0
        self._drawn = None
        reshards = [*(state.get("reshards") or []), [int(state["num_replicas"]), int(consumed)]]
        self._set_reshards(reshards)
        return len(self.global_rest())

    def share_of(self, state: dict[str, Any]) -> int:
        """How many indices each rank of the sharding that saved ``state`` (a state of this
        data and order) had in the saved epoch."""
        other = ResumableSampler(
            int(state["num_samples"]),
            shuffle=bool(state.get("shuffle", True)),
            seed=state.get("seed"),
            num_replicas=int(state["num_replicas"]),
            reshuffle=bool(state.get("reshuffle", True)),
        )
        other.epoch = int(state["epoch"])
        other._set_reshards(state.get("reshards") or [])
        return len(other)

    def resharded(self, epoch: int) -> bool:
        """Whether ``epoch`` is the rest of an epoch re-sharded at a resume."""
        return bool(self._reshards) and self._reshard_epoch == epoch

    def _set_reshards(self, reshards: list[list[int]]) -> None:
        self._reshards = [[int(w), int(c)] for w, c in reshards]
        self._reshard_epoch = self.epoch if self._reshards else None
        self._reshard_len = len(self._indices()) if self._reshards else 0

    def global_rest(self) -> list[int]:
        """The part of this epoch's order not taken yet, before this sampler's sharding."""
        keep, self.num_replicas = self.num_replicas, None
        try:
            return self._indices()
        finally:
            self.num_replicas = keep


def _padded(order: list[int], replicas: int) -> list[int]:
    """``order`` repeated to a multiple of ``replicas`` items, as ``DistributedSampler`` pads."""
    if not order:
        return order
    total = -(-len(order) // replicas) * replicas
    return (order * (total // len(order) + 1))[:total]


_ORDER_HINT = {
    "sequential": "shuffle=False",
    "global": "shuffle=True, no seed: the global torch RNG",
    "generator": "shuffle=True with seed= or generator=",
    "distributed": "num_replicas=..., seed + epoch",
}
