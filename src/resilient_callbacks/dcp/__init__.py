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
not import it. It needs torch >= 2.9 (:data:`NEEDS_TORCH`; the rest of the package works from
torch 2.4): DCP's ``Metadata.version`` and ``AsyncSaveResponse`` (``async_staging``) first came
in 2.9, and torch 2.4 also lacks the public ``torch.distributed.tensor``, DTensor's
``__create_chunk_list__`` and FSDP2 on CPU; importing it on an older torch raises ImportError
saying so.
"""

from __future__ import annotations

import torch

from .._version import DCP_NEEDS_TORCH, release

NEEDS_TORCH = DCP_NEEDS_TORCH
# by release number: a pre-release or vendor build of 2.9 ("2.9.0a0+git...") has what it needs
if release(torch.__version__) < NEEDS_TORCH:
    raise ImportError(
        f"resilient_callbacks.dcp (Sharded, ResilientStorageWriter, ResilientStorageReader; "
        f"used for FSDP / tensor-parallel models by the Lightning and Transformers callbacks) "
        f"needs torch >= 2.9, found torch {torch.__version__}: pip install 'torch>=2.9'. "
        f"The rest of resilient_callbacks works with torch >= 2.4"
    )

# after the check: these import APIs an older torch lacks
from .sharded import Sharded  # noqa: E402
from .storage_reader import ResilientStorageReader, plain_dcp_reader  # noqa: E402
from .storage_writer import ResilientStorageWriter  # noqa: E402

__all__ = ["ResilientStorageReader", "ResilientStorageWriter", "Sharded", "plain_dcp_reader"]
