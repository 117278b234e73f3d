"""torch imported by a CLI command without losing a Ctrl-C.

Only ``export`` (which writes tensors) and ``inspect`` of a checkpoint written by ``dcp.save``
import torch, and only when they reach that point; the other commands, and ``inspect`` of an
ordinary checkpoint (dtypes and shapes from the safetensors headers), need none (its import costs ~2 s). torch's import loads numpy from C and clears
whatever error that raised, a KeyboardInterrupt too: a Ctrl-C in that second was lost, and the
command ran to its end (a gc deleted) with exit status 0. :func:`torch_import_guarded` makes
every import of torch while a command runs, wherever it happens, remember a Ctrl-C and raise it
once the import is done. Single process, main thread (signal handlers live there).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any


class _Guard(importlib.abc.MetaPathFinder):
    """The first place the import system looks for ``torch``: it finds and loads it as the
    other finders would, with a SIGINT handler that remembers the signal."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> Any:
        if (
            name != "torch"
            or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):  # (an embedding program's handler is left alone)
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # once: the other finders find torch below
        hits: list[int] = []

        def remember(signum: int, frame: Any) -> None:
            hits.append(signum)
            raise KeyboardInterrupt

        def done() -> None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if hits:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, remember)
        try:
            spec = importlib.util.find_spec(name)
        except BaseException:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            done()
            return spec
        load = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            try:
                load(module)
            finally:
                done()

        loader.exec_module = exec_module  # this spec's loader only: torch's own
        return spec


@contextlib.contextmanager
def torch_import_guarded() -> Iterator[None]:
    """While the block runs, an import of torch that a Ctrl-C interrupts raises
    KeyboardInterrupt once it is done (torch would swallow it). Nothing when torch is in
    ``sys.modules`` already."""
    if "torch" in sys.modules:
        yield
        return
    guard = _Guard()
    sys.meta_path.insert(0, guard)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(guard)
