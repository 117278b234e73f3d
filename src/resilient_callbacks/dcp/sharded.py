"""``Sharded(model, optimizer)``: the sharded state of FSDP2 (``fully_shard``), FSDP1 or tensor
parallelism (DTensors, or FSDP1's ShardedTensors: :mod:`.shards`; under FSDP1 the flat
parameters' pieces read where they lie: :mod:`.flat`) as a ``FilePart``, saved
by every rank into its own files and restored on any number of ranks (resharding), in place.

Files, under ``parts/<id>/`` of a checkpoint:

- ``rank_NNNNN.safetensors`` (each rank): the local chunks of the sharded tensors this rank
  owns (a chunk several ranks hold, as with a replicated placement, is written once, by the
  lowest rank holding it; a rank holding several boxes of one tensor writes them as
  ``name#0``, ``name#1``, ...), and every plain tensor of the state dict (optimizer ``step``
  counters; read from FSDP1's layout, those are 0-d chunks of the ranks that step them).
- ``rank_NNNNN.json`` (each rank): the state dict's non-tensor values (``param_groups``
  hyper-parameters) with references to the tensors; for optimizers saved without state, their
  ``param_groups`` (:mod:`.stateless`).

The chunk index (for every tensor: dtype, global shape, and which rank saved which box of it,
under which key) is gathered from every rank with the core's JSON collectives (again only when
some rank's layout changed since the last save) and recorded in the manifest through
:meth:`describe`; at restore it tells each rank which files hold the boxes its local shards
need, so a rank reads only those (verified), and nothing is unpickled (the restore:
:mod:`.sharded_restore`).

Which ranks call what: as every FilePart (see :mod:`resilient_callbacks.filepart`); every rank
holds a ``Sharded`` of the same model at the same place of its state. :meth:`describe` runs, on
the default group and the training thread at each save, one all-reduce (under FSDP1 it also
agrees on reading the layout directly; until some rank's optimizer has state, one more agrees
on saving it), one all-gather (JSON in uint8 tensors) when the layout changed, and under FSDP1
at such a change FSDP1's state dict and one more all-reduce (the comparison); where some chunk
of the model is replicated, one more compares the copies (:mod:`.replicated`). Reading FSDP1's
layout is not collective, so every rank reaches the all-reduce that agrees on it, whatever
happened on another. A read-only restore (``PartInfo.partial``) may leave the optimizers out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)

from .. import dist, module_versions
from ..consolidate import SHARDED_FORMAT as FORMAT  # (export finds the parts without this package)
from ..dtypes import DTYPE_TO_ST
from ..errors import UnsupportedStateError
from ..filepart import FilePart, PartInfo, PartReader, PartWriter
from ..snapshot import step_storages
from ..unchanged import frozen_storages
from . import optim_fit, replicas, replicated, sharded_restore, shards
from .assemble import json_file, tensor_file
from .chunks import index_of_ranks
from .flat import FlatLayout, Names, flat_state, is_fsdp1
from .stateless import hyperparameters
from .views import View, complete_skeleton, differences, optim_state_names, view_of

if TYPE_CHECKING:
    from ..filepart import CaptureBuffers

log = logging.getLogger("resilient_callbacks")


@dataclass
class _Pending:
    """One save's view of the state, from describe() to capture() on the training thread."""

    skeleton: Any
    local: dict[str, torch.Tensor]  # what this rank writes: its chunks (by key), plain tensors
    said: dict[str, Any]


