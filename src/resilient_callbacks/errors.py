"""One exception hierarchy for the whole library.

Every error derives from :class:`CheckpointError` and also from the built-in exception that
matches it, so callers can catch either (``except FileNotFoundError`` still works for a missing
checkpoint). Messages say what happened, why, and how to fix it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import TypeVar


class CheckpointError(Exception):
    """Base class of every error raised by resilient_callbacks."""

    #: the exit status ``resilient-ckpt`` gives for it (docs/cli.md, "Exit codes"): 1, the
    #: command ran and failed; 2 where :func:`usage` marked it, 3 where :func:`nothing_found` did
    exit_code: int = 1


class ConfigError(CheckpointError, ValueError):
    """An invalid option or combination of options given to a constructor."""


class UnknownOptionError(ConfigError, TypeError):
    """The Checkpointer or an adapter was given a keyword option that it does not take."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A requested checkpoint (explicit step or path) does not exist."""


class CheckpointCorruptError(CheckpointError, OSError):
    """A checkpoint's files do not match its manifest (missing, wrong size, wrong checksum)."""


class UnsafeManifestError(CheckpointCorruptError, ValueError):
    """A manifest names a file outside its checkpoint directory (``..``, absolute paths)."""


class NoValidCheckpointError(CheckpointError, RuntimeError):
    """Checkpoints exist but none of them can be restored; never a silent fresh start."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the objects it is loaded into (keys, shapes, dtypes)."""


class UnsupportedStateError(CheckpointError, TypeError):
    """An object in the state cannot be saved without pickle."""


class CheckpointLockedError(CheckpointError, BlockingIOError):
    """Another writer holds the checkpoint directory."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed (on one or more ranks); nothing was committed. (A checkpoint committed
    whose work after the commit then failed is not one: :mod:`.after_commit_work`.)"""

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        # the first OS error named in the message (a rank's error reaches the others as text):
        # `e.errno == errno.ENOSPC` holds whichever rank and whichever step of the save failed
        found = re.search(r"\[Errno (\d+)\]", message)
        if found:
            self.errno = int(found.group(1))

    def __str__(self) -> str:  # OSError's __str__ would reformat a single-arg message
        return str(self.args[0]) if self.args else ""


class CollectiveError(CheckpointError, RuntimeError):
    """An exchange between the ranks inside the library failed: a rank died or hung, or the
    ranks did not call ``restore``/``step``/``save``/``close`` at the same points (a save on
    rank 0 only). The backend's error is chained as the cause."""


class RemoteUnavailableError(CheckpointError, ConnectionError):
    """The remote store (``remote=`` URL) cannot be reached, or the bucket, path or
    credentials are wrong."""


class RemoteWaitPreemptedError(RemoteUnavailableError):
    """A preemption request (SIGTERM or another watched signal, a cloud notice) came while the
    construction or the restore waited for a remote store's listing or download that did not
    answer (up to the outage limit, longer than a grace period): the wait ended at once on
    every rank, nothing was saved; the next run resumes as this one would have. Raised to the
    caller only with ``exit_on_preemption=False``; otherwise the process exits with
    ``preemption_exit_code`` (75), saying so in one line, so that the scheduler requeues it."""


class UploadIncompleteError(RemoteUnavailableError):
    """``close()`` gave up on uploads: the remote store failed (or stopped answering) for
    longer than the outage limit, so the newest checkpoints are only on the local disk.
    ``pending``: their names; ``dirpath`` and ``url``: where they are and where they belong
    (``resilient-ckpt push DIRPATH URL`` uploads them)."""

    def __init__(self, message: str, pending: tuple[str, ...], dirpath: str, url: str) -> None:
        super().__init__(message)
        self.pending, self.dirpath, self.url = pending, dirpath, url

    def __reduce__(self) -> tuple[type, tuple[str, tuple[str, ...], str, str], dict]:
        # pickled across a process boundary (a process pool running the training): the
        # default calls the class with the message alone
        return (type(self), (str(self), self.pending, self.dirpath, self.url), vars(self))


class RemoteDeleteRefusedError(CheckpointError, OSError):
    """The remote store refused to delete some objects of a checkpoint (a policy that denies
    deletes, an object lock). ``refused``: path -> the store's answer; ``committed``: the
    manifest was refused, so nothing was deleted and the checkpoint is still committed and
    whole; else it was uncommitted first and only the files named are left (a folder without
    a manifest, which every reader ignores; a later deletion tries them again)."""

    def __init__(
        self, message: str, refused: dict[str, str] | None = None, committed: bool = False
    ) -> None:
        super().__init__(message)
        self.refused, self.committed = dict(refused or {}), committed

    def __str__(self) -> str:  # OSError's __str__ would reformat a single-arg message
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[type, tuple[str, dict[str, str], bool], dict]:
        return (type(self), (str(self), self.refused, self.committed), vars(self))


__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CollectiveError",
    "ConfigError",
    "NoValidCheckpointError",
    "RemoteDeleteRefusedError",
    "RemoteUnavailableError",
    "RemoteWaitPreemptedError",
    "UnsafeManifestError",
    "UnsupportedStateError",
    "UploadIncompleteError",
]


class ResumeFallbackWarning(UserWarning):
    """Restore skipped a corrupt or incomplete checkpoint and used an older one."""


