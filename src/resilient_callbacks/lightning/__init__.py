"""PyTorch Lightning adapter: fault tolerance for a ``Trainer`` with one callback.

::

    from resilient_callbacks.lightning import ResilientCheckpoint

    trainer = L.Trainer(max_steps=10_000, callbacks=[ResilientCheckpoint(
        dirpath="ckpts/run1", every_n_steps=500, keep_last=3)])
    trainer.fit(model, datamodule=dm)   # re-running this script continues where it stopped

Requires ``lightning`` (``pip install 'resilient-callbacks[lightning]'``). The core package never
imports this module. See ``docs/lightning.md``.
"""

from __future__ import annotations

try:
    import lightning
    import lightning.pytorch
except ImportError as e:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "resilient_callbacks.lightning needs PyTorch Lightning >= 2.5 (the `lightning` package): "
        "pip install 'resilient-callbacks[lightning]'"
    ) from e

from .._version import release

if release(lightning.__version__) < (2, 5):
    raise ImportError(
        f"resilient_callbacks.lightning needs PyTorch Lightning >= 2.5, found "
        f"{lightning.__version__}: with 2.4 a resumed run does not continue exactly "
        "(its losses differ from an uninterrupted run's). pip install 'lightning>=2.5'"
    )

from .callback import ResilientCheckpoint
from .conversion import HparamsConversionWarning
from .loaders import make_resumable

__all__ = ["HparamsConversionWarning", "ResilientCheckpoint", "make_resumable"]
