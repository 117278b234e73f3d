"""The tensors of a :class:`~.sharded.Sharded` save that are not sharded, whose copies a restore
on fewer ranks drops: it says so where the copies differed.

A tensor that is not sharded -- BatchNorm's running statistics under FSDP, a layer a
tensor-parallel plan leaves as a plain tensor, an optimizer's step counter -- is written whole
by every rank into its own file, and a restore loads each rank's own (its "home" file's). A
restore on fewer ranks has no process for the higher ranks of the save, so their copies are not
loaded. Usually that loses nothing: the copies are equal. FSDP does not synchronise buffers,
though, so a BatchNorm's statistics differ between ranks that saw different batches: then the
restore says which tensors of which ranks are not loaded. Each save records a checksum of
every such tensor in the rank's JSON (in the background, from the host copy); rank 0 of a
smaller restore reads the JSON of the ranks that are gone and compares.

Which ranks call what: :func:`checksums` in each rank's background write; :func:`gone` and
:func:`dropped` on every rank of a restore, for itself (only rank 0 has anything to read or
say); nothing here is collective.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash

from ..errors import AT_CALLER, warn_and_log
from ..filepart import PartInfo, PartReader
from .assemble import json_file
from .views import MODEL

log = logging.getLogger("resilient_callbacks")

FIELD = "plain_checksums"  # in each rank's JSON: {name: checksum} of its plain tensors


def checksums(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, str]:
    """A checksum of each of ``names`` (host tensors of ``tensors``) of the model: dtype,
    shape and bytes. (Not the optimizers': the state of a model that is not sharded at all
    would be hashed twice more at every save, and step counters are the same everywhere.)"""
    out: dict[str, str] = {}
    for name in (n for n in names if n.startswith(MODEL)):
        t = tensors[name].detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        out[name] = f"{t.dtype} {list(t.shape)} {xxhash.xxh3_64_hexdigest(raw.data)}"
    return out


def gone(rank: int, world_size: int, saved_world_size: int) -> list[int]:
    """The ranks of the save whose copies rank ``rank`` of this restore compares with what it
    loads: on rank 0, those this run has no process for; elsewhere none."""
    return list(range(world_size, saved_world_size)) if rank == 0 else []


def files(info: PartInfo) -> list[str]:
    """The JSON files of the ranks gone (:func:`gone`) that this rank reads to compare: where
    the model has tensors that are not sharded (its buffers; the optimizers' step counters
    alone are the same on every rank, and reading a JSON per rank gone is not free)."""
    if not any(str(n).startswith(MODEL) for n in info.saved.get("plain") or ()):
        return []
    return [json_file(r) for r in gone(info.rank, info.world_size, info.saved_world_size)]


def say_dropped(reader: PartReader, home: int, loaded: Any) -> None:
    """Rank 0, once its restore loaded: warn (:func:`dropped`) where the copies of the ranks
    gone differ from those it loaded (``loaded``: the JSON of rank ``home``)."""
    info = reader.info
    if not files(info):
        return
    ranks = gone(info.rank, info.world_size, info.saved_world_size)
    msg = dropped(home, loaded, {r: reader.json(json_file(r)) for r in ranks})
    if msg is not None:
        warn_and_log(log, msg, UserWarning, stacklevel=AT_CALLER)


def dropped(home: int, loaded: Any, theirs: Mapping[int, Any]) -> str | None:
    """What to say about the copies of the ranks ``theirs`` (each one's JSON) that differ from
    rank ``home``'s (``loaded``: its JSON), which this rank loaded; ``None`` when none does or
    the save recorded no checksums (written before they were)."""
    mine = loaded.get(FIELD) if isinstance(loaded, dict) else None
    if not isinstance(mine, dict):
        return None
    differ: dict[str, list[int]] = {}
    for r, meta in sorted(theirs.items()):
        other = meta.get(FIELD) if isinstance(meta, dict) else None
        if not isinstance(other, dict):
            continue
        for name, sum_ in sorted(other.items()):
            if name in mine and mine[name] != sum_:
                differ.setdefault(name, []).append(r)
    if not differ:
        return None
    names = sorted(differ)
    said = ", ".join(f"{n} (rank {', '.join(map(str, differ[n]))})" for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return (
        f"tensors that are not sharded differed between the ranks of the save, and this run has "
        f"fewer ranks: {said}{more} are not loaded; rank {home}'s values are. A buffer each "
        "rank updates itself (BatchNorm's running statistics under FSDP) diverges between ranks; "
        "if it should be the same everywhere, synchronise it before saving (e.g. "
        "torch.distributed.all_reduce, then divide by the number of ranks)"
    )
