"""How long an upload thread waits before it tries again: exponential backoff with jitter, for
:class:`~.sync.RemoteSync`, :class:`~.remote_commit.NodeUploader` and
:class:`~.remote_commit.RemoteCommitter`.

The jitter draws from its own generator: an upload thread must never draw from the global one,
which the training loop uses (and the checkpoint restores). Which ranks call what: the rank that
runs the upload thread (the coordinator, or a node's leader); nothing here is collective.
"""

from __future__ import annotations

import math
import random

_JITTER = random.Random()


def backoff_s(failures: int, base_s: float, max_s: float = math.inf, jitter: bool = True) -> float:
    """Seconds to wait after the ``failures``-th consecutive failure (1, 2, ...): ``base_s``
    doubling with each failure, at most ``max_s``; with ``jitter``, a random 50 to 100 % of
    that, so that writers that failed together do not retry together."""
    delay = min(max_s, base_s * 2 ** (failures - 1))
    return delay * _JITTER.uniform(0.5, 1.0) if jitter else delay
