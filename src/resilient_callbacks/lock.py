"""One writer per checkpoint directory.

The coordinator of a run holds an exclusive ``flock`` on ``<dirpath>/.lock`` for the lifetime of
its :class:`~resilient_callbacks.Checkpointer`. A second writer gets a clear error naming the
holder instead of interleaving files. The lock dies with its process (SIGKILL included), so a
crashed run never leaves the directory locked: the descriptor is close-on-exec, and processes
forked later (DataLoader workers) close their copy at once, so they cannot keep a dead
trainer's lock alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import os
import socket
import threading
import time
import weakref

from .errors import CheckpointError, CheckpointLockedError

LOCK_NAME = ".lock"
# How long a writer waits for a ``resilient-ckpt`` command (gc, pull, push) that holds its
# directory before it fails: a run (re)started while an operator cleans up waits, not crashes.
COMMAND_WAIT_S = 600.0
# How long a writer waiting for a command goes on while ``.lock``, still locked, names no holder
# (one taking it writes its name, one releasing it clears it: a moment either way)
_BLANK_S = 2.0

log = logging.getLogger("resilient_callbacks")

_held: weakref.WeakSet[DirLock] = weakref.WeakSet()
# remote store (protocol and root) -> the lock of the writer of this process that uploads there
_remotes: dict[str, weakref.ref[DirLock]] = {}


def _drop_in_child() -> None:
    # A forked child shares the open file description, and with it the flock: drop our copy so
    # the lock is released when the parent dies, not when its last worker notices.
    # (the only thread here: a parent's thread may have held a lock's mutex, so it is new)
    for lk in list(_held):
        lk._mutex = threading.RLock()
        if lk._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lk._fd)
            lk._fd = None
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def _flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _unlock_close(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _collect_dropped(path: str) -> bool:
    """This process holds ``path``: its holder may be a writer nothing uses any more but a
    reference cycle -- one whose ``dcp.save`` failed, kept by the exception's traceback -- which
    only the cyclic collector frees. Collect (its lock goes with it); True: try again."""
    if not _held_here(path):
        return False  # (never a collection on the normal path: only when this process holds it)
    gc.collect()
    return True


def _held_here(path: str) -> bool:
    """A lock of this process holds ``path`` (the same file, however either was named)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    for lk in list(_held):
        fd = lk._fd
        with contextlib.suppress(OSError, TypeError):  # (released meanwhile)
            if fd is not None and os.path.samestat(os.fstat(fd), st):
                return True
    return False


def writer_alive(root: str) -> bool:
    """Whether the process the lock file of ``root`` names, on this host, is still alive: a
    writer running now (a holder clears its name when it releases the lock, :meth:`DirLock.release`;
    one killed keeps it, so a process that exited counts as none). Another host's writer is not
    seen. Takes no lock, so it never makes a writer that starts now fail to take its own."""
    try:
        with open(os.path.join(root, LOCK_NAME)) as f:
            info = json.loads(f.read() or "{}")
        pid = int(info.get("pid"))
    except (OSError, ValueError, TypeError, AttributeError):  # (AttributeError: not an object)
        return False
    if info.get("host") != socket.gethostname():
        return False
    if pid == os.getpid():
        return _held_here(os.path.join(root, LOCK_NAME))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def release_dropped(root: str) -> None:
    """Free the lock on ``root`` if a writer of this process that nothing uses any more holds
    it: a rank that coordinated an earlier, failed ``dcp.save`` must not keep the directory
    from the coordinator of the next (another process)."""
    _collect_dropped(os.path.join(root, LOCK_NAME))


