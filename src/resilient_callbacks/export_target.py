"""Where an export may be written (``resilient-ckpt export``, ``export_pretrained``): never over,
into or around the checkpoints it reads, and with ``--force`` (``overwrite=True``) only in place
of an empty folder or of an earlier export, which marks itself with its ``export.json``.

Replacing OUT deletes what it held: a folder of the user's (``~/models``), the checkpoint
directory itself, or a folder holding it (a project with its ``train.py``) would be lost."""

from __future__ import annotations

import json
import os

from .errors import ConfigError, usage
from .manifest import MANIFEST_NAME

EXPORT_MARKER = "export.json"  # written into every export: where it came from


def check_export_target(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool,
    force_name: str = "overwrite=True",
) -> str:
    """Raise :class:`ConfigError` saying what to do when an export of ``source`` (a checkpoint
    directory, or one checkpoint: then the directory holding it) may not be written to
    ``out``; return ``out``'s absolute path. Refused: ``out`` is a URL (an export is local),
    or is ``source``, holds it or lies in it; ``out`` exists and is not a directory; ``out``
    exists without ``overwrite``, or with it but holds something other than an earlier export
    (its files are named). ``force_name``: how the caller's user asks to replace ``out`` (the
    CLI's ``--force``, the Python API's ``overwrite=True``), named in the errors."""
    src, dst = os.fspath(source), os.fspath(out)
    if "://" in dst and not os.path.exists(dst):  # (made a local folder named "s3:")
        raise usage(
            ConfigError(
                f"OUT {dst} is a URL: an export is written to a local directory; give one, and copy "
                "it to the store after"
            )
        )
    if os.path.exists(os.path.join(src, MANIFEST_NAME)):  # one checkpoint: its directory
        src = os.path.dirname(os.path.abspath(src))
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    elsewhere = "give an OUT outside it (a new or empty folder, e.g. one beside it)"
    if real_dst == real_src:
        raise usage(
            ConfigError(
                f"OUT {dst} is the checkpoint directory {src} itself: writing the export there would "
                f"replace its checkpoints; {elsewhere}"
            )
        )
    if within(real_src, real_dst):
        raise usage(
            ConfigError(
                f"OUT {dst} holds the checkpoint directory {src}: writing the export there would "
                f"replace it and everything else in {dst}; {elsewhere}"
            )
        )
    if within(real_dst, real_src):
        raise usage(
            ConfigError(
                f"OUT {dst} lies inside the checkpoint directory {src}: an export must not be "
                f"written among its checkpoints; {elsewhere}"
            )
        )
    if not os.path.lexists(dst):
        return os.path.abspath(dst)
    if not os.path.isdir(dst):
        raise usage(
            ConfigError(
                f"OUT {dst} exists and is not a directory: an export is a directory; give a new "
                "or empty folder"
            )
        )
    if not overwrite:
        raise ConfigError(
            f"{os.path.abspath(dst)} already exists; pass {force_name} to replace "
            "it, which is done only for an empty folder or an earlier export (its export.json)"
        )
    try:
        names = sorted(os.listdir(dst))
    except OSError as e:
        raise ConfigError(f"OUT {dst} cannot be read ({e}); give a new or empty folder") from None
    if names and not is_export(dst):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ConfigError(
            f"OUT {dst} is not empty and is not an earlier export (it has no {EXPORT_MARKER} of "
            f"ours): {force_name} would delete what it holds ({shown}); give a new or empty folder, "
            "or move those files away yourself"
        )
    return os.path.abspath(dst)


def is_export(path: str) -> bool:
    """Whether ``path`` is an export written by this library: its ``export.json`` (a JSON object
    naming the checkpoint it came from and its step) is there."""
    try:
        with open(os.path.join(path, EXPORT_MARKER), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and "source" in info and "step" in info


def within(path: str, folder: str) -> bool:
    """Whether the real path ``path`` lies under the real path ``folder`` (not equal to it)."""
    return os.path.commonpath([path, folder]) == folder and path != folder