class Sharded(FilePart):
    """The sharded state of ``model`` and its ``optimizer`` (one, several, or ``None``), as
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives it: saved per rank,
    restored with ``set_state_dict`` on the current mesh, whatever number of ranks wrote it.

    ``options``: ``StateDictOptions`` for ``get_state_dict``/``set_state_dict`` (e.g.
    ``strict=False``); not ``full_state_dict`` nor ``cpu_offload`` (it writes each rank's shards).
    The modules' versions are recorded and loaded by (:mod:`..module_versions`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Sharded(model, ...): model must be an nn.Module, got {model!r}")
        optims: tuple[torch.optim.Optimizer, ...] = (
            (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else tuple(optimizer or ())
        )
        for o in optims:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"Sharded(model, optimizer): not an optimizer: {o!r}")
        self.options = options or StateDictOptions()
        if self.options.full_state_dict or self.options.cpu_offload:
            raise UnsupportedStateError(
                "Sharded(options=...): full_state_dict/cpu_offload gather whole tensors; "
                "Sharded saves each rank's shards (leave both False)"
            )
        self.model = model
        self.optimizers = optims
        self._pending: _Pending | None = None
        self._box = shards.BoxCache()  # this rank's box of a sharded tensor
        # the last gathered chunk index: (fingerprint of this rank's chunks, index, owned)
        self._index: tuple[int, dict[str, Any], set[str]] | None = None
        self._flat_on = True  # read FSDP1's layout directly where it can (see describe())
        self._stepped: tuple[int, ...] = ()  # optimizers with state on some rank (_saved_optims)
        self._flat_kind: bool | None = None  # _flat_model(), once known
        self._fqn = Names(model)
        self._kinds = optim_fit.Fingerprints(model, self._fqn)  # the optimizers' classes and groups
        self._optim_names: list[tuple[str, str, str]] | None = None  # of the last index
        self._load: Any = None  # files_to_read()'s plan for load()
        self._versions: dict[str, int | None] | None = None  # the modules' (module_versions)
        self._replicas = replicated.Replicas()  # of the last index: compared at each save

    def __repr__(self) -> str:
        return f"Sharded({type(self.model).__name__}, {len(self.optimizers)} optimizer(s))"

    # ------------------------------------------------------------------ the state dict

    def _saved_optims(self) -> tuple[torch.optim.Optimizer, ...]:
        """Every rank (collective until every optimizer has state): the optimizers whose state
        this save holds, those with state on some rank; the others' ``param_groups`` only
        (:mod:`.stateless`). Agreed, because a rank can lack state that another has (under
        FSDP1 a rank whose range of a flat parameter holds only frozen parameters gives its
        optimizer nothing to step); per optimizer, because a second optimizer may start
        stepping later. The set grows, but at a restore of a save without their state."""
        if len(self._stepped) < len(self.optimizers):
            flags = dist.any_each([bool(o.state) for o in self.optimizers])
            self._stepped = tuple(i for i, f in enumerate(flags) if f)
        return tuple(self.optimizers[i] for i in self._stepped)

    def _state_dict(self, optims: tuple[torch.optim.Optimizer, ...]) -> dict[str, Any]:
        # An optimizer without state would take a zero step here (DCP's _init_optim_state),
        # changing its step count: only those with state, or saved with it, are asked for.
        if optims:
            # one call: DCP checks the options and maps the parameters' names once for both
            msd, osd = get_state_dict(self.model, optims, options=self.options)
        else:
            msd, osd = get_model_state_dict(self.model, options=self.options), None
        self._versions = module_versions.recorded(msd)  # what its loaders read it by
        return {"model": msd} if osd is None else {"model": msd, "optim": osd}

    # ------------------------------------------------------------------ save

    @shards.quiet
    def describe(self) -> dict[str, Any]:
        """Every rank, training thread: the chunk index of every rank (:meth:`_index_of`).

        Under FSDP1 the pieces are read where FSDP1 keeps them (:mod:`.flat`), not through its
        sharded state dict, when every rank can (agreed in the all-reduce that agrees on the
        layout); whenever the layout changes they are compared with FSDP1's own state dict
        (:func:`.views.differences`), and a difference on any rank turns this off for good.
        Otherwise, and for FSDP2 and tensor parallelism, DCP's state dict is read."""
        optims = self._saved_optims()
        view = None
        if self._flat_on and self._flat_model():  # the same on every rank
            said, view = self._describe_flat(optims)
            if said is not None:
                return said
        view = view or self._dcp_view(optims)
        fingerprint, changed = self._changed(view.mine)
        index, owned, _ = self._index_of(view.mine, fingerprint, dist.any_true(changed))
        return self._pend(view, index, owned, optims)

    def _describe_flat(
        self, optims: tuple[torch.optim.Optimizer, ...]
    ) -> tuple[dict[str, Any] | None, View | None]:
        """Every rank (collective): describe() from FSDP1's layout -- ``(said, None)``; or
        ``(None, None)`` when some rank cannot read it; or ``(None, view of FSDP1's own state
        dict)`` when, at a layout change, what was read differs from it on some rank."""
        view = self._flat_view(bool(optims))
        fingerprint, changed = self._changed(view.mine if view else {})
        refused, changed = dist.any_each([view is None, view is not None and changed])
        if refused:
            return None, None
        assert view is not None
        index, owned, gathered = self._index_of(view.mine, fingerprint, changed)
        if gathered or self._optim_names is None:
            self._optim_names = optim_state_names(index)
        complete_skeleton(view.skeleton, self._optim_names)
        dcp_view = self._differs(view, index, optims) if gathered else None
        if dcp_view is not None:
            return None, dcp_view
        return self._pend(view, index, owned, optims), None

    def _flat_view(self, with_optim: bool) -> View | None:
        """This rank's view read from FSDP1's layout, or ``None`` where it cannot be (no
        collective: every rank reaches the agreement after it, whatever happens here)."""
        try:
            layout = FlatLayout.of(self.model, self._fqn)
            if layout is None:
                return None
            state = flat_state(layout, self._fqn, self.model, self.optimizers, with_optim)
            return view_of(state.sd, state.pieces) if state else None
        except Exception as e:  # the state dict's way then reports it, on every rank alike
            log.info("Sharded: FSDP1's layout cannot be read directly: %r", e)
            return None

    def _differs(
        self, view: View, index: dict[str, Any], optims: tuple[torch.optim.Optimizer, ...]
    ) -> View | None:
        """Every rank (collective): the view of FSDP1's own state dict when the state read
        from FSDP1's layout differs from it on any rank (it is then not read directly again),
        else ``None``."""
        dcp_view = self._dcp_view(optims)
        problem = differences(view, dcp_view, index)
        if problem is not None:
            log.info("Sharded: FSDP1's layout is not read directly on this rank: %s", problem)
        if dist.any_true(problem is not None):
            self._flat_on = False
            return dcp_view
        return None

    def _pend(
        self,
        view: View,
        index: dict[str, Any],
        owned: set[str],
        optims: tuple[torch.optim.Optimizer, ...],
    ) -> dict[str, Any]:
        said = {
            "format": FORMAT,
            "world_size": dist.world_size(),
            "mesh": view.mesh,
            "optim": bool(optims),
            "optimizers": list(self._stepped) if optims else [],  # which ones hold state
            "optimizer_kinds": self._kinds(self.optimizers),
            "frozen_left_out": self.options.ignore_frozen_params,  # (not in "tensors")
            "tensors": index,
            # tensors not sharded (buffers, a TP plan's replicated layers, DDP): in every
            # rank's file; named here for inspect and export
            "plain": {
                k: [DTYPE_TO_ST[view.local[k].dtype], list(view.local[k].shape)]
                for k in sorted(view.plain)
            },
        }
        self._replicas.check(view.local)  # (collective where the layout has replicas)
        local = {k: t for k, t in view.local.items() if k in owned or k in view.plain}
        self._pending = _Pending(view.skeleton, local, said)
        return said

    def _dcp_view(self, optims: tuple[torch.optim.Optimizer, ...]) -> View:
        return view_of(self._state_dict(optims), {}, box=self._box)

    def _changed(self, mine: dict[str, list[Any]]) -> tuple[int, bool]:
        """The fingerprint of this rank's layout, and whether it differs from the last save's."""
        fingerprint = xxhash.xxh3_64_intdigest(json.dumps(mine, sort_keys=True).encode())
        return fingerprint, self._index is None or self._index[0] != fingerprint

    def _index_of(
        self, mine: dict[str, list[Any]], fingerprint: int, changed: bool
    ) -> tuple[dict[str, Any], set[str], bool]:
        """Every rank, training thread (collective when ``changed``, which every rank agreed
        on): the chunk index of every rank, the keys of the chunks this rank writes, and
        whether the index was gathered at this save.

        Gathering every rank's chunks is a JSON all-gather of O(ranks x tensors) bytes. The
        layout changes only when the model is resharded or the optimizer gains state, so it is
        gathered again only when some rank's own layout differs from its last save's (one
        all-reduce agrees on that, every rank taking the same branch), and otherwise the last
        index is reused."""
        if not changed:
            assert self._index is not None
            return self._index[1], self._index[2], False
        gathered = dist.all_gather_json(mine)
        index, owned = index_of_ranks(gathered, dist.rank())
        self._replicas = replicated.Replicas.of(gathered, dist.rank())
        self._index = (fingerprint, index, owned)
        return index, owned, True

    @shards.quiet
    def capture(self, buffers: CaptureBuffers) -> dict[str, Any]:
        """Every rank, training thread: copy this rank's chunks and plain tensors into the
        reused host buffers. Parameters and optimizer state change only at an optimizer step:
        with ``overlap_snapshot=True`` they are copied while the next forward/backward runs, and
        the optimizers' next ``step()`` waits for the copy."""
        pending, self._pending = self._pending, None
        if pending is None:  # not driven by the core (which calls describe() first)
            self.describe()
            pending, self._pending = self._pending, None
            assert pending is not None
        # frozen parameters in no optimizer: the only pieces a save may know unchanged
        frozen = frozen_storages({"model": self.model, "optimizers": list(self.optimizers)})
        vouched = {
            k: t for k, t in pending.local.items() if t.untyped_storage().data_ptr() in frozen
        }
        rest = {k: t for k, t in pending.local.items() if k not in vouched}
        copies = buffers.copy(rest, step_only=self._step_storages())
        copies.update(buffers.copy(vouched, frozen=True))
        said: dict[str, Any] = {"format": FORMAT, "skeleton": pending.skeleton}
        said[module_versions.FIELD] = self._versions  # of the modules (None: not recorded)
        if len(pending.said["optimizers"]) < len(self.optimizers):  # no state: a learning rate
            said["groups"] = hyperparameters(self.optimizers)
        return {"tensors": copies, "json": said, "plain": sorted(pending.said["plain"])}

    def stepped_by(self) -> tuple[torch.optim.Optimizer, ...]:
        return self.optimizers

    @shards.quiet
    def host_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's pieces as describe() reads them, without its collectives (for the host
        buffers made ahead of the first save): FSDP1's layout, or DCP's state dict of DTensors.
        Nothing for FSDP1 read through its own state dict, which is collective."""
        optims = tuple(o for o in self.optimizers if o.state)
        if self._flat_on and self._flat_model():
            view = self._flat_view(bool(optims))
            return dict(view.local) if view is not None else {}
        if is_fsdp1(self.model):
            return {}
        return dict(self._dcp_view(optims).local)

    def _step_storages(self) -> set[int]:
        """Storages of the local shards that only an optimizer step changes."""
        return step_storages([self.model], self.optimizers, local=shards.local)

    def write(self, captured: dict[str, Any], writer: PartWriter) -> None:
        writer.tensors(tensor_file(writer.rank), captured["tensors"])
        sums = replicas.checksums(captured["tensors"], captured.get("plain", ()))  # (host copies)
        writer.json(json_file(writer.rank), {**captured["json"], replicas.FIELD: sums})

    # ------------------------------------------------------------------ restore

    @shards.quiet
    def files_to_read(self, info: PartInfo) -> list[str]:
        """The home JSON (this rank's, or rank 0's for a rank the save did not have) and the
        tensor files holding a box that overlaps a local shard this rank needs."""
        return sharded_restore.files_to_read(self, info)

    def _flat_model(self) -> bool:
        """Whether saves read FSDP1's layout directly and restores write its pieces in place
        (:mod:`.flat`, :mod:`.flat_restore`), as the model and its optimizers tell: the same
        answer on every rank, found once (it walks the modules)."""
        if self._flat_kind is None:
            self._flat_kind = (
                len(self.optimizers) <= 1
                and self.options == StateDictOptions()
                and FlatLayout.sharded_flat(self.model)
            )
        return self._flat_kind

    @shards.quiet
    def load(self, reader: PartReader) -> None:
        sharded_restore.load(self, reader)
