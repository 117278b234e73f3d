"""The stage-specific views of a ZeRO optimizer's partitions (:class:`~.views.ZeroView`'s
subclasses): ZeRO 1-2's (:class:`Zero12View`: each parameter's ``_hp_mapping`` into the flat fp32
partition) and ZeRO 3's (:class:`Zero3View`: each parameter partitioned evenly, the frozen ones
too), and :func:`view_of`, which picks the one of an engine.

Which ranks call what: every rank holds the view of its own engine; ``finish_load`` is
*collective* (every rank of the data-parallel group: ZeRO 1-2 all-gathers the bit16 partitions),
the rest reads or writes this rank's partitions only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import UnsupportedStateError
from .views import FP32, FROZEN, Fragment, ZeroView


class Zero12View(ZeroView):
    """ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``): each trainable parameter's
    ``_hp_mapping`` says which range of it this rank's flat fp32 partition holds, and where."""

    def __init__(self, engine: Any, stage: int) -> None:
        super().__init__(engine)
        self.stage = stage
        self._by_name: dict[str, tuple[Any, int]] = {}
        for gi, group in enumerate(self.optimizer.bit16_groups):
            for p in group:
                self._by_name[self.names[id(p)]] = (p, gi)

    def _flat_partitions(self) -> list[torch.Tensor]:
        return list(self.optimizer.single_partition_of_fp32_groups)

    def layout(self) -> str | None:
        """Each group's parameters in their order in the flat buffer (the order the user's
        ``model_parameters`` gave them in, or DeepSpeed's round-robin order), with their sizes
        and offsets, and the partition size: another order or grouping gives every rank other
        ranges of the same parameters."""
        opt = self.optimizer
        order = getattr(opt, "round_robin_bit16_groups", None) or opt.bit16_groups
        # sizes from DeepSpeed's meta tensors where it keeps them (an offload may empty p.data)
        sizes = getattr(opt, "round_robin_bit16_meta", None) or order
        offsets = getattr(opt, "round_robin_bit16_offsets", None) or [[]] * len(order)
        groups = [
            [
                [self.names[id(p)] for p in group],
                [m.numel() for m in meta],
                list(offs),
                flat.numel(),
            ]
            for group, meta, offs, flat in zip(
                order, sizes, offsets, self._flat_partitions(), strict=True
            )
        ]
        return hashlib.sha256(json.dumps(groups).encode()).hexdigest()[:16]

    def fragments(self) -> Iterator[Fragment]:
        flats = self._flat_partitions()
        state = self.optimizer.optimizer.state
        keys = self.moment_keys()
        for name, (p, gi) in self._by_name.items():
            hm = p._hp_mapping
            if hm is None:  # no part of this parameter is on this rank
                yield Fragment(name, tuple(p.shape), 0, 0, {})
                continue
            lp, hp = hm.lp_fragment_address, hm.hp_fragment_address
            tensors = {FP32: flats[gi].narrow(0, hp.start, hp.numel)}
            for k in keys:
                tensors[k] = state[flats[gi]][k].narrow(0, hp.start, hp.numel)
            yield Fragment(name, tuple(p.shape), lp.start, lp.numel, tensors)

    def set_fragment(self, name: str, key: str, value: torch.Tensor) -> None:
        p, gi = self._by_name[name]
        hp = p._hp_mapping.hp_fragment_address
        flat = self._flat_partitions()[gi]
        target = flat if key == FP32 else self.optimizer.optimizer.state[flat][key]
        target.narrow(0, hp.start, hp.numel).copy_(value)

    def finish_load(self) -> None:
        self.optimizer.update_lp_params()  # collective: all-gathers the bit16 partitions
        link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None and self.moment_keys():
            # what the first step does: DeepSpeed's safe_get_* APIs need it. Not while the
            # state is empty (a checkpoint of before the first step that was not skipped):
            # linked then, DeepSpeed never links again, and the moments stay out of reach
            link()


