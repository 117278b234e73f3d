"""Let accelerate run the Trainer's FSDP2 on CPU processes (helper for the tests).

accelerate enables FSDP only where it finds an accelerator (``AcceleratorState`` sets
``DistributedType.FSDP`` for MULTI_GPU/XPU/NPU/... and leaves MULTI_CPU as it is), although
FSDP2's ``fully_shard`` itself runs on CPU with gloo. :func:`allow` makes that one decision
for CPU processes given an FSDP plugin; everything after it -- accelerate's ``fully_shard`` of
the model, the Trainer's FSDP paths, our callback -- is the real code. FSDP1's plugin refuses
to be made without an accelerator, so FSDP1 under the Trainer is tested on a GPU only.
"""

from __future__ import annotations

from typing import Any


def allow() -> None:
    import accelerate.state as state
    from accelerate.utils import DistributedType

    cls = state.AcceleratorState
    if getattr(cls, "_rc_fsdp_on_cpu", False):
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls._rc_fsdp_on_cpu = True  # type: ignore[attr-defined]
