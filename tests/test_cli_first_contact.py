"""What a new user meets first with resilient-ckpt: a typo in a URL's scheme, a store that
needs credentials none were given for. Each is one error line that says what to do."""

from __future__ import annotations

import re

import pytest

from resilient_callbacks.errors import RemoteUnavailableError
from resilient_callbacks.remote import RemoteStore
from test_cli import cli, make_run


def test_an_unknown_url_scheme_says_how_to_fix_it(tmp_path):
    """``s4://`` (a typo) said only fsspec's "Protocol not known: s4"."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    for args in (
        ["verify", "s4://bucket/run1"],
        ["ls", root, "--remote", "s4://bucket/run1"],
        ["pull", "s4://bucket/run1", str(tmp_path / "pulled")],
        ["push", root, "simplecache::s4://bucket/run1"],
    ):
        r = cli(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert "'s4://' is no scheme fsspec knows: check its spelling" in r.stderr, r.stderr
    with pytest.raises(
        RemoteUnavailableError, match=re.escape("Protocol not known: s4. 's4://' is no")
    ):
        RemoteStore("s4://bucket/run1")
