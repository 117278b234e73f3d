"""Permission bits that hold for this process, root or not: a test makes a directory that
cannot be listed (``chmod 0o300``) and the library really meets ``EACCES``.

Root ignores permission bits through two capabilities (``CAP_DAC_OVERRIDE``,
``CAP_DAC_READ_SEARCH``). :func:`honoured` takes them out of the effective set of the calling
thread (they stay permitted, and are put back at its end); the threads it starts meanwhile (a
Checkpointer's background save, its uploader) inherit that set. A user's process needs nothing.
Files root created stay root's: their owner bits (``rwx`` for a folder pytest made) apply."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
_DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _caps(libc: ctypes.CDLL, effective: int | None = None) -> int:
    """This thread's effective set (word 0), set to ``effective`` first if given."""
    header, data = _Header(_VERSION_3, 0), (_Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    if effective is not None:
        data[0].effective = effective
        if libc.capset(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capset failed")
    return int(data[0].effective)


@contextlib.contextmanager
def honoured() -> Iterator[bool]:
    """Within it, this thread (and the threads it starts) is refused what permission bits
    refuse. Yields False where that cannot be had (the caller skips)."""
    if os.geteuid() != 0:
        yield True
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # (this process's libc: no library search)
        before = _caps(libc)
        _caps(libc, before & ~_DAC)
    except (OSError, AttributeError):
        yield False
        return
    try:
        yield True
    finally:
        _caps(libc, before)


def unlistable(path: Path) -> bool:
    """Make the directory ``path`` one this process can write into but not list
    (``chmod 0o300``, as a directory whose read bit an operator took away); False, with its
    mode put back, where this process lists it all the same (call it within :func:`honoured`)."""
    os.chmod(path, 0o300)
    try:
        os.listdir(path)
    except PermissionError:
        return True
    os.chmod(path, 0o755)
    return False
