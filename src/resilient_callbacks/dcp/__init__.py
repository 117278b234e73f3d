"""Sharded checkpoints for FSDP2 (``fully_shard``), FSDP1 and tensor parallelism (DTensor and
FSDP1's ShardedTensor state) through the core: pickle-free, verified, resharded on load.

- :class:`Sharded` -- put ``Sharded(model, optimizer)`` in a :class:`~resilient_callbacks.Checkpointer`
  state: each rank saves its own shards in the background, restore reshards to the current
  mesh / number of ranks.
- :class:`ResilientStorageWriter` / :class:`ResilientStorageReader` -- for code that keeps its own
  ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls: committed, verified, pickle-free
  checkpoints with retention and a remote tier.
- :func:`plain_dcp_reader` -- read a checkpoint written by plain ``dcp.save`` (to migrate):
  opt-in, it unpickles.

This subpackage imports ``torch.distributed.checkpoint``; ``import resilient_callbacks`` does
not import it.
"""

from __future__ import annotations

from .sharded import Sharded
from .storage_reader import ResilientStorageReader, plain_dcp_reader
from .storage_writer import ResilientStorageWriter

__all__ = ["ResilientStorageReader", "ResilientStorageWriter", "Sharded", "plain_dcp_reader"]
