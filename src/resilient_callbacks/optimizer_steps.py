"""Which optimizers stepped since a moment: one registry for the process, one step pre-hook
per optimizer, shared by everything that asks (:class:`.windows.StepWatch`, the emergency
save's consistent point, the Lightning callback's ``save_on_exception``).

Each optimizer followed has an :class:`Entry` with two counts that only grow: ``calls``, its
``step()`` calls begun, and ``updates``, the steps whose update may have begun (at once for a
``step()`` without a closure; for a ``step(closure)`` once the closure returned:
:func:`.optim.update_began`). A consumer keeps its own marks (a count as it last looked) and
compares; nothing is reset. The registry holds an optimizer only by weak reference; its hook
is removed when the last :class:`Follower` that follows it lets go. A hook that was removed
behind our back (``opt._optimizer_step_pre_hooks.clear()``, the hooks' dict replaced) is
noticed when the optimizer is followed again, and registered again (its steps in between were
not counted: :meth:`Follower.follow` says so, to each follower). Training thread only; a lock
guards the registry itself (several Checkpointers may follow from several threads).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .optim import untraced, update_began


class Entry:
    """The counts of one optimizer (see the module's docstring); hashed by identity."""

    __slots__ = (
        "__weakref__",
        "calls",
        "checkable",
        "handle",
        "hook",
        "registered",
        "target",
        "updates",
        "users",
    )

    def __init__(self, opt: Any) -> None:
        self.calls = 0
        self.updates = 0
        self.users = 0  # Followers following it
        self.target: weakref.ref[Any] = weakref.ref(opt, _forget(id(opt), self))
        self.handle: Any = None
        self.hook: Any = None
        self.checkable = False  # the hook was found in the optimizer's hooks once registered
        self.registered = 0  # times the hook was registered (again, where it was lost)

    def began(self, torch_semantics: bool) -> int:
        """``updates`` where ``torch_semantics`` (a torch optimizer evaluates a closure before it
        updates anything), else ``calls`` (another class may write the weights before it calls
        the closure: a SAM-style ``step()``)."""
        return self.updates if torch_semantics else self.calls

    def hooked(self, opt: Any) -> bool:
        """Whether our hook is still registered on ``opt``; where that cannot be seen (an
        optimizer-like object whose ``register_step_pre_hook`` forwards the hook, or drops
        it, rather than keeping it in its own ``_optimizer_step_pre_hooks``), whether it was
        registered: such a hook was registered again, and again, at every look."""
        if self.handle is None:
            return False
        return not self.checkable or _registered(opt, self.handle, self.hook)

    def register(self, opt: Any) -> None:
        """Register the step pre-hook on ``opt`` (again, where it was lost)."""
        entry_ref = weakref.ref(self)

        def counted() -> None:
            e = entry_ref()
            if e is not None:
                e.updates += 1

        began = update_began(counted)

        def pre_step(o: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            e = entry_ref()
            if e is not None:
                e.calls += 1
            return began(o, args, kwargs)

        # (in a compiled step(): counted before it, not replayed after)
        self.hook = untraced(pre_step)
        self.handle = opt.register_step_pre_hook(self.hook)
        self.checkable = _registered(opt, self.handle, self.hook)
        self.registered += 1

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.handle = self.hook = None


def _registered(opt: Any, handle: Any, hook: Any) -> bool:
    hooks = getattr(opt, "_optimizer_step_pre_hooks", None)
    return isinstance(hooks, dict) and hooks.get(getattr(handle, "id", None)) is hook


_LOCK = threading.RLock()  # (re-entered by a collection while held: _forget)
_ENTRIES: dict[int, Entry] = {}  # id(optimizer) -> its entry, while it lives


def _forget(key: int, entry: Entry) -> Any:
    """The weak reference's callback: the optimizer is gone (its hooks with it)."""
    entry_ref = weakref.ref(entry)

    def gone(_: Any) -> None:
        with _LOCK:
            if _ENTRIES.get(key) is entry_ref():
                del _ENTRIES[key]

    return gone


def entries() -> int:
    """How many optimizers the registry follows now (a test counts them)."""
    with _LOCK:
        return len(_ENTRIES)


class Follower:
    """One consumer's optimizers: :meth:`follow` hooks each once in the process (the registry's
    entry shared), :meth:`release` lets go of them all (the last follower removes the hook)."""

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}  # id(optimizer) -> its entry
        # id(optimizer) -> its entry's registrations as this follower last looked
        self._registered: dict[int, int] = {}

    def follow(self, opt: Any) -> tuple[Entry, bool]:
        """``opt``'s entry, and whether it was hooked since this follower last looked (new to
        it, or its hook had been removed and was registered again, by this follower or
        another): its steps before were not counted."""
        entry = self._entries.get(id(opt))
        if (
            entry is not None
            and entry.target() is opt
            and entry.hooked(opt)
            and self._registered.get(id(opt)) == entry.registered
        ):
            return entry, False
        with _LOCK:
            if entry is not None and entry.target() is not opt:  # (another object, same id)
                self._let_go(entry)
                entry = None
            if entry is None:
                # (the optimizers collected since are let go: one re-created every epoch)
                for key in [k for k, e in self._entries.items() if e.target() is None]:
                    self._let_go(self._entries.pop(key))
                    self._registered.pop(key, None)
                entry = _ENTRIES.get(id(opt))
                if entry is None or entry.target() is not opt:
                    entry = _ENTRIES[id(opt)] = Entry(opt)
                entry.users += 1
                self._entries[id(opt)] = entry
            if not entry.hooked(opt):
                entry.remove()
                entry.register(opt)
            self._registered[id(opt)] = entry.registered
        return entry, True

    def _let_go(self, entry: Entry) -> None:
        """(Under the lock.)"""
        entry.users -= 1
        if entry.users <= 0:
            entry.remove()
            opt = entry.target()
            if opt is not None and _ENTRIES.get(id(opt)) is entry:
                del _ENTRIES[id(opt)]

    def release(self) -> None:
        """Let go of every optimizer followed (close)."""
        with _LOCK:
            for entry in self._entries.values():
                self._let_go(entry)
            self._entries.clear()
            self._registered.clear()
