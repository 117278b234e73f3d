"""A sampler and a data loader whose position is part of the checkpoint, so resume continues
mid-epoch without replaying batches, and that draw exactly what the stock ones draw.

Transparency: swapping a stock ``DataLoader`` for :class:`ResumableDataLoader` (same dataset,
batch size and shuffling) changes nothing in an uninterrupted run: the same batches in the same
order, and the same draws from the global torch RNG and from any generator, at the same moments,
so dropout and every other random stream see the same numbers. Which stock loader it replaces:

- ``ResumableDataLoader(ds, bs)`` (``shuffle=True``, no seed):
  ``DataLoader(ds, bs, shuffle=True)``, shuffled from the global torch RNG;
- ``ResumableDataLoader(ds, bs, seed=s)``:
  ``DataLoader(ds, bs, shuffle=True, generator=torch.Generator().manual_seed(s))``
  (``generator=g``: ``DataLoader(..., generator=g)``);
- ``ResumableDataLoader(ds, bs, shuffle=False)``: ``DataLoader(ds, bs)``;
- ``ResumableDataLoader(ds, bs, num_replicas=W, rank=r, seed=s)``:
  ``DataLoader(ds, bs, sampler=DistributedSampler(ds, W, r, seed=s))`` with ``set_epoch(e)``
  every epoch (``seed`` defaults to 0; ``generator=g`` is the ``DataLoader``'s); with
  ``reshuffle=False``, the same without ``set_epoch``: every epoch in epoch 0's order (as
  DeepSpeed's own loader).

Resume: the state records what the epoch drew (the shuffle seed taken from the global RNG, or
the generator's state) and the RNG state the epoch's iterator was created from, so a resumed
run recomputes the epoch's order in O(len) and continues with the next batch, without loading
a skipped batch and without drawing anything the uninterrupted run did not draw at that point.
The global RNG itself is restored by the :class:`~resilient_callbacks.Checkpointer` (it captures
every RNG by default); put the loader in the same state.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import xxhash
from torch.utils.data import DataLoader, IterableDataset

from .errors import AT_CALLER, UnsupportedStateError
from .notices import say_once
from .sampler import ResumableSampler

__all__ = ["ResumableDataLoader", "ResumableSampler"]

log = logging.getLogger("resilient_callbacks")


def _digest(state: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(state.numpy().tobytes())


def _call(ref: weakref.ReferenceType[Any], method: str, *args: Any) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(*args)


def _source_state(generator: torch.Generator | None) -> torch.Tensor:
    """The state the loader's iterator draws its base seed from (the global RNG if None)."""
    return (generator.get_state() if generator is not None else torch.get_rng_state()).clone()


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position is checkpointable: put it in the state and a resumed run
    continues with the next batch the interrupted run had not yet trained on, mid-epoch, without
    loading any batch twice. An uninterrupted run is the stock ``DataLoader``'s run, draw for
    draw (see :mod:`resilient_callbacks.data`):

    - ``shuffle=True`` (default) without ``seed``: ``DataLoader(dataset, batch_size,
      shuffle=True)``; the order comes from the global torch RNG (``torch.manual_seed`` before
      makes it reproducible);
    - ``seed=s`` / ``generator=g``: ``DataLoader(..., shuffle=True, generator=...)``: order and
      worker base seeds come from that generator, the global RNG is not touched;
    - ``num_replicas=W, rank=r``: each rank gets its shard, as with ``DistributedSampler(seed=s)``
      (``seed`` defaults to 0) and ``set_epoch(e)`` every epoch (``reshuffle=False``: never, so
      every epoch comes in epoch 0's order, as from DeepSpeed's loader); wrap the loader in
      :class:`~resilient_callbacks.PerRank`.

    Resume is exact, including the traps of a hand-built resumable loop: the position counts
    batches *handed to the training loop* (worker prefetching does not skip samples), and the
    iterator a resumed run creates mid-epoch takes its base seed from the recorded state, not
    from the global RNG, which therefore sees exactly the draws of the uninterrupted run.

    Iterating again after breaking out of an epoch continues that epoch (a stock ``DataLoader``
    would start a new one): that is what makes the position resumable.

    ``passes_are_epochs=True`` is for a loop that does not know about resuming (``for epoch in
    range(E): for batch in loader``, which starts at 0 again after a restart): the process's
    k-th pass over the loader is epoch k, so after a resume into epoch ``e`` the first ``e``
    passes yield nothing and pass ``e`` continues epoch ``e``. (Code run once per epoch still
    runs for those passes.) A loop that starts at the saved epoch itself leaves it False.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        num_replicas: int | None = None,
        rank: int = 0,
        drop_last: bool = False,
        reshuffle: bool = True,
        passes_are_epochs: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                f"ResumableDataLoader needs a map-style dataset (__len__ and __getitem__): "
                f"{type(dataset).__name__} is an IterableDataset, whose position only it knows. "
                "Give it state_dict()/load_state_dict() and checkpoint it in the state instead"
            )
        for bad in ("sampler", "batch_sampler"):
            if kwargs.get(bad) is not None:
                raise ValueError(f"ResumableDataLoader makes its own {bad}; do not pass {bad}=")
        if kwargs.get("in_order", True) is False:
            raise ValueError(
                "ResumableDataLoader needs in_order=True: its position counts the batches handed "
                "out in the epoch's order, and out of order a resume would repeat some and skip "
                "others"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"ResumableDataLoader batch_size={batch_size!r}: an int >= 1 (the position counts "
                "batches; batch_size=None, unbatched samples, is not supported)"
            )
        if num_replicas is None and seed is not None and generator is not None:
            raise ValueError("pass seed= or generator=, not both")
        if num_replicas is None and seed is not None:
            generator = torch.Generator().manual_seed(int(seed))
            seed = None
        # which generator the order comes from, as built: a resume with another is refused
        self._origin = None if generator is None else _digest(generator.get_state())
        sampler = ResumableSampler(
            len(dataset),
            shuffle=shuffle,
            seed=seed,
            generator=generator if shuffle and num_replicas is None else None,
            num_replicas=num_replicas,
            rank=rank,
            reshuffle=reshuffle,
        )
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            generator=generator,
            **kwargs,
        )
        self.epoch = 0
        self.batches_consumed = 0  # batches handed to the loop in the current epoch
        self.loaded_batches: int | None = None  # batches_consumed as load_state_dict set it
        self._started = False  # an iterator was created for the current epoch
        self._epoch_rng = _source_state(generator)  # base-seed source state at that creation
        self._restored_persistent = False  # a persistent worker iterator existed when saved
        self._pool_rng: torch.Tensor | None = None  # base-seed source when its pool was made
        # weakly: a bound method would keep the loader, and its persistent workers, alive in
        # a reference cycle until the garbage collector runs
        ref = weakref.ref(self)
        sampler._on_set_epoch = lambda epoch: _call(ref, "set_epoch", epoch)
        self.passes_are_epochs = passes_are_epochs
        self._passes = 0  # passes begun in this process
        self._skip_passes = 0  # passes still to answer empty (passes_are_epochs)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._passes += 1
        if self._skip_passes:  # an epoch the run had trained before it was resumed
            self._skip_passes -= 1
            return iter(())
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        fresh = not self._started and self.batches_consumed == 0
        if fresh:
            self._started = True
            self._epoch_rng = _source_state(self.generator)
            sampler.set_position(self.epoch, 0, fresh=True)
        elif self.batches_consumed >= len(self):
            # The epoch is over though its iterator had not run out when the state was saved:
            # asking for the next batch ends it; no iterator, no base seed.
            self._finish_sampler()
            return self._epoch_over(self.epoch)
        else:
            sampler.set_position(self.epoch, self.batches_consumed * self.batch_size)
        persistent = self.persistent_workers and self.num_workers > 0
        if persistent and self._iterator is None and self._pool_rng is None:
            self._pool_rng = self._epoch_rng  # the workers made now serve every later epoch
        if fresh and not (persistent and self._restored_persistent and self._iterator is None):
            return self._iterate(super().__iter__())
        # Continuing an epoch: the uninterrupted run created this epoch's iterator before the
        # checkpoint; this one takes the same base seed without drawing from the global RNG.
        # Persistent workers were made once, by the first epoch's iterator: its seed.
        source = self._pool_rng if persistent and self._pool_rng is not None else self._epoch_rng
        with self._base_seed_from(source):
            it = super().__iter__()
        self._restored_persistent = False
        return self._iterate(it)

    def _over_other_data(
        self, state: dict[str, Any], saved: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """The sampler's state ``saved`` to load over this dataset, which may have another size
        (data added or removed between runs), and whether the saved epoch was over. Another
        size is taken at an epoch's start or end, with a warning; inside an epoch the saved
        position means nothing in other data (ValueError)."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        n = saved.get("num_samples")
        if n is None or n == sampler.num_samples:
            return saved, False
        replicas = saved.get("num_replicas")
        share = -(-int(n) // int(replicas)) if replicas else int(n)
        total = share // self.batch_size if self.drop_last else -(-share // self.batch_size)
        batches, epoch = int(state["batches_consumed"]), int(state["epoch"])
        over = batches >= total
        if batches and not over:
            raise ValueError(
                f"ResumableDataLoader: the dataset has {sampler.num_samples} samples here but "
                f"{n} in the checkpoint, saved {batches} of {total} batches into epoch {epoch}: "
                "the data changed, so the saved position means nothing. To go on with the new "
                "data, resume from a checkpoint at an epoch's end"
            )
        say_once(  # (the dataset's size: the same on every rank)
            log,
            f"ResumableDataLoader: the dataset has {sampler.num_samples} samples here but {n} "
            f"in the checkpoint, saved at the {'end' if over else 'start'} of epoch {epoch}: "
            f"epoch {epoch + 1 if over else epoch} and the later ones go over the new data",
            stacklevel=AT_CALLER,  # (the user call that loads the state)
        )
        return {**saved, "num_samples": sampler.num_samples}, over

    def _dropped_of_rest(self) -> str:
        """For the warning of a re-sharded epoch: how many samples of its rest drop_last leaves
        untrained (the last ones, which fill no whole batch on every rank)."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        if not self.drop_last or sampler.num_replicas is None:
            return ""
        left, ranks = len(sampler.global_rest()), sampler.num_replicas
        # rank r takes places r, r + ranks, ... of the rest (padded): its first len(self) batches
        dropped = left - min(left, len(self) * self.batch_size * ranks)
        return (
            f"; with drop_last=True the last {dropped} of them fill no whole batch on every rank "
            "and are not trained"
            if dropped
            else ""
        )

    def _finish_sampler(self) -> None:
        """Run the current epoch's sampler to its end past its last index, as an iterator
        that runs out does: RandomSampler's trailing draw, if it has not happened."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        sampler.set_position(self.epoch, len(sampler))
        for _ in sampler:
            pass

    def _epoch_over(self, epoch: int) -> Iterator[Any]:
        """The pass of ``epoch``, whose batches were all handed out: it ends the epoch -- unless
        the loader was moved to a new epoch (:meth:`set_epoch`) before the first batch was
        asked for; then it is that epoch's pass. Lightning, resumed from a checkpoint of an
        epoch's last batch, creates the iterator first and announces the next epoch after: an
        empty pass would make it count that epoch as trained."""
        if self.epoch != epoch:
            yield from self._pass()
            return
        yield from self._iterate(iter(()))

    @contextmanager
    def _base_seed_from(self, state: torch.Tensor) -> Iterator[None]:
        g = torch.Generator()
        g.set_state(state.clone())
        own = self.generator
        self.generator = g
        try:
            yield
        finally:
            self.generator = own

    def _iterate(self, it: Iterator[Any]) -> Iterator[Any]:
        for batch in it:
            self.batches_consumed += 1
            yield batch
        self.epoch += 1
        self.batches_consumed = 0
        self._started = False

    @property
    def in_resharded_epoch(self) -> bool:
        """Whether the current epoch is one a checkpoint of another number of ranks (or batch
        size) was resumed in: then ``len(self)`` and :attr:`batches_consumed` count the rest
        of the epoch only, and :attr:`loaded_batches` (set by :meth:`load_state_dict`) how
        many batches of that rest were consumed when the state was loaded."""
        sampler = self.sampler
        return isinstance(sampler, ResumableSampler) and sampler.resharded(self.epoch)

    def set_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        if self.passes_are_epochs and self._skip_passes and epoch < self.epoch:
            return  # the loop announces an epoch the resumed run had trained: skipped anyway
        if self.batches_consumed and self.batches_consumed >= len(self):
            # the epoch's batches were all handed out (a resume at its last batch) but its
            # iterator had not run out, as the uninterrupted loop's did
            self._finish_sampler()
        self.epoch, self.batches_consumed, self._started = int(epoch), 0, False

    def state_dict(self) -> dict[str, Any]:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        if sampler.iterated_elsewhere:
            raise UnsupportedStateError(
                "ResumableDataLoader: another loader iterated its sampler (what "
                "accelerator.prepare(loader) or accelerator.skip_first_batches(loader) makes of "
                "it), so the position in this state did not advance with the batches trained "
                "(a resumed run would replay them, or skip some twice after skip_first_batches). "
                "Iterate the ResumableDataLoader itself, not passed to prepare() (through "
                "Accumulation.epoch(loader) under accelerate); after restore() it continues at "
                "the saved position by itself, with nothing to skip (docs/accelerate.md)"
            )
        position = min(self.batches_consumed * self.batch_size, len(sampler))
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "started": self._started,
            "epoch_rng": self._epoch_rng,
            "persistent_iterator": self._iterator is not None,
            **({"pool_rng": self._pool_rng} if self._pool_rng is not None else {}),
            **({"origin": self._origin} if self._origin is not None else {}),
            "sampler": sampler.state_at(self.epoch, position),
        }
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    @staticmethod
    def is_state(state: Any) -> bool:
        """Whether ``state`` is one :meth:`state_dict` returned (as a checkpoint gives it back):
        a position every rank holds alike, which a run on any number of ranks resumes from."""
        sampler = state.get("sampler") if isinstance(state, Mapping) else None
        return (
            isinstance(sampler, Mapping)
            and {"batches_consumed", "batch_size"} <= state.keys()
            and {"order", "position", "num_replicas"} <= sampler.keys()
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a saved position. A state saved on another number of ranks or with another
        batch size (sharded loaders): the ranks went through the epoch in step, so together
        they took the first ``position x num_replicas`` samples of its (padded) order; the rest
        of it is sharded over the ranks here. Every rank loads the state of rank 0 (or its
        own): they all hold the same position."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        saved = state["sampler"]
        sharded = sampler.num_replicas is not None and saved.get("num_replicas") is not None
        resharded = sharded and (saved["num_replicas"], state["batch_size"]) != (
            sampler.num_replicas,
            self.batch_size,
        )
        if resharded:
            sampler.check_compatible(saved)
            trained = consumed = int(saved["position"]) * int(saved["num_replicas"])
            share = sampler.share_of(saved)  # each saving rank's indices in that epoch
            bs, drop = int(state["batch_size"]), bool(state.get("drop_last", False))
            if int(state["batches_consumed"]) >= (share // bs if drop else -(-share // bs)):
                # the saving ranks' epoch was over: what drop_last left of it stays untrained
                consumed = share * int(saved["num_replicas"])
            left = sampler.load_resharded(saved, consumed)
            batches, persistent = 0, False
        else:
            if state["batch_size"] != self.batch_size:
                raise ValueError(
                    f"ResumableDataLoader batch_size={self.batch_size} here but "
                    f"{state['batch_size']} in the checkpoint; the saved position counts "
                    "batches of the old size"
                )
            if state.get("origin", self._origin) != self._origin:
                raise ValueError(
                    "ResumableDataLoader: the checkpoint's order comes from another seed= (or "
                    "generator=) than this loader's; construct it as the interrupted run did"
                )
            if ("generator" in state) != (self.generator is not None):
                saved, here = ("with", "without") if "generator" in state else ("without", "with")
                raise ValueError(
                    f"ResumableDataLoader: the checkpoint was written by a loader {saved} its "
                    f"own generator (seed=/generator=), this one is {here}; construct it as "
                    "the interrupted run did"
                )
            saved, over = self._over_other_data(state, saved)
            sampler.load_state_dict(saved)
            batches = len(self) if over else int(state["batches_consumed"])
            persistent = bool(state.get("persistent_iterator", False))
        self.epoch = int(state["epoch"])
        self.batches_consumed = batches
        self.loaded_batches = batches
        self._started = bool(state.get("started", batches > 0))
        if "epoch_rng" in state:
            self._epoch_rng = state["epoch_rng"].clone()
        if "pool_rng" in state:
            self._pool_rng = state["pool_rng"].clone()
        if "generator" in state and self.generator is not None:
            self.generator.set_state(state["generator"].clone())
        self._restored_persistent = persistent
        if self.passes_are_epochs:  # this process's pass k is epoch k: skip the ones before
            self._skip_passes = max(0, self.epoch - self._passes)
        if resharded and sampler.rank == 0:
            rest = (
                f"epoch {self.epoch} was complete ({trained} samples trained); the next epochs "
                "are sharded over this run's ranks"
                if left == 0
                else f"the rest of epoch {self.epoch} ({left} of its samples, {trained} already "
                f"trained) is sharded over this run's ranks{self._dropped_of_rest()}, and later "
                "epochs as usual"
            )
            log.warning(
                "data loader: the checkpoint was saved on %d rank(s) with batch size %d, this run "
                "has %d with batch size %d: %s",
                saved["num_replicas"],
                state["batch_size"],
                sampler.num_replicas,
                self.batch_size,
                rest,
            )
