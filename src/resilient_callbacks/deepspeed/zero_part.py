"""ZeroPart: a ZeRO 1-3 engine's partitioned optimizer state as a :class:`~..filepart.FilePart`.

Each rank writes its own ranges of every trainable parameter (see :mod:`.views`):
``rank_NNNNN.safetensors`` holds ``fp32/<name>`` and ``<moment>/<name>`` for each parameter
it holds a piece of, ``rank_NNNNN.json`` the ranges (start and length in the flattened
parameter, its shape), the optimizer's step counts and hyper-parameters, and the loss scaler's
state. Nothing is pickled and nothing is gathered at save time.

Restore on the same data-parallel size reads only the rank's own two files. On another size
(2 -> 1, 1 -> 2), or another ZeRO stage, each rank reads the files of every saved rank and copies
the overlap of each saved range with each range it now holds: no offline conversion.

Which ranks call what follows :class:`~..filepart.FilePart`; :meth:`ZeroPart.load` is
collective (it refreshes the low-precision parameters with an all-gather), as every rank loads.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    caller_stacklevel,
    warn_and_log,
)
from ..filepart import FilePart, PartInfo, PartReader, PartWriter
from .stage_views import view_of
from .views import FP32, FROZEN, Fragment, ZeroView, overlap

log = logging.getLogger("resilient_callbacks")

if TYPE_CHECKING:
    from ..filepart import CaptureBuffers

FORMAT = "zero-fragments/1"


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """``{name: first name}`` of each parameter ``module`` holds under several names (tied
    weights), for the names after the first."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _files(rank: int) -> tuple[str, str]:
    return f"rank_{rank:05d}.safetensors", f"rank_{rank:05d}.json"


