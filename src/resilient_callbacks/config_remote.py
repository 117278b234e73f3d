"""The remote tier's options of a :class:`~resilient_callbacks.Checkpointer`, checked.

:func:`check_remote` is the part of :class:`~.config.CheckpointerConfig`'s validation that
concerns ``remote=`` and the options that apply only with it (``remote_options``,
``remote_keep_last``, ``remote_keep_best``, ``remote_timeout``): a path without a scheme
becomes a ``file://`` URL (warned of when it looks like a bucket missing its ``s3://``), a
remote inside dirpath is refused. Every rank runs it when it constructs its Checkpointer with
the same arguments (the options are compared across ranks afterwards); no collectives, no IO
but the path checks. Moved from ``config.py``, which calls it from ``__post_init__``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from .errors import AT_CALLER, ConfigError, warn_and_log

if TYPE_CHECKING:
    from .config import CheckpointerConfig

__all__ = ["check_remote"]


def check_remote(config: CheckpointerConfig) -> None:
    """The remote options of ``config``, checked; ``config.remote`` normalized (a URL without
    a trailing ``/``; a local path as ``file://`` and absolute)."""
    r = config.remote
    if r is None:
        given = [
            k
            for k in ("remote_options", "remote_keep_last", "remote_keep_best")
            if getattr(config, k) is not None
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} {_apply(given)} only with remote=<URL>: pass remote (or drop "
                f"{_them(given)})"
            )
        return
    if isinstance(r, os.PathLike):
        r = os.fspath(r)
    if not isinstance(r, str) or not r:
        raise ConfigError(
            f"remote={config.remote!r}: an fsspec URL such as 's3://bucket/prefix', "
            "'gs://bucket/prefix' or 'file:///mnt/durable/run1'"
        )
    if "://" not in r:
        _warn_if_bucket_like(r)
    r = as_url(r)
    object.__setattr__(config, "remote", r.rstrip("/"))
    if r.startswith("file://"):
        target = os.path.abspath(r[len("file://") :])
        if target == config.dirpath or target.startswith(config.dirpath + os.sep):
            raise ConfigError(
                f"remote={r!r} is inside dirpath={config.dirpath!r}: the durable copy must be "
                "somewhere else (another disk, a mounted share, an object store)"
            )
    if config.remote_options is not None and not isinstance(config.remote_options, dict):
        raise ConfigError(
            f"remote_options={config.remote_options!r}: a dict of fsspec options, e.g. "
            "{'endpoint_url': ..., 'key': ..., 'secret': ...}"
        )
    k = config.remote_keep_last
    if k is not None and k != "all" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ConfigError(
            f"remote_keep_last={k!r}: an int >= 1, 'all' to keep every remote checkpoint, "
            "or None (default) for the same limit as keep_last"
        )
    b = config.remote_keep_best
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
        raise ConfigError(f"remote_keep_best={b!r}: an int >= 0, or None (as keep_best)")
    if b and not config.monitor:
        raise ConfigError(f"remote_keep_best={b} needs monitor='<metric>' to rank checkpoints by")
    if not (isinstance(config.remote_timeout, (int, float)) and config.remote_timeout > 0):
        raise ConfigError(f"remote_timeout={config.remote_timeout!r}: seconds > 0")


# the wording of a message naming options (also config.py's read_only check)
def _apply(given: list[str]) -> str:
    return "applies" if len(given) == 1 else "apply"


def _them(given: list[str]) -> str:
    return "it" if len(given) == 1 else "them"


def _warn_if_bucket_like(remote: str) -> None:
    """``remote`` has no scheme: a local folder. Written as a relative path that does not say
    so (``"my-bucket/run1"``), it is more likely a bucket without its ``s3://``: the durable
    copy would silently land on this machine's disk, next to the run, and vanish with it."""
    if remote.startswith((".", "~")) or os.path.isabs(remote):
        return
    warn_and_log(
        logging.getLogger("resilient_callbacks"),
        f"remote={remote!r} has no scheme: it is the local folder "
        f"{os.path.abspath(remote)}, not an object store. For a bucket write "
        f"'s3://{remote}' (or gs://, az://, ...); for a local folder write './{remote}' or an "
        "absolute path, and this warning goes away",
        stacklevel=AT_CALLER,
    )


def as_url(remote: str) -> str:
    """``remote`` as the URL a Checkpointer takes it for: a path without a scheme is a local
    folder's (``file://`` and its absolute path, ``~`` expanded); a URL as it is."""
    if "://" in remote:
        return remote
    return "file://" + os.path.abspath(os.path.expanduser(remote))
