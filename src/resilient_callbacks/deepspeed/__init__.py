"""DeepSpeed adapter: pickle-free ZeRO 0-3 checkpoints, enabled from the DeepSpeed JSON config.

::

    # ds.json: {..., "resilient_checkpoint": {"dirpath": "ckpts/run1", "keep_last": 3}}
    import resilient_callbacks.deepspeed as rcds
    engine, optimizer, loader, scheduler = rcds.initialize(
        model=model, model_parameters=model.parameters(), training_data=ds, config="ds.json")

``rcds.attach(engine, dirpath=..., state={...})`` for an engine made elsewhere;
``python -m resilient_callbacks.deepspeed.run train.py ...`` for a script that calls
``deepspeed.initialize`` itself. Requires ``deepspeed`` (``pip install
'resilient-callbacks[deepspeed]'``). The core package never imports this module. See
``docs/deepspeed.md``.
"""

from __future__ import annotations

try:
    import deepspeed  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "resilient_callbacks.deepspeed needs DeepSpeed: pip install 'resilient-callbacks[deepspeed]'"
    ) from e

from .attach import DeepSpeedCheckpoint, attach, initialize
from .section import SECTION
from .zero_part import ZeroPart

__all__ = ["SECTION", "DeepSpeedCheckpoint", "ZeroPart", "attach", "initialize"]