class ZeroPart(FilePart):
    """The partitioned state of a ZeRO stage 1, 2 or 3 ``DeepSpeedEngine``: fp32 master weights
    and optimizer moments by parameter range, step counts, hyper-parameters, loss scale."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.view: ZeroView = view_of(engine)
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world_size = (
            torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        )
        self._layout = self.view.layout()  # (the groups do not change while the engine lives)
        # a tied weight (GPT-2's lm_head and wte) is one parameter, saved under its first name:
        # export writes it under each name, as engine.module.state_dict() and zero_to_fp32 do
        self._tied = tied_names(engine.module)
        # the optimizer's hyper-parameters as this run configured them, before a restore or a
        # step changed them: saved, so that a resume can tell a change of the config from a
        # change the schedule made (warn_changed_hyperparameters)
        self._configured = configured_hyperparameters(engine)

    # ------------------------------------------------------------------ save

    @torch.no_grad()
    def capture(self, buffers: CaptureBuffers) -> Any:
        trained, frozen = list(self.view.fragments()), list(self.view.frozen_fragments())
        live = _live(trained)
        # through the core's snapshot: on a GPU, copies on a side stream that the training
        # stream waits for on the GPU (the CPU does not wait); with overlap_snapshot=True the
        # ranges, which only the inner optimizer's step changes, are copied while the next
        # forward and backward run, and that step waits for them (stepped_by)
        stepped = {t.untyped_storage().data_ptr() for t in live.values() if t.numel()}
        tensors = buffers.copy(live, step_only=stepped if self.stepped_by() else None)
        # ZeRO 3's frozen partitions: in no optimizer, so with incremental=True a partition
        # known unchanged since the last committed save is not copied again
        if frozen:
            tensors.update(buffers.copy(_live(frozen), frozen=True))
        # the one-value tensors of the index (step counts, a learning rate that is a tensor)
        # are copied like the ranges, before the next step changes them; write() reads their
        # numbers from the host copies (an .item() here would wait for the GPU)
        scalars, found = self.view.scalars(), list[torch.Tensor]()
        _map_tensors(scalars, found.append)  # in the order the second walk meets them
        held = {f"{_SCALAR}{i}": t for i, t in enumerate(found)}
        copies = buffers.copy(held) if held else {}
        copied = iter([copies[f"{_SCALAR}{i}"] for i in range(len(found))])
        index = {
            "format": FORMAT,
            "rank": self.rank,
            "zero_stage": self.view.stage,
            "keys": [FP32, *self.view.moment_keys()],
            "params": _ranges(trained),
            **({"frozen": _ranges(frozen)} if frozen else {}),
            "configured_param_groups": self._configured,
            **_map_tensors(scalars, lambda _: next(copied)),
        }
        return tensors, index

    def stepped_by(self) -> tuple[torch.optim.Optimizer, ...]:
        """The torch optimizer inside the engine's ZeRO optimizer, whose ``step()`` is where the
        fp32 ranges and moments change: DeepSpeed's ``step()`` first reduces, unscales and
        clips gradients (other tensors), then calls it once per parameter group (ZeRO 1-2) or
        sub-group (ZeRO 3, also when offloaded to the CPU), then copies the new fp32 values into
        the low-precision parameters. Empty (no copy deferred) where something else writes the
        optimizer's state before that step: DeepSpeed's Muon (its momentum is committed first),
        ZenFlow (its own CPU step)."""
        zero = self.engine.optimizer
        inner = getattr(zero, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            return ()
        muon = "muon" in type(inner).__name__.lower() or getattr(zero, "use_muon", False)
        if muon or getattr(zero, "zenflow", False):
            return ()
        return (inner,)

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors capture() copies, by its buffer names (for buffers made ahead): each
        trained parameter's ranges (fp32 and moments) and, at ZeRO 3, each frozen one's."""
        return _live([*self.view.fragments(), *self.view.frozen_fragments()])

    def write(self, captured: Any, writer: PartWriter) -> None:
        tensors, index = captured
        index = _map_tensors(index, lambda t: t.item())  # host copies, complete by now
        st, js = _files(self.rank)
        writer.tensors(st, tensors)
        writer.json(js, index)

    def describe(self) -> Mapping[str, Any]:
        return {
            "format": FORMAT,
            "zero_stage": self.view.stage,
            "dp_world_size": self.world_size,
            "dtype": str(next(self.engine.module.parameters()).dtype).replace("torch.", ""),
            **({"layout": self._layout} if self._layout else {}),
            **({"tied": self._tied} if self._tied else {}),
        }

    # ------------------------------------------------------------------ restore

    def files_to_read(self, info: PartInfo) -> list[str]:
        saved = info.saved
        if saved.get("format") not in (None, FORMAT):
            raise CheckpointMismatchError(
                f"part {info.part_id!r} was written in format {saved.get('format')!r}; this "
                f"version reads {FORMAT!r}"
            )
        return [name for r in self._ranks_to_read(info) for name in _files(r)]

    def _ranks_to_read(self, info: PartInfo) -> list[int]:
        ranks = sorted({r for name, r in info.listed.items() if name.startswith("rank_")})
        family = {1: "1-2", 2: "1-2", 3: "3"}
        same = (
            info.saved.get("dp_world_size") == self.world_size
            and family.get(info.saved.get("zero_stage", -1)) == family[self.view.stage]
            # the parameters in another order or grouping: other ranges on every rank (a
            # checkpoint of before this record: taken as the same)
            and info.saved.get("layout", self._layout) == self._layout
        )
        if same and self.rank in ranks:
            return [self.rank]  # the same partitioning: this rank's own files hold its ranges
        return ranks

    @torch.no_grad()
    def load(self, reader: PartReader) -> None:
        saved_ranks = self._ranks_to_read(reader.info)
        if not saved_ranks:
            raise CheckpointCorruptError(f"part {reader.info.part_id!r} lists no rank files")
        indexes = {r: reader.json(_files(r)[1]) for r in saved_ranks}
        tensors = {r: reader.tensors(_files(r)[0]) for r in saved_ranks}
        first = indexes[saved_ranks[0]]
        keys = list(first["keys"])
        self.view.check_optimizer(first)
        missing_keys = set(self.view.moment_keys()) - set(keys)
        if missing_keys:
            raise CheckpointMismatchError(
                f"the checkpoint holds no optimizer state {sorted(missing_keys)} (saved: "
                f"{first['keys']}): was it written with another optimizer?"
            )
        self.view.ensure_moments(keys)
        needed = self.view.needed()
        known = set(first["params"])
        absent = sorted(set(needed) - known)
        extra = sorted(known - set(needed))
        _refuse_a_freeze_change(absent, extra, first, self.view)
        if absent or extra:
            raise CheckpointMismatchError(
                "the checkpoint's parameters differ from the engine's: "
                + (f"missing from the checkpoint: {absent[:5]} " if absent else "")
                + (f"not in the model: {extra[:5]}" if extra else "")
            )
        for name, (shape, start, numel) in needed.items():
            if list(shape) != first["params"][name]["shape"]:
                raise CheckpointMismatchError(
                    f"parameter {name!r}: shape {list(shape)} in the model, "
                    f"{first['params'][name]['shape']} in the checkpoint"
                )
            if numel == 0:
                continue
            for key in keys:
                out = _assemble(name, key, "params", start, numel, saved_ranks, indexes, tensors)
                self.view.set_fragment(name, key, out)
        self._load_frozen(saved_ranks, indexes, tensors)
        warn_changed_hyperparameters(
            first.get("configured_param_groups"), self._configured, self.engine
        )
        self.view.load_scalars(first, self._same_dtype(reader.info.saved.get("dtype")))
        self.view.finish_load()

    def _same_dtype(self, saved: Any) -> bool:
        """Whether the checkpoint was trained in this engine's dtype; warns where not (the
        loss scaler's state is then left as the engine made it)."""
        now = self.describe()["dtype"]
        if saved is None or saved == now:
            return True
        warn_and_log(
            log,
            f"the checkpoint was trained in {saved}, this engine in {now}: the weights and "
            f"optimizer state are restored, the loss scale is not (the {now} engine's own "
            "loss scaler, as configured, starts afresh)",
            UserWarning,
        )
        return False

    def _load_frozen(
        self,
        saved_ranks: list[int],
        indexes: dict[int, Any],
        tensors: dict[int, dict[str, torch.Tensor]],
    ) -> None:
        """ZeRO 3: each frozen parameter's range, from the saved ranks' ranges of it."""
        here = {f.name: f for f in self.view.frozen_fragments()}
        saved = indexes[saved_ranks[0]].get("frozen", {})
        lacking = set(here) - set(saved)
        trainable = {n for n, p in self.engine.module.named_parameters() if p.requires_grad}
        if lacking and lacking <= trainable:  # not given to the optimizer: a checkpoint of
            warn_untrained_absent(sorted(lacking))  # before they were saved keeps this run's
            here = {n: f for n, f in here.items() if n not in lacking}
        if set(here) != set(saved):
            raise CheckpointMismatchError(
                "the checkpoint's frozen ZeRO-3 parameters differ from the engine's: "
                f"saved {sorted(saved)[:5]}, the engine's {sorted(here)[:5]}"
            )
        for name, f in here.items():
            if list(f.shape) != saved[name]["shape"]:
                raise CheckpointMismatchError(
                    f"frozen parameter {name!r}: shape {list(f.shape)} in the model, "
                    f"{saved[name]['shape']} in the checkpoint"
                )
            if f.numel:
                out = _assemble(
                    name, FROZEN, "frozen", f.start, f.numel, saved_ranks, indexes, tensors
                )
                self.view.set_frozen(name, out)