class ForeignCheckpointsWarning(UserWarning):
    """The checkpoint directory holds checkpoints of another run or model."""


__all__ += ["ForeignCheckpointsWarning", "ResumeFallbackWarning"]


_E = TypeVar("_E", bound=CheckpointError)


def usage(error: _E) -> _E:
    """``error``, its type unchanged, marked as a usage error: an argument that cannot be right
    whatever the directory or store holds (a URL where a local directory belongs or the reverse,
    a path that names nothing, one checkpoint where a directory of them belongs, an output
    inside the checkpoint directory). ``resilient-ckpt`` exits 2 with it."""
    error.exit_code = 2
    return error


def nothing_found(error: _E) -> _E:
    """``error``, its type unchanged, marked as "nothing to act on": the directory or remote
    store holds no checkpoint at all (empty, another tool's files only, or ours only further
    down). ``resilient-ckpt`` exits 3 with it."""
    error.exit_code = 3
    return error


#: ``warn_and_log(..., stacklevel=AT_CALLER)``: at the first frame outside the library
AT_CALLER = 0


def sentence(text: str) -> str:
    """``text`` ended by one full stop: a message that goes on after an error's own text,
    which may end with one already (a warning raised as an error, "...it would delete).")."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else f"{text}."


def error_type(name: str) -> type[CheckpointError]:
    """The :class:`CheckpointError` subclass called ``name`` (an error rank 0 relayed by name)."""
    t = globals().get(name, CheckpointError)
    return t if isinstance(t, type) and issubclass(t, CheckpointError) else CheckpointError


def relayed(
    name: str, msg: str, rank: int = 0, default: type[CheckpointError] = CheckpointError
) -> CheckpointError:
    """The error another rank raises for one that rank ``rank`` raised (and raises itself),
    relayed to it by class name ``name`` and message ``msg``: of that class where it is a
    :class:`CheckpointError` (else ``default``), its text ``rank 0 reported: <msg>``, with
    ``name`` in it only where the class raised is not ``name``: the class is said once. (A
    class built of more than a message, :class:`UploadIncompleteError`, is relayed as
    ``default``.)"""
    t = error_type(name)
    t = default if t is CheckpointError and name != "CheckpointError" else t
    try:
        return t(f"rank {rank} reported: " + (msg if t.__name__ == name else f"{name}: {msg}"))
    except TypeError:
        return default(f"rank {rank} reported: {name}: {msg}")


def caller_stacklevel(*through: str) -> int:
    """The ``stacklevel`` of the first frame outside this package, for a ``warnings.warn`` (or
    :func:`warn_and_log`) call made in the function calling this one: the user's call into the
    library, or the framework's, however deep inside the library the warning is given.
    ``through``: directories of other code to pass over too (a framework that calls us, such
    as ``torch.distributed.checkpoint`` calling a storage reader)."""
    inside = (os.path.dirname(os.path.abspath(__file__)), *map(os.path.abspath, through))
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def warn_and_log(
    log: logging.Logger,
    msg: str,
    category: type[Warning] = UserWarning,
    *,
    stacklevel: int = 1,
    warn: bool = True,
) -> None:
    """Say ``msg`` once where the user sees it, and to the logs of those who collect them.

    ``warn`` issues a :mod:`warnings` warning; the message is logged at WARNING as well when
    the logger has a handler somewhere in its hierarchy. A program that configures no logging
    would otherwise print it twice, once more through logging's last-resort handler.
    ``warn=False`` (given ``rank == 0``: a notice said once, on rank 0, see :mod:`.notices`):
    logged at INFO only, which the default setup does not print: a WARNING there went through
    the last-resort handler to stderr on every other rank. ``stacklevel`` counts from the
    caller; :data:`AT_CALLER`: the first frame outside the library (:func:`caller_stacklevel`).
    Where the warning filters make it an error (``python -W error``), ``warn=False`` raises it
    too, after its INFO line: rank 0's warning raises there, and the other ranks must stop
    with it, not wait for rank 0 in their next collective.
    """
    level = caller_stacklevel() if stacklevel == AT_CALLER else stacklevel + 1
    if not warn:
        log.info(msg)
        if raises(msg, category, level):
            raise category(msg)
        return
    warnings.warn(msg, category, stacklevel=level)
    if log.hasHandlers():
        log.warning(msg)


def raises(msg: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> bool:
    """Whether ``warnings.warn(msg, category, stacklevel=stacklevel)``, called where this is
    called, raises: the first of :data:`warnings.filters` that matches says ``"error"``
    (``python -W error``, ``filterwarnings("error")``). Reads the filters only (nothing
    changes, on any thread): a rank that says a notice only as a log line learns whether the
    rank that warns raises, and stops with it (:func:`warn_and_log`)."""
    try:
        frame = sys._getframe(stacklevel)  # (this function's frame is 0: warn's caller is 1)
        module, lineno = frame.f_globals.get("__name__", "<string>"), frame.f_lineno
    except ValueError:  # (a stack shallower than stacklevel: warnings says "sys", 1)
        module, lineno = "sys", 1
    for action, text, cat, mod, line in warnings.filters:
        if (
            (text is None or text.match(msg))
            and issubclass(category, cat)
            and (mod is None or mod.match(module))
            and (line == 0 or lineno == line)
        ):
            return action == "error"
    return getattr(warnings, "defaultaction", "default") == "error"
