"""Train dataloaders that resume mid-epoch: plain ``DataLoader``\\ s become
:class:`~resilient_callbacks.ResumableDataLoader`\\ s that draw exactly what they drew.

Lightning saves and restores the state of every train dataloader that has ``state_dict()`` /
``load_state_dict()`` (torchdata's ``StatefulDataLoader``, the library's
``ResumableDataLoader``); a plain ``DataLoader`` has none, so a mid-epoch resume restarts its
epoch (and Lightning warns that the result is unreliable). :func:`make_resumable` rebuilds a plain
``DataLoader`` over a map-style dataset, with a ``RandomSampler``, ``SequentialSampler`` or the
``DistributedSampler`` Lightning injects for DDP, as a ``ResumableDataLoader`` with the same
dataset, batch size, worker settings and generator, which draws exactly as the original would:
a ``RandomSampler`` shuffles from the global torch RNG (or the loader's generator), a
``DistributedSampler`` from ``seed + epoch``, and every iterator's base seed comes from where the
original took it. An uninterrupted run is therefore the run without the callback; and the
position is part of Lightning's checkpoint, so a resumed run continues with the next batch
without loading the skipped ones. (``data_seed=`` replaces a ``RandomSampler``'s randomness by
``torch.Generator().manual_seed(data_seed)``: a different order than the original loader's.)

Lightning announces a new epoch through ``dataloader.sampler.set_epoch(epoch)`` and never lets a
loader's iterator run out (it stops at the known length); a ``ResumableSampler`` passes that
call on to its ``ResumableDataLoader``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ..data import ResumableDataLoader

# DataLoader settings carried over to the rebuilt loader
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def make_resumable(loader: Any, seed: int | None = None) -> tuple[Any, str | None]:
    """Return ``(resumable loader, None)``, or ``(loader, reason)`` when it cannot be rebuilt.

    Loaders that already have ``state_dict``/``load_state_dict`` are returned unchanged with no
    reason. ``seed``: ``None`` (default) keeps the original randomness; an int shuffles a
    ``RandomSampler``'s loader from ``torch.Generator().manual_seed(seed)`` instead (a
    ``DistributedSampler`` keeps its own seed)."""
    if _is_stateful(loader):
        return loader, None
    if type(loader) is not DataLoader:
        return loader, f"{type(loader).__qualname__} is not a plain torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return loader, "it reads an IterableDataset (no indices to resume from)"
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return loader, "it uses a custom batch_sampler"
    sampler = loader.sampler
    n = len(loader.dataset)  # type: ignore[arg-type]
    kw: dict[str, Any] = {k: getattr(loader, k) for k in _CARRIED if hasattr(loader, k)}
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
    order: dict[str, Any] = {"generator": loader.generator}
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            return loader, "its RandomSampler draws with replacement or a custom num_samples"
        if sampler.generator is not loader.generator:
            return loader, "its RandomSampler has a generator other than the DataLoader's"
        if seed is not None:
            order = {"seed": seed}
    elif type(sampler) is SequentialSampler:
        order["shuffle"] = False
    elif type(sampler) is DistributedSampler:
        if sampler.drop_last:
            return loader, "its DistributedSampler drops the tail (drop_last=True)"
        if len(sampler.dataset) != n:  # type: ignore[arg-type]
            return loader, "its DistributedSampler covers another dataset"
        order.update(
            shuffle=sampler.shuffle,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            seed=sampler.seed,
        )
    else:
        own = isinstance(getattr(sampler, "generator", None), torch.Generator)
        return loader, f"its sampler is a {type(sampler).__qualname__}" + (
            " with its own generator, whose state is not saved: after any resume, the "
            "following epochs draw other orders too"
            if own
            else ""
        )
    new = ResumableDataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        **order,
        **kw,
    )
    if type(sampler) is DistributedSampler:
        new.set_epoch(sampler.epoch)
    return new, None


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


log = logging.getLogger("resilient_callbacks")

CYCLED = (
    "Lightning's CombinedLoader (mode 'max_size_cycle' or 'max_size') restarts this shorter "
    "loader within an epoch, or lets it run out before the epoch ends; rebuilt, it would number "
    "its passes as epochs of its own and no longer draw what the original draws, so it is left "
    "as it is"
)


def cycled_loaders(combined: Any) -> set[int]:
    """Indices of the train loaders a ``CombinedLoader`` in its ``max_size_cycle`` (default) or
    ``max_size`` mode restarts or exhausts within an epoch: those shorter than the longest
    (with a known length)."""
    if getattr(combined, "_mode", None) not in ("max_size_cycle", "max_size"):
        return set()
    lengths: dict[int, int] = {}
    for i, dl in enumerate(combined.flattened):
        try:
            lengths[i] = len(dl)
        except TypeError:  # no length: an iterable dataset, left alone anyway
            continue
    if len(lengths) < 2:
        return set()
    longest = max(lengths.values())
    return {i for i, n in lengths.items() if n < longest}


def prepare_train_loaders(trainer: Any, seed: int | None) -> list[str]:
    """The fit loop's train loaders made resumable where they are not (the loaders of a
    ``CombinedLoader`` replaced in place); returns why each one left as it is cannot resume
    exactly, warned about on global rank zero."""
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        return []
    loaders = list(combined.flattened)
    cycled = cycled_loaders(combined)
    changed, reasons = False, []
    for i, dl in enumerate(loaders):
        if isinstance(dl, ResumableDataLoader):
            continue  # its sampler follows Lightning's set_epoch calls by itself
        reason: str | None
        new, reason = (dl, CYCLED) if i in cycled else make_resumable(dl, seed)
        if new is not dl:
            loaders[i], changed = new, True
        elif reason is not None:
            reasons.append(reason)
            if trainer.is_global_zero and reason is CYCLED:
                log.warning(
                    "train dataloader %d: %s. A resume in the middle of an epoch restarts "
                    "its pass (a loader that is cycled has no exact resume yet); an "
                    "uninterrupted run is unchanged.",
                    i,
                    reason,
                )
            elif trainer.is_global_zero:
                log.warning(
                    "the train dataloader cannot be made resumable automatically (%s): a "
                    "resume in the middle of an epoch restarts that epoch's data. Use "
                    "resilient_callbacks.ResumableDataLoader or torchdata's "
                    "StatefulDataLoader for an exact resume.",
                    reason,
                )
    if changed:
        combined.flattened = loaders
    return reasons
