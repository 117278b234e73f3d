"""Where a checkpoint keeps its FileParts' files, and what its manifest says of them (moved
from :mod:`.filepart`). Standard library only: ``resilient-ckpt inspect`` reads them without
torch."""

from __future__ import annotations

import hashlib

from .manifest import Manifest

PARTS_DIR = "parts"
PARTS_EXTRA = "parts"  # the manifest's ``extra`` key for what each part's describe() said


HASHED = ".."  # the start of a hashed folder's name, which no plain one has
_NAME_MAX = 200  # bytes of one folder name kept as the key spells it (filesystems take 255)
_ID_MAX = 1000  # bytes of a whole id kept (an S3 key takes 1024, with the URL's prefix)


def part_dir(part_id: str) -> str:
    """The folder (relative to the checkpoint) of the part at ``part_id``: ``parts/<id>``,
    one folder per key of its path, where each key can be a folder name. An id with a key
    that cannot (longer than 200 bytes: ``File name too long``; empty, ``.``, ``..``: a
    folder outside ``parts/`` or no folder at all; one with a NUL, a backslash or a control
    character; one starting with ``..``) gets ``parts/..<hash of the id>`` instead, the same
    on every rank and at every save."""
    keys = part_id.split("/")
    if len(part_id.encode()) <= _ID_MAX and all(_plain(k) for k in keys):
        return f"{PARTS_DIR}/{part_id}"
    return f"{PARTS_DIR}/{HASHED}{hashlib.sha256(part_id.encode()).hexdigest()[:32]}"


def stored_dir(manifest: Manifest, part_id: str) -> str:
    """The folder the manifest lists the part at ``part_id`` in: :func:`part_dir`, or, for a
    checkpoint written before such ids got a hashed folder, ``parts/<id>`` as it was then (a
    key of 201 to 255 bytes, one starting with ``..`` or with a character that is not
    printable saved and restored there)."""
    new = part_dir(part_id)
    old = f"{PARTS_DIR}/{part_id}"
    if new == old or not all(k not in ("", ".", "..") for k in part_id.split("/")):
        return new  # (an empty key, . or .. never made a checkpoint one could restore)
    if any(f.path.startswith(old + "/") for f in manifest.files) and not any(
        f.path.startswith(new + "/") for f in manifest.files
    ):
        return old
    return new


def _plain(key: str) -> bool:
    return (
        0 < len(key.encode()) <= _NAME_MAX
        and not key.startswith(HASHED)
        and key != "."
        and key.isprintable()
        and "\\" not in key
    )


def parts_of_format(manifest: Manifest, fmt: str) -> list[str]:
    """The ids of the parts whose describe() recorded ``"format": fmt`` in ``manifest``."""
    described = manifest.extra.get(PARTS_EXTRA)
    if not isinstance(described, dict):
        return []
    return [pid for pid, d in described.items() if isinstance(d, dict) and d.get("format") == fmt]
