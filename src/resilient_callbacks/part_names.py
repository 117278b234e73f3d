"""Where a checkpoint keeps its FileParts' files, and what its manifest says of them (moved
from :mod:`.filepart`). Standard library only: ``resilient-ckpt inspect`` reads them without
torch."""

from __future__ import annotations

from .manifest import Manifest

PARTS_DIR = "parts"
PARTS_EXTRA = "parts"  # the manifest's ``extra`` key for what each part's describe() said


def part_dir(part_id: str) -> str:
    """The folder (relative to the checkpoint) of the part at ``part_id``."""
    return f"{PARTS_DIR}/{part_id}"


def parts_of_format(manifest: Manifest, fmt: str) -> list[str]:
    """The ids of the parts whose describe() recorded ``"format": fmt`` in ``manifest``."""
    described = manifest.extra.get(PARTS_EXTRA)
    if not isinstance(described, dict):
        return []
    return [pid for pid, d in described.items() if isinstance(d, dict) and d.get("format") == fmt]
