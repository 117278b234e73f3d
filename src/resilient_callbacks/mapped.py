"""Checkpoint files that a restore maps into memory, and the tensors that must not keep them.

A restore maps each verified tensor file privately (:func:`.tensorfile.map_tensors_verified`):
loading into a module then copies once, with no read buffer. A mapping holds its file open,
though, and the file's blocks are freed only when the last mapping of it goes. An object that
keeps the tensors it is given -- an optimizer whose parameters are on the CPU keeps its state
tensors as they are -- would keep the mapping for the rest of the run: once retention deleted
that checkpoint its disk space stayed in use until the process ended, and a resumed run needed
room for one checkpoint more than a fresh one (on a disk sized for ``keep_last + 1`` the resumed
run failed with ENOSPC).

So tensors handed to objects that keep them get private copies (:func:`private`); an optimizer
whose parameters are on an accelerator moves its state there but keeps a few tensors as given
(Adam's ``step`` stays on the CPU), and those are copied after it loads (:func:`copy_kept`).
After a restore :func:`still_mapped` names any file of the restored checkpoint that something
still maps (:meth:`.restoring.Restorer.restore` warns).

Host memory: a mapped page that was read counts in the process's resident set until it is
unmapped. Verifying reads every page, loading reads them again, and the copies made for objects
that keep tensors come on top: the restore of a model and its CPU optimizer peaked at the whole
file mapped *plus* the optimizer's copies, a full state above ``torch.load()``'s. So the pages
of a tensor nobody will read from the mapping again are dropped from the resident set
(:func:`release`: ``MADV_DONTNEED`` of its whole pages; they stay in the page cache, and a later
read of them faults the same bytes back in, since nothing has written them): the verified file
as soon as it is hashed (:mod:`.tensorfile`), each original once :func:`private` copied it, and
a module's tensors once it loaded them without keeping any.

Thread contract: any thread; the registry is guarded by a lock, and an entry goes when its
mapping is freed.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

_lock = threading.Lock()
# id of the mapping -> (weak reference to it, first address, end address, file path)
_live: dict[int, tuple[weakref.ref[mmap.mmap], int, int, str]] = {}
_made: dict[int, int] = {}  # id of the mapping -> its number, in the order they were made
_count = 0  # mappings registered so far (see made_so_far)
# ids of mappings freed since, dropped from the registry at its next use under the lock: the
# callback that says one was freed takes no lock, as it may run inside a locked section of this
# very thread (the cyclic collector, which frees a mapping an exception's traceback held, runs at
# any allocation): taking the lock there deadlocked the thread, and every later restore with it
_freed: collections.deque[int] = collections.deque()


def _forget_freed() -> None:
    """Under ``_lock``: drop the entries of the mappings freed since."""
    while _freed:
        key = _freed.popleft()
        _live.pop(key, None)
        _made.pop(key, None)


def register(mm: mmap.mmap, path: str) -> None:
    """Record the mapping ``mm`` of the file at ``path`` while it lives."""
    size = len(mm)
    if not size:
        return
    probe = torch.frombuffer(mm, dtype=torch.uint8, count=1)  # its address; dropped at once
    start = probe.data_ptr()
    del probe
    key = id(mm)

    def gone(_: Any, key: int = key) -> None:
        _freed.append(key)  # (no lock: see _freed)

    global _count
    with _lock:
        _forget_freed()  # (first: a mapping freed at this address had this id)
        _live[key] = (weakref.ref(mm, gone), start, start + size, os.path.abspath(path))
        _made[key] = _count
        _count += 1


def made_so_far() -> int:
    """How many mappings were registered until now: pass it to :func:`still_mapped` as
    ``since`` to leave out the mappings made before (a ``reader.open_checkpoint`` of the user's
    that a restore did not make)."""
    with _lock:
        _forget_freed()
        return _count


def release(t: torch.Tensor) -> None:
    """Drop the whole pages of ``t``'s storage, if it lies in a registered mapping, from this
    process's resident set (``MADV_DONTNEED``; partial pages at its ends stay). Contract: nothing
    has written those pages (they hold the file's bytes, which a later read faults back in);
    true of every tensor a restore maps until it is handed to an object (see the module's
    docstring). A no-op where ``madvise`` is missing (Windows) or refuses."""
    if not hasattr(mmap, "MADV_DONTNEED") or t.device.type != "cpu" or not t.numel():
        return
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes < mmap.PAGESIZE:  # holds no whole page: nothing to drop (most tensors of a state)
        return
    with _lock:
        _forget_freed()
        found = [(ref(), start) for ref, start, end, _ in _live.values() if start <= ptr < end]
    mm, start = found[0] if found else (None, 0)
    if mm is None:
        return
    page = mmap.PAGESIZE
    lo = -(-(ptr - start) // page) * page
    hi = min((ptr + nbytes - start) // page * page, len(mm))
    if hi > lo:
        with contextlib.suppress(OSError, ValueError):  # only an optimisation
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def is_mapped(t: torch.Tensor, ranges: list[tuple[int, int]] | None = None) -> bool:
    """Whether ``t``'s memory lies in a mapped checkpoint file; ``ranges``: the mappings'
    address ranges as :func:`_ranges` gave them (a walk over many tensors takes them once)."""
    if t.device.type != "cpu" or not t.numel():
        return False
    ptr = t.untyped_storage().data_ptr()
    if ranges is None:
        with _lock:
            _forget_freed()
            return any(start <= ptr < end for _, start, end, _ in _live.values())
    return any(start <= ptr < end for start, end in ranges)


def _ranges() -> list[tuple[int, int]]:
    """The address ranges of the live mappings, now. A tensor that views one keeps it alive,
    so a range taken before a walk over such tensors stays right for the whole walk."""
    with _lock:
        _forget_freed()
        return [(start, end) for _, start, end, _ in _live.values()]


def private(
    value: Any,
    memo: dict[int, tuple[Any, torch.Tensor]] | None = None,
    ranges: list[tuple[int, int]] | None = None,
) -> Any:
    """``value`` with every tensor that views a mapped file replaced by a copy of its own, at
    any depth of dicts, lists and tuples (those holding one are rebuilt; nothing else is looked
    into). A tensor met twice (tied, aliased) gets one copy, also across the calls sharing
    ``memo``."""
    memo = {} if memo is None else memo
    ranges = _ranges() if ranges is None else ranges  # once per call, not per tensor
    if isinstance(value, torch.Tensor):
        if not is_mapped(value, ranges):
            return value
        if id(value) not in memo:
            memo[id(value)] = (value, value.clone())  # (the original held: its id stays its)
            release(value)  # read once, copied: its pages leave the resident set
        return memo[id(value)][1]
    if isinstance(value, dict):
        new: Any = {k: private(v, memo, ranges) for k, v in value.items()}
        same = all(new[k] is v for k, v in value.items())
        if not same and (meta := getattr(value, "_metadata", None)) is not None:
            new = collections.OrderedDict(new)  # a module's state dict keeps its versions
            new._metadata = meta
    elif isinstance(value, list):
        new = [private(v, memo, ranges) for v in value]
        same = all(a is b for a, b in zip(new, value, strict=True))
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        new = tuple(private(v, memo, ranges) for v in value)
        same = all(a is b for a, b in zip(new, value, strict=True))
    else:
        return value
    return value if same else new  # (a container without tensors stays itself: torch.Size)


def keeps_host_tensors(obj: Any) -> bool:
    """Whether ``obj.load_state_dict`` may keep the CPU tensors it is given: any stateful object
    but a module (which copies into its parameters) and an optimizer whose parameters are all
    on an accelerator (which copies its state there). A module with a submodule of its own
    loading code (:func:`own_loader`: a dynamic-quantized ``Linear`` of float16 keeps the bias
    it is given) may."""
    if isinstance(obj, torch.nn.Module):
        return any(map(own_loader, obj.modules()))
    try:
        devices = {p.device.type for g in obj.param_groups for p in g["params"]}
    except Exception:  # not an optimizer
        return True
    return not devices or "cpu" in devices


def own_loader(module: torch.nn.Module) -> bool:
    """Whether ``module`` loads its own entries by code of its own outside ``torch.nn``
    (``_load_from_state_dict``: torch.ao's quantized and fake-quantize modules, observers,
    a user's module), rather than by ``torch.nn``'s copy into its parameters and buffers."""
    loader = type(module)._load_from_state_dict
    return loader is not torch.nn.Module._load_from_state_dict and not (
        getattr(loader, "__module__", "") or ""
    ).startswith("torch.nn.")


def copy_kept(optimizer: Any) -> None:
    """After ``optimizer.load_state_dict`` where :func:`keeps_host_tensors` said no: torch moves
    an optimizer's state to its parameters' device but keeps some tensors as given -- Adam's and
    AdamW's ``step`` stays on the CPU unless ``capturable`` or ``fused``, and ``param_groups``
    values (a tensor ``lr``) are not moved. Each of those that views a mapped file is replaced by
    a copy of its own (a few scalars); the state on the accelerator is left as it is."""
    state = getattr(optimizer, "state", None)
    ranges = _ranges()
    if isinstance(state, Mapping):
        for per_param in state.values():
            if isinstance(per_param, MutableMapping):
                for k, v in list(per_param.items()):
                    if isinstance(v, torch.Tensor) and is_mapped(v, ranges):
                        per_param[k] = v.clone()
    for group in getattr(optimizer, "param_groups", None) or ():
        if isinstance(group, MutableMapping):
            for k, v in list(group.items()):
                if k != "params" and isinstance(v, torch.Tensor) and is_mapped(v, ranges):
                    group[k] = v.clone()


def load_state(obj: Any, value: Any, load: Callable[[Any], Any]) -> Any:
    """``load(value)`` -- ``obj``'s ``load_state_dict`` -- such that nothing ``obj`` keeps views a
    mapped file: private copies first where it may keep host tensors (:func:`keeps_host_tensors`),
    else, for an optimizer, the few tensors it kept as given copied after (:func:`copy_kept`).
    Returns what ``load`` returned."""
    keeps = keeps_host_tensors(obj)
    result = load(private(value) if keeps else value)
    if not keeps and not isinstance(obj, torch.nn.Module):
        copy_kept(obj)
    # (a module's state dict may hold other values: a dtype, a quantized Linear's tuple)
    kept = _tensors(obj.state_dict()) if isinstance(obj, torch.nn.Module) else None
    ranges = _ranges()  # (after state_dict(): a tensor it makes cannot sit in a freed range)
    if kept is not None and not any(is_mapped(t, ranges) for t in kept):
        for t in _tensors(value):  # copied into the module: not read from the mapping again
            release(t)
    return result


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, at any depth of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def still_mapped(directory: str, since: int = 0) -> list[str]:
    """The files under ``directory`` that some mapping still maps: of those made by a restore
    (or a reader), the ones registered from ``since`` on (:func:`made_so_far`)."""
    prefix = os.path.abspath(directory) + os.sep
    with _lock:
        _forget_freed()
        entries = [v for k, v in _live.items() if _made.get(k, 0) >= since]
    return sorted({path for ref, _, _, path in entries if path.startswith(prefix) and ref()})
