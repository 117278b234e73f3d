"""The package version, in a module of its own so that core modules can read it without importing
the package root (which imports them: a cycle)."""

import re

__version__ = "0.1.0"

#: the torch that ``resilient_callbacks.dcp`` needs (its ImportError below it); here so that a
#: check of it need not import that subpackage (torch.distributed.checkpoint, DTensor)
DCP_NEEDS_TORCH = (2, 9)


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string, also of a pre-release or vendor build
    ("2.9.0a0+git..."); ``(0, 0)`` for one without a number."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else (0, 0)
