"""``az://``/``abfs://`` without adlfs: the error said only to install adlfs, and once installed
adlfs refused a URL without its storage account ("Must provide either a connection_string or
account_name with credentials"). The first error now names the account to give, and how,
where neither the options nor the environment give one. (adlfs is not installed here: the
error of the library opening a URL whose package is missing is what is tested.)"""

from __future__ import annotations

import importlib.util

import pytest

from resilient_callbacks.errors import RemoteUnavailableError
from resilient_callbacks.remote import RemoteStore
from test_cli import cli

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("adlfs") is not None, reason="adlfs is installed: it opens the URL"
)
NAMED = "AZURE_STORAGE_ACCOUNT_NAME"


@pytest.mark.parametrize("url", ["az://box/run1", "abfs://box/run1"])
def test_an_azure_url_without_an_account_names_the_option(url, monkeypatch):
    monkeypatch.delenv(NAMED, raising=False)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    with pytest.raises(RemoteUnavailableError) as e:
        RemoteStore(url)
    said = str(e.value)
    assert "not installed" in said and "adlfs" in said, said
    assert "remote_options={'account_name': 'NAME'}" in said and NAMED in said, said
    r = cli("verify", url)
    assert r.returncode == 1 and "-o account_name=NAME" in r.stderr, r.stderr


def test_no_account_hint_where_one_is_given(monkeypatch):
    monkeypatch.delenv(NAMED, raising=False)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    for options in ({"account_name": "acct"}, {"connection_string": "AccountName=acct;x=y"}):
        with pytest.raises(RemoteUnavailableError) as e:
            RemoteStore("az://box/run1", options)
        assert "not installed" in str(e.value) and NAMED not in str(e.value), str(e.value)
    monkeypatch.setenv(NAMED, "acct")
    with pytest.raises(RemoteUnavailableError) as e:
        RemoteStore("az://box/run1")
    assert NAMED not in str(e.value)