def _refuse_a_freeze_change(
    absent: list[str], extra: list[str], saved: Any, view: ZeroView
) -> None:
    """Name the parameters frozen (``requires_grad=False``) in one run and trained in the
    other, where that is why the trained parameters differ (ZeRO 3 saves frozen ones apart)."""
    frozen_then = [n for n in absent if n in saved.get("frozen", {})]
    frozen_now_names = {f.name for f in view.frozen_fragments()}
    frozen_now = [n for n in extra if n in frozen_now_names]
    if not (frozen_then or frozen_now):
        return
    change = "; ".join(
        [f"frozen when saved, trained now: {frozen_then[:5]}"] * bool(frozen_then)
        + [f"trained when saved, frozen now: {frozen_now[:5]}"] * bool(frozen_now)
    )
    raise CheckpointMismatchError(
        f"parameters changed between frozen (requires_grad=False) and trained: {change}. At "
        f"ZeRO {view.stage} frozen parameters are saved apart from the optimizer's partitions, "
        "so the saved state does not fit. Freeze the same parameters as the run that saved "
        "it, or start a new run from the saved weights (`resilient-ckpt export DIR OUT` "
        "writes them whole)"
    )


def warn_untrained_absent(names: list[str]) -> None:
    """Every rank, at restore: the checkpoint holds no values of ``names``, parameters that
    require grad but are in no optimizer group, saved only since 2026-12-06: they keep this
    run's values (the version that wrote the checkpoint resumed so)."""
    warn_and_log(
        log,
        f"restore: the checkpoint holds no values of {', '.join(names[:5])}"
        f"{' ...' if len(names) > 5 else ''}, which require grad but are in no optimizer "
        "parameter group (a checkpoint written before resilient_callbacks saved them, "
        "2026-12-06): they keep this run's values. The optimizer never changes them, so with "
        "the saving run's initialisation (its seed) they are the saved ones",
        stacklevel=caller_stacklevel(),
    )