class DirLock:
    """The exclusive lock of one checkpoint directory.

    ``command`` names a ``resilient-ckpt`` command taking it (``"gc"``, ``"pull"``, ``"push"``),
    recorded in the lock file. A writer (``command=None``) that finds a command holding the
    directory waits for it, up to :data:`COMMAND_WAIT_S` (logged once), instead of failing: a
    training run started while an operator's ``gc`` runs begins once it has finished. A
    command never waits, and a writer never waits for another writer."""

    def __init__(self, root: str, command: str | None = None) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self.command = command
        self._fd: int | None = None
        # guards ``_fd``: release() may run on the background save thread (after an abandoned
        # save) and at once on the main thread (``__del__``, close()); each fd is closed once
        self._mutex = threading.RLock()
        self._preempted = False  # a writer's wait for a command ended by a preemption

    def _holder(self) -> dict[str, object]:
        try:
            with open(self.path) as f:
                info = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def _wait_for_command(self, fd: int, wait_s: float) -> bool:
        """A command holds the lock and this is a writer: wait for it to go (True: taken).
        A preemption request pending in this process (the Checkpointer's handlers are
        installed before it opens its directory) ends the wait: the grace period is shorter."""
        from .preemption import pending  # (lazily: the lock is below the preemption layer)

        deadline = time.monotonic() + wait_s
        said = False
        if not self._holder():  # (its holder may be writing its name into it this moment)
            time.sleep(0.05)
        blank_until = time.monotonic() + _BLANK_S
        while time.monotonic() < deadline:
            info = self._holder()
            cmd = info.get("command")
            if info:
                blank_until = time.monotonic() + _BLANK_S
            # a file naming no holder while the lock is held: its holder is writing its name,
            # or has cleared it and unlocks this moment (release()); a command ending so is
            # waited for as before (a writer stopped here raised "another process is writing")
            if not cmd and (info or time.monotonic() > blank_until):
                break  # a writer holds it
            if pending.requests():
                self._preempted = True
                break
            if cmd and not said:
                log.warning(
                    "`resilient-ckpt %s` (pid %s on %s) holds %s: waiting for it to finish "
                    "(at most %.0f s) before this run writes checkpoints there",
                    cmd,
                    info.get("pid"),
                    info.get("host"),
                    os.path.dirname(self.path),
                    wait_s,
                )
                said = True
            time.sleep(0.2 if cmd else 0.02)
            if _flock(fd):
                return True
        return _flock(fd)

    def acquire(self, wait_s: float = COMMAND_WAIT_S) -> None:
        """Take the lock, or raise :class:`CheckpointLockedError` naming its holder. A writer
        waits at most ``wait_s`` for a command holding it (a distributed caller passes less
        than the collective timeout its other ranks wait in meanwhile)."""
        fd = self._take(wait_s)
        try:
            with self._mutex:
                self._fd = fd
        except BaseException:  # (a KeyboardInterrupt before it was stored: no one else can)
            if self._fd != fd:
                _unlock_close(fd)
            raise
        _held.add(self)

    def _take(self, wait_s: float) -> int:
        """Open and flock the lock file, write this holder's name into it: its fd."""
        try:  # never through a symlink: the lock file is truncated and written
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if os.path.islink(self.path):
                raise CheckpointError(
                    f"{self.path} is a symbolic link; refusing to write through it (remove it)"
                ) from None
            raise e
        try:
            return self._locked(fd, wait_s)
        except BaseException:
            # a KeyboardInterrupt (Ctrl-C) after the flock: the fd, a local, was left open and
            # the directory locked for as long as the process lived (a notebook's kernel)
            with contextlib.suppress(OSError):
                os.close(fd)
            raise

    def _locked(self, fd: int, wait_s: float) -> int:
        """``fd`` (the lock file, open) flocked, with this holder's name written into it; a
        lock taken by another raises :class:`CheckpointLockedError` (``fd`` closed)."""
        if (
            not _flock(fd)
            and not (_collect_dropped(self.path) and _flock(fd))
            and not (self.command is None and self._wait_for_command(fd, wait_s))
        ):
            info = self._holder()
            holder = ""
            if info:
                holder = f" (held by pid {info.get('pid')} on {info.get('host')} since {info.get('since')})"
            os.close(fd)
            if info.get("command"):  # gc, pull or push of an operator
                what = (
                    f"`resilient-ckpt {info['command']}`{holder} holds {os.path.dirname(self.path)}"
                )
                if self._preempted:
                    what += " (a preemption request came while this run waited for it)"
                elif self.command is None:
                    what += f" (still, after {wait_s:.0f} s of waiting for it)"
                raise CheckpointLockedError(
                    f"{what}: let it finish, or stop it (Ctrl-C leaves nothing half-done), "
                    "then try again"
                ) from None
            if self.command is not None:  # an operator's pull or push beside a live run
                raise CheckpointLockedError(
                    f"a writer (a training run) is open on {os.path.dirname(self.path)}{holder}: "
                    f"`resilient-ckpt {self.command}` changes nothing beside it (the run uploads "
                    "and retains its checkpoints itself); run it once that has stopped"
                    + (", or pull into another directory" if self.command == "pull" else "")
                ) from None
            if f"pid {os.getpid()} on {socket.gethostname()}" in holder:
                raise CheckpointLockedError(
                    "this process already has a writer open on "
                    f"{os.path.dirname(self.path)}{holder} (a Checkpointer or "
                    "ResilientStorageWriter, or the one a DeepSpeed engine, a Trainer callback "
                    "or the DeepSpeed launcher made): close() it (or use it in a `with` block) "
                    "before opening another; two writers that are both meant to stay open (two "
                    "engines that train) need a dirpath each"
                ) from None
            raise CheckpointLockedError(
                f"another process is writing checkpoints to {os.path.dirname(self.path)}{holder}. "
                "Two runs must not share a checkpoint directory: give this run its own dirpath, "
                "or stop the other run first."
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if self.command is not None:
            info["command"] = self.command
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        return fd

    def verify(self) -> None:
        """Holder, before each save: make sure ``.lock`` is still the file this lock holds. One
        deleted or replaced while the run was live (a cleanup script, ``rm -rf dir/.*``) let a
        second writer open the directory beside this one. Takes the new file (recreated if
        gone), with a warning; raises :class:`CheckpointLockedError` when another writer holds
        it now (and again at every later call until it is free)."""
        with self._mutex:  # (release() on another thread closes nothing under the check)
            old = self._fd
            if old is None:
                return
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(old), os.stat(self.path, follow_symlinks=False)):
                    return
        try:
            fd = self._take(0.0)
        except CheckpointLockedError as e:  # (``old`` kept: the next save tries again)
            raise CheckpointLockedError(
                f"{self.path} was deleted or replaced while this writer held it, and {e}"
            ) from None
        with self._mutex:
            if self._fd != old:  # released meanwhile (closing): the new lock goes too
                _unlock_close(fd)
                return
            self._fd = fd
            os.close(old)  # (its flock was on the deleted file)
        log.warning(
            "%s was deleted or replaced while this writer held it (a cleanup script?): locked "
            "it again; no other writer had opened the directory meanwhile",
            self.path,
        )

    def release(self) -> None:
        """Unlock (idempotent, and safe from two threads at once: the fd is closed once). The
        holder's name is cleared first, while the lock is still held: a file naming a process
        that is still alive (a notebook whose Checkpointer was closed) read as a writer open to
        :func:`writer_alive` of another process (``gc --dry-run``, ``report``)."""
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is not None:
            _held.discard(self)
            with contextlib.suppress(OSError):  # (a read-only file system: nothing to clear)
                os.ftruncate(fd, 0)
            _unlock_close(fd)

    def __del__(self) -> None:  # a writer dropped without close(): its lock goes with it
        with contextlib.suppress(Exception):
            self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None


