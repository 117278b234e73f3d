"""fsspec calls that take a remote path literally.

fsspec reads a path given to ``rm``, ``cat``, ``get`` or ``put`` as a plain string (and each
path of a list given to ``rm`` or ``cat``) as a glob pattern where it holds ``*``, ``?`` or
``[``. A user's prefix may hold them (``s3://bucket/exp?1``, ``s3://bucket/run[1]``): as a
pattern, ``exp?1/step_000000001`` also names ``expA1/step_000000001``, another run's
checkpoint, and ``run[1]/...`` names ``run1/...`` and not itself. Every path the package
builds is literal, so these helpers never let fsspec expand one: a path without those
characters takes fsspec's batched call as before, one with them a call per object that does
not expand (``cat_file``, ``rm_file``, ``find``). ``get`` and ``put`` are always given two
lists (fsspec expands neither then), and :func:`escape` makes a pattern of a literal prefix.

Which ranks call what: whoever reads or writes the remote store; nothing collective.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["cat", "escape", "has_magic", "rm", "rm_tree"]

_MAGIC = re.compile(r"[*?[]")


def has_magic(path: str) -> bool:
    """Whether fsspec would read ``path`` as a glob pattern."""
    return _MAGIC.search(path) is not None


def escape(path: str) -> str:
    """``path`` as a glob pattern that matches only itself (``exp?1`` -> ``exp[?]1``), to put
    in front of a pattern of one's own."""
    return _MAGIC.sub(lambda m: f"[{m.group(0)}]", path)


def cat(fs: Any, paths: list[str]) -> dict[str, Any]:
    """``fs.cat(paths, on_error="return")`` with every path taken literally: path (as the
    store spells it, without its protocol) -> bytes, or the exception its read raised."""
    plain = [p for p in paths if not has_magic(p)]
    got: dict[str, Any] = dict(fs.cat(plain, on_error="return")) if plain else {}
    for p in paths:
        if has_magic(p):
            try:
                got[fs._strip_protocol(p)] = fs.cat_file(p)
            except Exception as e:  # as fs.cat's on_error="return" gives it
                got[fs._strip_protocol(p)] = e
    return got


def rm(fs: Any, paths: list[str]) -> None:
    """Delete the objects ``paths`` (files, not folders), each taken literally."""
    plain = [p for p in paths if not has_magic(p)]
    if plain:
        fs.rm(plain)
    for p in paths:
        if has_magic(p):
            fs.rm_file(p)


def rm_tree(fs: Any, path: str) -> None:
    """``fs.rm(path, recursive=True)`` with ``path`` taken literally: every object under the
    folder ``path``, and the folder (``FileNotFoundError`` where there is nothing)."""
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if not has_magic(path) or proto in ("file", "local"):  # (a local rm expands nothing)
        fs.rm(path, recursive=True)
        return
    found = fs.find(path)
    if not found:
        raise FileNotFoundError(path)
    for p in found:
        fs.rm_file(p)
