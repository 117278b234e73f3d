"""The global random generators left as they were: :func:`preserved`.

Torch-free, so that the CLI's remote commands, which create a remote store, need no torch.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Leave the global generators of Python, NumPy and torch (CPU) as they were on entry.

    For work the library does on the training thread that may draw from them as a side effect
    (importing an fsspec backend: aiobotocore imports httpx, which imports rich, which calls
    ``random.getrandbits`` at import). Adding the library must not change the user's random
    streams. NumPy's and torch's are those of the modules imported already (a process that has
    not imported one draws no stream from it: the CLI's commands need no torch).
    """
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    py = random.getstate()
    npy = np.random.get_state(legacy=True) if np is not None else None
    cpu = torch.get_rng_state() if torch is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        if np is not None and npy is not None:
            np.random.set_state(npy)
        if torch is not None and cpu is not None:
            torch.set_rng_state(cpu)
