"""Hugging Face Transformers adapter: fault tolerance for a ``Trainer`` with one callback.

::

    from resilient_callbacks.transformers import ResilientCheckpoint

    trainer.add_callback(ResilientCheckpoint("ckpts/run1", every_n_steps=200, keep_last=3))
    trainer.train()     # re-running this script continues from the newest valid checkpoint

``export_pretrained`` turns a checkpoint into a directory ``AutoModel.from_pretrained`` loads.

Requires ``transformers`` >= 5.3 and ``accelerate`` >= 1.3 (``pip install 'resilient-callbacks[transformers]'``).
The core package never imports this module. See ``docs/transformers.md``.
"""

from __future__ import annotations

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "resilient_callbacks.transformers needs the `transformers` and `accelerate` packages: "
        "pip install 'resilient-callbacks[transformers]'"
    ) from e

from .callback import ResilientCheckpoint
from .export import export_pretrained

__all__ = ["ResilientCheckpoint", "export_pretrained"]