# set by an LR scheduler at every step (OneCycle cycles the momentum or betas too), from its
# own settings: a change of them in the optimizer's config does not reach the training
_SCHEDULED = frozenset({"lr", "initial_lr", "betas", "momentum"})


# each engine's hyper-parameters as first read, before a restore or a step changed them
_CONFIGURED: weakref.WeakKeyDictionary[Any, list[dict[str, Any]]] = weakref.WeakKeyDictionary()


def configured_hyperparameters(engine: Any) -> list[dict[str, Any]]:
    """The hyper-parameters of each of the engine's optimizer parameter groups, as JSON values
    (of the torch optimizer: the one a ZeRO optimizer or ZeRO 0's fp16/bf16 wrapper steps),
    as they were when first read for this engine: an adapter that builds the engine's state
    again after the restore or for a save (Lightning's) records the values the engine was built
    with, not the restored or scheduled ones (which warned at every later resume)."""
    if engine not in _CONFIGURED:
        groups = getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups
        _CONFIGURED[engine] = [
            {k: _comparable(v) for k, v in g.items() if k != "params"} for g in groups
        ]
    return _CONFIGURED[engine]


def warn_changed_hyperparameters(
    saved: list[dict[str, Any]] | None, now: list[dict[str, Any]], engine: Any
) -> None:
    """Rank 0, at restore: say which hyper-parameters the config (or the optimizer given to
    ``initialize``) changed since the checkpoint was written, each as the two runs configured
    it, as the resume trains on with the saved ones (those of the run that stopped, as
    DeepSpeed's ``load_checkpoint`` and torch's ``load_state_dict`` restore them). Compared
    are the values the two engines were built with, not the saved ones: an lr that a schedule
    (or the script, by hand) changed while training is no change. A checkpoint of before they
    were recorded (``saved`` None) is not compared."""
    if not saved or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    skip = _SCHEDULED if getattr(engine, "lr_scheduler", None) is not None else frozenset()
    changed = [
        (k, f"{k}{f' (group {i})' if len(now) > 1 else ''}: {v!r} saved, {live[k]!r} now")
        for i, (live, then) in enumerate(zip(now, saved, strict=False))
        for k, v in then.items()
        if k not in skip and k in live and v != live[k]
    ]
    if not changed:
        return
    warn_and_log(
        log,
        "restore: the optimizer's hyper-parameters were configured otherwise when the "
        "checkpoint was written: "
        + "; ".join(text for _, text in changed[:6])
        + f"{' ...' if len(changed) > 6 else ''}. The saved values are restored: the run goes "
        "on as the one that stopped (as DeepSpeed's load_checkpoint does). To train on with "
        "the new values, set them after the restore (`for g in optimizer.param_groups: "
        f"g[{changed[0][0]!r}] = ...`; a configured LR scheduler sets lr itself), or start a "
        "new run from the saved weights (`resilient-ckpt export DIR OUT` writes them whole)",
        UserWarning,
        # (past torch.no_grad's wrapper of ZeroPart.load, to the call into the library)
        stacklevel=caller_stacklevel(os.path.dirname(torch.utils.__file__)),
    )


