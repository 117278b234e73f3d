"""A remote URL behind fsspec's local cache (``simplecache::``, ``filecache::``) is refused.

The cache keeps the first copy of an object it read: a manifest replaced in the store since
(a damaged copy uploaded again, another run's checkpoint of that name) was read as the old one,
by the same store object and by a new one (fsspec's instance and its cache folder outlive it),
and the URL was a second store to the claims (``simplecache://...`` beside ``file://...``)."""

from __future__ import annotations

import pytest

from resilient_callbacks import Checkpointer
from resilient_callbacks.errors import ConfigError
from resilient_callbacks.remote import RemoteStore
from test_cli import cli, make_run


@pytest.mark.parametrize("link", ["simplecache", "filecache", "blockcache"])
def test_a_cached_url_is_refused_naming_the_url_to_give(tmp_path, link):
    store = tmp_path / "store"
    url = f"{link}::file://{store}"
    with pytest.raises(ConfigError) as e:
        RemoteStore(url)
    said = str(e.value)
    assert f"fsspec's local cache ({link}::)" in said and "stale" in said, said
    assert f"Give the store's own URL, 'file://{store}'" in said, said
    with pytest.raises(ConfigError, match="local cache"):
        Checkpointer(str(tmp_path / "ck"), remote=url)
    assert not store.exists()  # nothing written


def test_the_cli_refuses_a_cached_url_as_a_usage_error(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    store = tmp_path / "store"
    for args in (
        ["push", root, f"simplecache::file://{store}"],
        ["verify", f"simplecache::file://{store}"],
        ["pull", f"filecache::file://{store}", str(tmp_path / "pulled")],
    ):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "local cache" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not store.exists()