class Zero3View(ZeroView):
    """ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter is partitioned evenly
    (``ds_tensor``, padded); rank ``r`` holds ``[r * part, (r + 1) * part)`` of it."""

    stage = 3

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self._by_name: dict[str, Any] = {}
        for group in self.optimizer.fp16_groups:
            for p in group:
                self._by_name[self.names[id(p)]] = p
        # the parameters in no optimizer group (frozen, or trainable but not given to the
        # optimizer, which then never changes them), partitioned too
        self._frozen: dict[str, Any] = {
            n: p
            for n, p in engine.module.named_parameters()
            if n not in self._by_name and getattr(p, "ds_tensor", None) is not None
        }
        group = self.optimizer.dp_process_group
        self.dp_rank = (
            torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
        )

    def _flat_partitions(self) -> list[torch.Tensor]:
        return list(self.optimizer.fp32_partitioned_groups_flat)

    def _flat_groups(self) -> list[int]:
        to_group = getattr(self.optimizer, "sub_group_to_group_id", None) or {}
        return [int(to_group.get(i, 0)) for i in range(len(self._flat_partitions()))]

    def _range(self, p: Any) -> tuple[int, int]:
        part = p.ds_tensor.ds_numel
        start = min(self.dp_rank * part, p.ds_numel)
        return start, max(0, min(part, p.ds_numel - start))

    def fragments(self) -> Iterator[Fragment]:
        keys = self.moment_keys()
        for name, p in self._by_name.items():
            start, numel = self._range(p)
            tensors = {FP32: self.optimizer.get_local_fp32_param(p)[:numel]}
            for k in keys:
                tensors[k] = self.optimizer.get_local_fp32_param(p, k)[:numel]
            yield Fragment(name, tuple(p.ds_shape), start, numel, tensors)

    def frozen_fragments(self) -> Iterator[Fragment]:
        for name, p in self._frozen.items():
            start, numel = self._range(p)
            yield Fragment(name, tuple(p.ds_shape), start, numel, {FROZEN: p.ds_tensor[:numel]})

    def set_frozen(self, name: str, value: torch.Tensor) -> None:
        p = self._frozen[name]
        if p.data.numel():  # gathered now: its full copy would not see the partition change
            raise UnsupportedStateError(
                f"frozen parameter {name!r} is gathered (inside a forward pass?): restore a "
                "ZeRO-3 engine between steps"
            )
        _, numel = self._range(p)
        p.ds_tensor.data[:numel].copy_(value)

    def set_fragment(self, name: str, key: str, value: torch.Tensor) -> None:
        p = self._by_name[name]
        padded = torch.zeros(p.ds_tensor.ds_numel, dtype=torch.float32)
        padded[: value.numel()].copy_(value)
        self.optimizer.set_local_hp_param(padded, p, None if key == FP32 else key)

    def finish_load(self) -> None:
        opt = self.optimizer
        for fp32, lp in zip(
            opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat, strict=True
        ):
            if fp32.numel() > 0:
                lp.data.copy_(fp32.data)
        for sub, flat in enumerate(opt.fp16_partitioned_groups_flat):
            parts = opt.fp16_partitioned_groups[sub]
            for partitioned, q in zip(parts, opt.unflatten(flat, parts), strict=True):
                partitioned.data = q.data


def view_of(engine: Any) -> ZeroView:
    """The view of ``engine``'s ZeRO optimizer, or a clear error for what is not supported."""
    stage = int(engine.zero_optimization_stage())
    if stage in (1, 2):
        if not hasattr(engine.optimizer, "single_partition_of_fp32_groups"):
            raise UnsupportedStateError(
                f"ZeRO stage {stage}: the engine's optimizer is {type(engine.optimizer).__name__}, "
                "not DeepSpeed's ZeRO optimizer"
            )
        return Zero12View(engine, stage)
    if stage == 3:
        return Zero3View(engine)
    raise UnsupportedStateError(f"ZeRO stage {stage} has no partitions to view")
