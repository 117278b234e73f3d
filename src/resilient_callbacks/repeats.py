"""A failure that persists is said once, not after every save: a checkpoint folder the
retention cannot delete (its owner made it read-only, a file still open on NFS) failed each
pass, after every save and every upload, and a long run logged the same ERROR thousands of
times. The first ERROR is said whole; the same failure again (same thing, same reason) only
every :data:`REMIND_EVERY`-th time in a row, with its count; another reason, or the same
failure after the thing succeeded once, is said again at once.

Which ranks call what: whoever reports the failure (a leader's retention pass); no collective.
"""

from __future__ import annotations

import threading

REMIND_EVERY = 100  # the same failure, in a row: said again with its count each this many


def reason(e: BaseException) -> str:
    """What makes two failures the same: the error's type and, for an ``OSError``, its errno
    and text (not its paths: a rename's target has a new random name each time)."""
    if isinstance(e, OSError) and (e.errno is not None or e.strerror):
        return f"{type(e).__name__} {e.errno} {e.strerror}"
    return f"{type(e).__name__} {e}"


class Repeats:
    """The persisting failures said so far, by key (a path), each with its reason and how many
    times in a row it failed. Thread-safe: a save's and an upload's retention both report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str, int]] = {}

    def due(self, key: str, why: str) -> int | None:
        """``key`` failed (again) for ``why``: the times in a row it has, if it is to be said
        now (1: the first time, or the first time for this reason; then every
        :data:`REMIND_EVERY`-th time), else None."""
        with self._lock:
            last = self._seen.get(key)
            n = last[1] + 1 if last is not None and last[0] == why else 1
            self._seen[key] = (why, n)
        return n if n == 1 or n % REMIND_EVERY == 0 else None

    def cleared(self, key: str) -> None:
        """``key`` succeeded: a failure of it later is said again, whole."""
        with self._lock:
            self._seen.pop(key, None)


def again(n: int) -> str:
    """The tail of a reminder's message: empty the first time."""
    if n <= 1:
        return ""
    return f" [the same failure {n} times in a row; said again every {REMIND_EVERY}th time]"
