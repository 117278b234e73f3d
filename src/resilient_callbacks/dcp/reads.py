"""What a rank of a :class:`~.sharded.Sharded` restore reads: for each tensor of its state
dict, the box it needs and the saved index entry the box is assembled from, the ranks whose
files hold an overlapping box, and why the checkpoint does not fit, found before anything is
loaded.

Which ranks call what: every rank, for itself, in ``Sharded.files_to_read``; nothing here is
collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointMismatchError
from ..fit import MATERIALIZE
from . import shards
from .assemble import full_box, whole_entry
from .chunks import Box
from .views import MODEL, dtype_code

log = logging.getLogger(__name__)


@dataclass
class Reads:
    ranks: set[int]
    needs: dict[str, Box] = field(default_factory=dict)
    entries: dict[str, Any] = field(default_factory=dict)  # index entries assembled from boxes
    problems: list[str] = field(default_factory=list)


def plan_reads(
    tensors: Mapping[str, torch.Tensor],
    index: Mapping[str, Any],
    plain: Any,
    home: int,
    strict: bool,
    box: Callable[[str, Any], Box],
    with_optim: bool = True,
) -> Reads:
    """``tensors``: this rank's state dict (flattened); ``index``: the saved chunk index;
    ``plain``: the saved tensors that were not sharded, ``{name: [dtype, shape]}`` (None: a
    checkpoint from before they were recorded; one is refused when its dtype or shape changed,
    a model's also, with ``strict``, when the model lacks it); ``home``: the rank whose files
    hold the plain tensors; ``strict``: a model tensor missing from the checkpoint, or one the model lacks, is a
    problem; ``box``: this rank's box of a sharded tensor; ``with_optim``: False when the saved
    optimizer state is not loaded (a read-only restore of the model alone)."""
    out = Reads(ranks={home})
    retyped: set[bool] = set()  # (_misfit)
    for name, t in tensors.items():
        entry = index.get(name)
        if entry is None:
            said = plain.get(name) if isinstance(plain, dict) else None
            if isinstance(plain, dict) and name not in plain and name.startswith(MODEL):
                if strict:  # neither sharded nor whole: refused before anything loads
                    out.problems.append(f"{name}: not in the checkpoint")
                continue
            checked = name.startswith(MODEL) or not name.endswith("/step")  # (not cast)
            if checked and isinstance(said, list) and len(said) == 2:
                # saved whole (a buffer, an optimizer's 0-d state): the loads cast another
                # dtype in silence, DCP's refuses another shape only after loading the rest
                fits = upcast(name, t, said[0], said[1])  # (FSDP1's buffer_dtype -> FSDP2)
                problem = None if fits else _misfit(name, t, said[0], said[1], retyped)
                if problem is not None:
                    out.problems.append(problem)
                    continue
            if shards.is_sharded(t):  # saved whole (FSDP1 on one rank is NO_SHARD)
                out.needs[name] = box(name, t)
                out.entries[name] = whole_entry(name, t, home)
            continue  # a plain tensor: the home file's
        problem = _misfit(name, t, entry["dtype"], entry["shape"], retyped)
        if problem is not None:
            out.problems.append(problem)
            continue
        # a plain tensor here that was saved sharded (resumed on one FSDP1 rank) is whole
        need = out.needs[name] = box(name, t) if shards.is_sharded(t) else full_box(t)
        out.entries[name] = entry
        for r, offsets, sizes, *_ in entry["chunks"]:
            if need.intersect(Box.of(offsets, sizes)) is not None and need.numel:
                out.ranks.add(int(r))
    whole = [n for n in plain if n.startswith(MODEL)] if isinstance(plain, dict) else []
    saved = set(index) | set(whole)
    unexpected = sorted(
        n
        for n in saved - set(tensors)
        if (strict or not n.startswith(MODEL)) and (with_optim or n.startswith(MODEL))
    )
    out.problems += [f"{n}: in the checkpoint, not in this model/optimizer" for n in unexpected]
    return out


RETYPED = (
    "the dtype changed since the save: resume with the model in the dtype it was saved in "
    "(build it so, or .to() that dtype before sharding it); to go on in the new dtype, load "
    "the saved model alone -- Sharded(model), the model in the saved dtype, through a "
    "Checkpointer opened with read_only=True -- cast it, and save into a new dirpath (the "
    "optimizer's state starts afresh)"
)
RETYPED_STATE = (
    "the optimizer keeps this state in another dtype than the save did: resume with the "
    "optimizer configured as it was; to go on with the new one, load the saved model alone "
    "-- Sharded(model) through a Checkpointer opened with read_only=True -- and save into a "
    "new dirpath (the optimizer's state starts afresh)"
)


_LOW = ("BF16", "F16")  # the dtypes FSDP1's MixedPrecision(buffer_dtype=...) casts buffers to


def upcast(name: str, t: torch.Tensor, dtype: Any, shape: Any) -> bool:
    """Whether the model's buffer ``name``, saved whole in ``dtype`` (a safetensors code) and
    ``shape``, is loaded into the live ``t`` by a cast that loses nothing: saved BF16 or F16,
    held now as F32 or F64, the same shape (logged at INFO). FSDP1 casts the buffers in place
    to ``MixedPrecision(buffer_dtype=...)`` and saves them so; FSDP2 keeps them as built, and
    nothing records which wrote a checkpoint: moved from FSDP1 to FSDP2, such a resume was
    refused (the copy casts, as FSDP1's own cast did from the built dtype). Parameters are
    sharded and checked apart (another model dtype is still refused there), and every other
    change of a buffer's dtype -- F32 to F64, a narrowing one, to or from an integer -- still is."""
    if not name.startswith(MODEL) or dtype not in _LOW or list(t.shape) != list(shape):
        return False
    if t.dtype not in (torch.float32, torch.float64):
        return False
    log.info(
        "%s: saved %s, this model holds it as %s; loaded by a cast (a buffer FSDP1's "
        "MixedPrecision(buffer_dtype=...) kept in %s)",
        name,
        dtype,
        dtype_code(name, t),
        dtype,
    )
    return True


def _misfit(name: str, t: torch.Tensor, dtype: Any, shape: Any, hinted: set[bool]) -> str | None:
    """:func:`misfit` of the live tensor ``t``."""
    return misfit(name, (dtype_code(name, t), list(t.shape)), (dtype, shape), hinted)


def misfit(
    name: str, have: tuple[str, list[int]], saved: tuple[Any, Any], hinted: set[bool]
) -> str | None:
    """Why a live tensor of dtype and shape ``have`` (a safetensors dtype code, a list) does not
    take the ``saved`` ones, or ``None``. Where only the dtype changed, the first model tensor
    and the first optimizer state (``hinted``: which of them were) say what to do."""
    (code, shape), (dtype, saved_shape) = have, saved
    if shape == list(saved_shape) and code == dtype:
        return None
    said = f"{name}: saved {dtype} {list(saved_shape)}, this model has {code} {shape}"
    model = name.startswith(MODEL)
    if shape != list(saved_shape) or model in hinted:
        return said
    hinted.add(model)
    return f"{said} ({RETYPED if model else RETYPED_STATE})"


def live_state(part_id: str, take: Callable[[], Any]) -> Any:
    """``take()`` -- the live model's and optimizers' state dict, before anything is read --
    with its failure as a refusal of the restore (``CheckpointMismatchError``): it comes from
    the live objects, not the checkpoint (DCP's ``get_state_dict`` steps an optimizer without
    state once, with zero gradients, calling ``step(closure=None)``). As any other error it
    was taken for a damaged checkpoint, and the restore fell back past valid ones."""
    try:
        return take()
    except Exception as e:
        raise CheckpointMismatchError(
            f"part {part_id!r}: the live model's and optimizers' state dict cannot be taken "
            f"(torch.distributed.checkpoint's get_state_dict raised {type(e).__name__}: {e}); "
            "nothing was loaded. An optimizer that has no state yet is stepped once with zero "
            "gradients by it, as step(closure=None)"
        ) from e


def frozen_hint(problems: list[str], saved_left_out: bool, left_out: bool) -> list[str]:
    """``problems`` of the model's fit, led by what to pass when the checkpoint and this
    ``Sharded`` disagree on ``StateDictOptions(ignore_frozen_params=...)`` (``saved_left_out``:
    the save left the frozen parameters out; ``left_out``: this restore does)."""
    if not problems or saved_left_out == left_out:
        return problems
    if saved_left_out:
        hint = (
            "the checkpoint was saved without the frozen parameters (StateDictOptions("
            "ignore_frozen_params=True)): restore with Sharded(..., options=StateDictOptions("
            "ignore_frozen_params=True)), which keeps the frozen parameters the model holds"
        )
    else:
        hint = (
            "the checkpoint holds the frozen parameters, which this Sharded leaves out "
            "(ignore_frozen_params=True): restore without it to load them"
        )
    return [hint, *problems]


def on_meta(model: torch.nn.Module) -> list[str]:
    """The problem, if any, of a model whose parameters or persistent buffers are on the meta
    device (built under ``torch.device("meta")`` and not yet allocated): a restore would copy
    into tensors that hold no values and report success, leaving the model as it was (a run
    that allocates and initialises it afterwards trains on from fresh weights, at the restored
    step)."""
    names = [n for n, p in model.named_parameters() if p.is_meta]
    for prefix, module in model.named_modules():
        for n, b in module.named_buffers(recurse=False):
            if b.is_meta and n not in module._non_persistent_buffers_set:
                names.append(f"{prefix}.{n}" if prefix else n)
    if not names:
        return []
    more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
    return [
        f"{', '.join(names[:5])}{more}: on the meta device, which holds no values: loading "
        f"into them does nothing. {MATERIALIZE}"
    ]


def refuse(part_id: str, problems: list[str]) -> None:
    """Raise :class:`CheckpointMismatchError` naming ``problems`` (the first ten), if any."""
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointMismatchError(
            f"part {part_id!r} does not fit this model: " + "; ".join(problems[:10]) + more
        )


def refuse_missing(missing: Iterable[str], strict: bool) -> None:
    """Raise :class:`CheckpointMismatchError` naming the tensors of ``missing`` (asked for by
    the live state dict, neither in the chunk index nor among the tensors saved whole) that
    must be loaded: the optimizers' always, the model's with ``strict``."""
    names = sorted(n for n in missing if strict or not n.startswith(MODEL))
    if names:
        more = f" (and {len(names) - 10} more)" if len(names) > 10 else ""
        raise CheckpointMismatchError(
            "the checkpoint does not fit this model: "
            + "; ".join(f"{n}: not in the checkpoint" for n in names[:10])
            + more
        )
