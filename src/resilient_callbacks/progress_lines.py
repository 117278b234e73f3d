"""Where a transfer's progress lines go when no bar shows them (:class:`.progress.Progress`
without a terminal): the library's log at INFO, or what a command sets with :func:`said_by`
(the CLI: a line on stderr, which a batch job's log keeps). Process-wide, not per context: the
transfers run in threads of their own (a pull's reader, fsspec's). Light: the CLI sets it for
every command without importing fsspec."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_SAY: list[Callable[[str], None]] = []  # the innermost said_by block's, last


def say() -> Callable[[str], None] | None:
    """The command's way of saying a progress line; None: the library's log at INFO."""
    return _SAY[-1] if _SAY else None


@contextlib.contextmanager
def said_by(fn: Callable[[str], None]) -> Iterator[None]:
    """Within this block (one command of the process), a Progress made without a bar says its
    lines through ``fn`` (called from whichever thread counts its bytes) instead of the log."""
    _SAY.append(fn)
    try:
        yield
    finally:
        _SAY.remove(fn)
