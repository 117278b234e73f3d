"""Which optimizer a wrapper steps. Accelerate's ``AcceleratedOptimizer`` (and wrappers like
it) is a ``torch.optim.Optimizer`` that never ran ``Optimizer.__init__``: its ``step()`` steps
the optimizer it holds, whose step hooks are the ones that fire and whose class a checkpoint
records.
"""

from __future__ import annotations

import torch


def hookable(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose step hooks fire when ``opt`` steps: ``opt`` itself, or the one a
    wrapper that never ran ``Optimizer.__init__`` steps (accelerate's ``AcceleratedOptimizer``,
    ``.optimizer``)."""
    for _ in range(4):
        inner = getattr(opt, "optimizer", None)
        if (
            not isinstance(opt, torch.optim.Optimizer)  # not a torch optimizer's wrapper
            or hasattr(opt, "_optimizer_step_pre_hooks")  # it ran Optimizer.__init__ itself
            or not isinstance(inner, torch.optim.Optimizer)
        ):
            break
        opt = inner
    return opt