def claim_remote(key: str, url: str, lock: DirLock) -> None:
    """One open writer per remote store in this process, as per directory: ``lock`` (held) is
    the writer's; ``key`` names the store however its URL is spelled. The claim ends when that
    lock is released (``close()``, a failed open, a writer dropped). Two Checkpointers with one
    ``remote=`` (a model's and an EMA's) would upload checkpoints of the same names to one
    place, each replacing the other's: the second is refused with
    :class:`CheckpointLockedError` naming the first's directory."""
    for attempt in range(2):
        ref = _remotes.get(key)
        other = ref() if ref is not None else None
        if other is None or other is lock or not other.held:
            break
        if attempt == 0:  # perhaps a writer nothing uses but a reference cycle: collect it
            gc.collect()
            continue
        raise CheckpointLockedError(
            f"this process already has a writer open that uploads to remote {url} (the one "
            f"of {os.path.dirname(other.path)}): two writers with one remote URL would upload "
            "checkpoints of the same names over each other's. Give each Checkpointer a remote "
            "URL of its own (e.g. .../run1/model and .../run1/ema), or close() the other first"
        )
    for gone in [k for k, ref in _remotes.items() if ref() is None]:
        del _remotes[gone]  # (writers gone: one a run of a sweep otherwise stayed)
    _remotes[key] = weakref.ref(lock)