def _comparable(value: Any) -> Any:
    """A hyper-parameter as a JSON value: a tensor as its numbers, tuples as lists, what JSON
    cannot hold as its ``repr``."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


_SCALAR = "index-scalar/"  # the buffer names of the index's one-value tensors


def _map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` (JSON values in dicts and lists) with each tensor replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    return obj


def _live(fragments: list[Fragment]) -> dict[str, torch.Tensor]:
    """The live tensors of ``fragments`` by the names the part's file gives them."""
    return {f"{key}/{f.name}": live for f in fragments for key, live in f.tensors.items()}


def _ranges(fragments: list[Fragment]) -> dict[str, dict[str, Any]]:
    """The index entry of each fragment: the parameter's shape and this rank's range of it."""
    return {f.name: {"shape": list(f.shape), "start": f.start, "numel": f.numel} for f in fragments}


def _assemble(
    name: str,
    key: str,
    section: str,
    start: int,
    numel: int,
    saved_ranks: list[int],
    indexes: dict[int, Any],
    tensors: dict[int, dict[str, torch.Tensor]],
) -> torch.Tensor:
    """The range ``[start, start + numel)`` of parameter ``name``'s ``key`` tensor, laid
    together from the overlapping ranges the saved ranks recorded under ``section`` of their
    indexes (in the saved dtype); every value must be covered, and by one saved rank only (two
    saved ranges that overlap leave as many values uncovered as they share: counting the
    copied values did not see that, and those values were left as ``torch.empty`` made them)."""
    out: torch.Tensor | None = None
    pieces: list[tuple[int, int, int]] = []  # (start, numel, saved rank) of each copied range
    for r in saved_ranks:
        rng = indexes[r][section][name]
        lo, n = overlap(start, numel, rng["start"], rng["numel"])
        if n == 0:
            continue
        src = tensors[r][f"{key}/{name}"]
        if out is None:
            out = torch.empty(numel, dtype=src.dtype)
        out.narrow(0, lo - start, n).copy_(src.narrow(0, lo - rng["start"], n))
        pieces.append((lo, n, r))
    at, covered = start, sum(n for _, n, _ in pieces)
    for lo, n, r in sorted(pieces):
        if lo < at:
            raise CheckpointCorruptError(
                f"parameter {name!r} ({key}): saved rank {r}'s range of it overlaps another "
                f"saved rank's (values {lo} to {at - 1}): the checkpoint's partitions do not fit "
                "together"
            )
        if lo > at:
            break  # a gap: values [at, lo) are in no saved rank's range
        at = lo + n
    if out is None or at != start + numel:
        raise CheckpointCorruptError(
            f"parameter {name!r} ({key}): the checkpoint's ranks cover {covered} of the {numel} "
            f"values this rank needs (value {at} of the parameter is in none of them)"
        )
    return out
