"""Lightning's ``DeepSpeedStrategy``: the callback's state with the DeepSpeed engine's state (ZeRO
partitions written by every rank, see :mod:`resilient_callbacks.deepspeed.engine_state`) in place
of Lightning's dumped weights and optimizer states, and the options of the DeepSpeed config's
``"resilient_checkpoint"`` section.

Under this strategy the model is a ``DeepSpeedEngine`` made at the strategy's setup; Lightning's
own checkpoint is the engine's (``engine.save_checkpoint``, pickles). Here ``dump_checkpoint`` is
called with the weights and optimizer states left out (as under ``ModelParallelStrategy``, see
:mod:`.sharded`) and the engine's state is saved as the DeepSpeed adapter saves it; the strategy
restores after its setup and its ``load_model_state_dict``/``load_optimizer_state_dict`` do
nothing, so the core's restore loads the engine in place.

The section is taken out of the strategy's config at the callback's ``setup`` (before the
strategy's setup hands the config to ``deepspeed.initialize``): DeepSpeed writes and logs its
config, and remote credentials must not end up there. The callback's own arguments win over
the section's.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ..errors import ConfigError


def strategy_class() -> type | None:
    try:
        from lightning.pytorch.strategies import DeepSpeedStrategy
    except ImportError:  # pragma: no cover - Lightning without DeepSpeed support
        return None
    return DeepSpeedStrategy


def is_deepspeed(trainer: pl.Trainer) -> bool:
    cls = strategy_class()
    return cls is not None and isinstance(trainer.strategy, cls)


def check(trainer: pl.Trainer) -> None:
    """Refuse what this callback cannot checkpoint under DeepSpeedStrategy, clearly."""
    strategy = trainer.strategy
    if getattr(strategy, "load_full_weights", False):
        raise ConfigError(
            "ResilientCheckpoint with DeepSpeedStrategy(load_full_weights=True): that option "
            "loads a consolidated Lightning checkpoint given as fit(ckpt_path=...); this "
            "callback restores its own checkpoints (the engine's partitions). Leave "
            "load_full_weights at False."
        )


def take_section(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The validated ``"resilient_checkpoint"`` section of the strategy's DeepSpeed config,
    removed from it (None if there is none)."""
    from ..deepspeed.section import SECTION, validate

    config = getattr(trainer.strategy, "config", None)
    if not isinstance(config, dict) or SECTION not in config:
        return None
    return validate(config.pop(SECTION), "DeepSpeedStrategy's config")


def engine_part(trainer: pl.Trainer) -> dict[str, Any]:
    """The engine's state (counters, ZeRO partitions or module and optimizer, its scheduler),
    as the DeepSpeed adapter saves it; raises for what is not supported (offload, ...)."""
    from ..deepspeed.engine_state import engine_state

    engine = trainer.strategy.model  # the DeepSpeedEngine, once the strategy is set up
    return engine_state(engine)
