"""Record the filesystem operations of this process and replay them as a power loss would.

:class:`Journal` wraps ``os.fsync``, ``os.rename``, ``os.replace``, ``os.unlink``, ``os.rmdir``,
``os.mkdir`` and the opening of files for writing (``open`` / ``os.open``), records each call
under ``root`` (then calls the real function), and keeps a model of what a power loss may leave:

- a file's bytes are durable only once it is fsynced after it was last opened for writing
  (the bytes are read at that fsync and kept);
- a directory's entries are durable only as of its last fsync: a later create, rename or unlink
  in it may be undone, or kept, independently of every other directory's.

:meth:`Journal.crash_states` builds, for a crash after any recorded operation, every
combination of "this directory's changes since its last fsync persisted / were undone" (up to
a bound), as real folders: the worst cases of a power loss (files never fsynced are empty).
The model is stricter than ext4's ordered journal (which persists metadata in order) and as
strict as POSIX allows, so it finds the orderings a checkpoint library must not rely on.
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Node:
    is_dir: bool
    cur: dict[str, Node] = field(default_factory=dict)  # a directory's entries now
    dur: dict[str, Node] = field(default_factory=dict)  # as of its last fsync
    data: bytes | None = None  # a file's bytes as of its last fsync (None: never durable)
    synced: bool = True  # a file: no write since its last fsync


@dataclass
class Op:
    kind: str
    path: str
    dest: str = ""
    is_dir: bool = False  # an fsync: of a directory


class Journal:
    """Record and model the filesystem operations under ``root`` (an existing directory,
    durable as it is when recording starts)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.ops: list[Op] = []
        self.marks: dict[int, list[Any]] = {}  # op index -> what the test noted there
        self._tree = self._load(self.root)
        self._lock = threading.RLock()
        self._saved: list[tuple[Any, str, Any]] = []
        self._snapshots: list[Node] = []  # the model after each operation (copy-on-write)

    # ------------------------------------------------------------------ model

    def _load(self, path: str) -> Node:
        if not os.path.isdir(path):
            with open(path, "rb") as f:
                return Node(False, data=f.read())
        node = Node(True)
        for name in os.listdir(path):
            node.cur[name] = self._load(os.path.join(path, name))
        node.dur = dict(node.cur)
        return node

    def _rel(self, path: str, dir_fd: int | None = None) -> list[str] | None:
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        full = os.path.abspath(path)
        d, base = os.path.split(full)
        with contextlib.suppress(OSError):
            full = os.path.join(os.path.realpath(d), base)
        if full != self.root and not full.startswith(self.root + os.sep):
            return None
        rel = os.path.relpath(full, self.root)
        return [] if rel == "." else rel.split(os.sep)

    def _parent(self, parts: list[str]) -> Node | None:
        node = self._tree
        for p in parts[:-1]:
            nxt = node.cur.get(p)
            if nxt is None or not nxt.is_dir:
                return None
            node = nxt
        return node

    def _lookup(self, parts: list[str]) -> Node | None:
        if not parts:
            return self._tree
        parent = self._parent(parts)
        return None if parent is None else parent.cur.get(parts[-1])

    def _note(
        self, kind: str, parts: list[str], dest: list[str] | None = None, is_dir: bool = False
    ) -> None:
        self.ops.append(Op(kind, "/".join(parts), "/".join(dest or []), is_dir))
        self._snapshots.append(_copy(self._tree))

    def mark(self, *what: Any) -> None:
        """Note ``what`` (e.g. a committed checkpoint) after the latest operation."""
        with self._lock:
            self.marks.setdefault(len(self.ops), []).append(what)

    # ------------------------------------------------------------------ wrappers

    def _fsync(self, fd: int) -> None:
        self._real["fsync"](fd)
        with self._lock:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return
            parts = self._rel(path)
            node = None if parts is None else self._lookup(parts)
            parent = None if not parts else self._parent(parts)
            if node is None and parent is not None and os.path.isfile(path):
                node = parent.cur[parts[-1]] = Node(False)  # type: ignore[index]
            if node is None:  # (a file written by code this does not wrap: safetensors)
                return
            if node.is_dir:
                node.dur = dict(node.cur)
            else:
                with open(f"/proc/self/fd/{fd}", "rb") as f:
                    node.data = f.read()
                node.synced = True
            self._note("fsync", parts, is_dir=node.is_dir)  # type: ignore[arg-type]

    def _written(self, path: Any, dir_fd: int | None = None) -> None:
        if not isinstance(path, (str, os.PathLike)):
            return
        parts = self._rel(os.fspath(path), dir_fd)
        if not parts:
            return
        parent = self._parent(parts)
        if parent is None:
            return
        node = parent.cur.get(parts[-1])
        if node is None:
            node = parent.cur[parts[-1]] = Node(False)
        node.synced = False
        self._note("write", parts)

    def _open(self, file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        f = self._real["open"](file, mode, *a, **k)
        if any(c in mode for c in "wax+"):
            with self._lock:
                self._written(file)
        return f

    def _os_open(self, path: Any, flags: int, *a: Any, dir_fd: int | None = None, **k: Any) -> int:
        fd = self._real["os_open"](path, flags, *a, dir_fd=dir_fd, **k)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            with self._lock:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    self._written(path, dir_fd)
        return fd

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        self._real["mkdir"](path, mode, dir_fd=dir_fd)
        with self._lock:
            parts = self._rel(os.fspath(path), dir_fd)
            parent = None if not parts else self._parent(parts)
            if parent is not None:
                parent.cur[parts[-1]] = Node(True)  # type: ignore[index]
                self._note("mkdir", parts)  # type: ignore[arg-type]

    def _remove(self, kind: str) -> Any:
        real = self._real[kind]

        def remove(path: Any, *, dir_fd: int | None = None) -> None:
            with self._lock:
                parts = self._rel(os.fspath(path), dir_fd)
            real(path, dir_fd=dir_fd)
            with self._lock:
                parent = None if not parts else self._parent(parts)
                if parent is not None and parent.cur.pop(parts[-1], None) is not None:  # type: ignore[index]
                    self._note(kind, parts)  # type: ignore[arg-type]

        return remove

    def _move(self, kind: str) -> Any:
        real = self._real[kind]

        def move(src: Any, dst: Any, *, src_dir_fd: Any = None, dst_dir_fd: Any = None) -> None:
            with self._lock:
                a = self._rel(os.fspath(src), src_dir_fd)
                b = self._rel(os.fspath(dst), dst_dir_fd)
            real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            with self._lock:
                pa = None if not a else self._parent(a)
                pb = None if not b else self._parent(b)
                node = pa.cur.pop(a[-1], None) if pa is not None else None  # type: ignore[index]
                if pb is not None and node is not None:
                    pb.cur[b[-1]] = node  # type: ignore[index]
                if node is not None or pb is not None:
                    self._note(kind, a or [], b)

        return move

    @contextlib.contextmanager
    def recording(self) -> Iterator[Journal]:
        self._real = {
            "fsync": os.fsync,
            "open": builtins.open,
            "os_open": os.open,
            "mkdir": os.mkdir,
            "unlink": os.unlink,
            "rmdir": os.rmdir,
            "rename": os.rename,
            "replace": os.replace,
        }
        patches = {
            (os, "fsync"): self._fsync,
            (builtins, "open"): self._open,
            (os, "open"): self._os_open,
            (os, "mkdir"): self._mkdir,
            (os, "unlink"): self._remove("unlink"),
            (os, "remove"): self._remove("unlink"),
            (os, "rmdir"): self._remove("rmdir"),
            (os, "rename"): self._move("rename"),
            (os, "replace"): self._move("replace"),
        }
        saved = {k: getattr(*k) for k in patches}
        try:
            for (mod, name), fn in patches.items():
                setattr(mod, name, fn)
            yield self
        finally:
            for (mod, name), fn in saved.items():
                setattr(mod, name, fn)

    # ------------------------------------------------------------------ crash states

    def crash_states(
        self, after: int, scratch: str, seen: set[Any], limit: int = 16
    ) -> Iterator[str]:
        """Folders holding what a power loss right after operation ``after`` may leave of
        ``root``: combinations of the directories with unsynced changes, each either persisted
        or undone (at most ``limit``: all undone, all persisted and each single directory's
        flip first), each state not in ``seen`` (which it is added to)."""
        tree = self._snapshots[after]
        dirty = [n for n in _dirs(tree) if n.cur != n.dur]
        combos: list[frozenset[int]] = [frozenset(), frozenset(range(len(dirty)))]
        combos += [frozenset([i]) for i in range(len(dirty))]
        combos += [frozenset(range(len(dirty))) - {i} for i in range(len(dirty))]
        for r in range(2, len(dirty) - 1):
            combos += [frozenset(c) for c in itertools.combinations(range(len(dirty)), r)]
        tried: set[frozenset[int]] = set()
        for combo in combos:
            if combo in tried:
                continue
            tried.add(combo)
            if len(tried) > limit:
                return
            kept = {id(dirty[i]) for i in combo}
            sig = _signature(tree, kept, frozenset())
            if sig in seen:
                continue
            seen.add(sig)
            shutil.rmtree(scratch, ignore_errors=True)
            _materialize(tree, scratch, kept, set())
            yield scratch


def _copy(node: Node, memo: dict[int, Node] | None = None) -> Node:
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    new = memo[id(node)] = Node(node.is_dir, data=node.data, synced=node.synced)
    new.cur = {k: _copy(v, memo) for k, v in node.cur.items()}
    new.dur = {k: _copy(v, memo) for k, v in node.dur.items()}
    return new


def _dirs(node: Node, seen: set[int] | None = None) -> list[Node]:
    seen = set() if seen is None else seen
    if id(node) in seen or not node.is_dir:
        return []
    seen.add(id(node))
    out = [node]
    for child in [*node.cur.values(), *node.dur.values()]:
        out += _dirs(child, seen)
    return out


def _entries(node: Node, kept: set[int]) -> dict[str, Node]:
    return node.cur if id(node) in kept or node.cur == node.dur else node.dur


def _signature(node: Node, kept: set[int], busy: frozenset[int]) -> Any:
    if not node.is_dir:
        return node.data
    if id(node) in busy:
        return ()
    busy = busy | {id(node)}
    items = _entries(node, kept).items()
    return tuple(sorted(((n, _signature(c, kept, busy)) for n, c in items), key=lambda x: x[0]))


def _materialize(node: Node, path: str, kept: set[int], busy: set[int]) -> None:
    if not node.is_dir:
        with open(path, "wb") as f:
            f.write(node.data or b"")  # never fsynced: nothing of it is durable
        return
    os.makedirs(path, exist_ok=True)
    if id(node) in busy:  # (a directory reachable twice: a rename both kept and undone)
        return
    busy = busy | {id(node)}
    for name, child in _entries(node, kept).items():
        _materialize(child, os.path.join(path, name), kept, busy)
