"""What the docs tell users to import exists where they are told to import it."""

from __future__ import annotations

import re
from pathlib import Path

import resilient_callbacks

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_error_in_the_guide_table_is_importable_from_the_package():
    """docs/guide.md's table of errors and warnings (found 2026-11-25: RemoteUnavailableError
    was listed there, and caught in remote.md's examples, but not importable from the
    package)."""
    text = (DOCS / "guide.md").read_text()
    names = set(re.findall(r"^\| `(\w+(?:Error|Warning))` \|", text, re.MULTILINE))
    assert len(names) >= 9, names
    missing = sorted(n for n in names if not hasattr(resilient_callbacks, n))
    assert not missing, f"documented but not importable from resilient_callbacks: {missing}"
    assert not sorted(n for n in names if n not in resilient_callbacks.__all__)
