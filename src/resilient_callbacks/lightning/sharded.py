"""Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallelism) and
``FSDPStrategy`` (FSDP1): the callback's state with the weights and optimizer states as a
:class:`~resilient_callbacks.dcp.Sharded` part instead of Lightning's dumped dictionaries.
``DeepSpeedStrategy`` takes the same path with the DeepSpeed engine's state in place of the
``Sharded`` part (see :mod:`.deepspeed`).

Under these strategies each rank holds shards. Lightning's own ``dump_checkpoint`` would gather
them on every save (``get_model_state_dict(..., cpu_offload=True)``, FSDP1's full state dict) or
write DCP's pickled format (``FSDPStrategy(state_dict_type="sharded")``); here it is called with
the strategy's ``lightning_module_state_dict``/``optimizer_state`` answering empty, and the
shards are saved by every rank into its own files (:class:`Sharded`), restored on any number of
ranks. These strategies restore checkpoints after their setup (the model is sharded and the
optimizers exist when ``resume_start`` runs) and leave loading the weights and optimizer states
to whoever read the checkpoint: that is :meth:`Sharded.load`, inside the core's restore.

What a user's ``on_save_checkpoint(checkpoint)`` hook sees differs in one way: its
``checkpoint["state_dict"]`` and ``["optimizer_states"]`` are empty (they are saved apart).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from ..state_marks import PerRank
from . import deepspeed as ds
from . import quiet
from . import state as st

PART_KEYS = ("sharded", "engine")  # the FSDP/tensor-parallel Sharded part; DeepSpeed's engine


def strategy_classes() -> tuple[type, ...]:
    """The strategies whose weights and optimizer states a :class:`Sharded` part saves:
    ``ModelParallelStrategy`` (FSDP2, tensor parallelism: DTensors) and ``FSDPStrategy`` (FSDP1:
    ShardedTensors, or DTensors given a device mesh)."""
    out: list[type] = []
    try:
        from lightning.pytorch.strategies import ModelParallelStrategy

        out.append(ModelParallelStrategy)
    except ImportError:  # pragma: no cover - Lightning < 2.4
        pass
    from lightning.pytorch.strategies import FSDPStrategy

    out.append(FSDPStrategy)
    return tuple(out)


def is_sharded(trainer: pl.Trainer) -> bool:
    """Whether the trainer's strategy keeps sharded state that a part saves: FSDP's or tensor
    parallelism's (:class:`Sharded`) or a DeepSpeed engine's ZeRO partitions."""
    return isinstance(trainer.strategy, strategy_classes()) or ds.is_deepspeed(trainer)


@contextlib.contextmanager
def _weights_left_out(strategy: Any) -> Iterator[None]:
    """``dump_checkpoint`` without gathering the weights and optimizer states."""
    strategy.lightning_module_state_dict = dict
    strategy.optimizer_state = lambda optimizer: {}
    try:
        yield
    finally:
        del strategy.lightning_module_state_dict
        del strategy.optimizer_state


def dump_fn(trainer: pl.Trainer) -> Callable[[], dict[str, Any]]:
    conn = trainer._checkpoint_connector

    def dump() -> dict[str, Any]:
        with _weights_left_out(trainer.strategy):
            return conn.dump_checkpoint(weights_only=False)

    return dump


def _part(trainer: pl.Trainer) -> tuple[str, Any]:
    """The state's key and the part saving the weights and optimizer states."""
    if ds.is_deepspeed(trainer):
        return "engine", ds.engine_part(trainer)
    from ..dcp import Sharded

    model = trainer.strategy.model
    assert isinstance(model, torch.nn.Module), "the strategy has no model yet"
    return "sharded", Sharded(model, list(trainer.strategy.optimizers))


def saved_state(
    ctx: st.SaveContext, trainer: pl.Trainer, converter: st.Converter
) -> dict[str, Any]:
    """The state handed to ``Checkpointer.step``/``save`` under a sharded strategy."""
    key, part = _part(trainer)
    return {
        "lightning": st.LightningState(ctx),
        key: part,
        "data": PerRank(st.LoaderStates(ctx, converter)),
    }


def receivers(trainer: pl.Trainer) -> dict[str, Any]:
    """The restore target: the sharded part loads into the model and optimizers in place."""
    key, part = _part(trainer)
    return {
        "lightning": st.Receiver(),
        key: part,
        "data": PerRank(st.DataReceiver()),
    }


def assemble(holder: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dictionary, weights and optimizer states left empty: the strategy's
    ``load_model_state_dict``/``load_optimizer_state_dict`` do nothing, the part loaded them."""
    rest = {k: v for k, v in holder.items() if k not in PART_KEYS}
    rest["state_dict"] = st.Receiver()
    rest["state_dict"].value = {}
    rest["optimizer_states"] = st.Receiver()
    rest["optimizer_states"].value = {"optimizers": []}
    return st.assemble(rest)


def save_context_and_state(
    trainer: pl.Trainer, pl_module: Any, lossy: frozenset[str], converter: st.Converter
) -> tuple[st.SaveContext, dict[str, Any]]:
    """The callback's :class:`SaveContext` and saved state for this trainer's strategy: the
    sharded form under FSDP, tensor parallelism and DeepSpeed, Lightning's dumped dictionaries
    otherwise."""
    if is_sharded(trainer):
        ctx = st.SaveContext(quiet.dump_fn(dump_fn(trainer), trainer), lossy, converter)
        return ctx, saved_state(ctx, trainer, converter)
    conn = trainer._checkpoint_connector
    dump = quiet.dump_fn(lambda: conn.dump_checkpoint(weights_only=False), trainer)
    ctx = st.SaveContext(dump, lossy, converter)
    return ctx, st.saved_state(ctx, pl_module, trainer.optimizers, converter)
