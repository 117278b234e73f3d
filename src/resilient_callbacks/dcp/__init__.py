"""Sharded checkpoints for FSDP2 (``fully_shard``), FSDP1 and tensor parallelism (DTensor
state) through the core: pickle-free, verified, resharded on load.

- :class:`Sharded` -- put ``Sharded(model, optimizer)`` in a :class:`~resilient_callbacks.Checkpointer`
  state: each rank saves its own shards in the background, restore reshards to the current
  mesh / number of ranks.

This subpackage imports ``torch.distributed.checkpoint``; ``import resilient_callbacks`` does
not import it.
"""

from __future__ import annotations

from .sharded import Sharded

__all__ = ["Sharded"]
