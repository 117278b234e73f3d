"""Which store a remote URL and its options name (:attr:`.remote.RemoteStore.key`): the
options that say which service or account holds it (:func:`store_identity`), normalised.
Moved from ``remote.py``. Which ranks call what: whoever opens a remote store; nothing
collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["IDENTITY_OPTIONS", "store_identity"]


#: storage options (any depth, names compared in lower case) that say which service or
#: account holds a store, so that one root on two of them is two stores: s3fs's and gcsfs's
#: ``endpoint_url`` (also under ``client_kwargs``), adlfs's account, the host and port that
#: fsspec takes from an ``sftp://``, ``ftp://``, ``hdfs://``, ``smb://`` URL. Credentials and
#: tuning are not among them: the same store written with other ones is the same store.
IDENTITY_OPTIONS = (
    "endpoint_url",
    "endpoint",
    "host",
    "port",
    "account_name",
    "account_url",
    "account_host",
    "instance",
)
# in an Azure connection string, the parts that name the account (never its key)
_CONNECTION_PARTS = ("accountname", "blobendpoint", "endpointsuffix")


def store_identity(options: Mapping[str, Any]) -> dict[str, str]:
    """The options of :data:`IDENTITY_OPTIONS` among ``options`` (also nested, as
    ``client_kwargs.endpoint_url``), and the account an Azure ``connection_string`` names,
    normalised: a URL's scheme and host in lower case, without a trailing slash."""
    out: dict[str, str] = {}

    def walk(opts: Mapping[str, Any], prefix: str) -> None:
        for k, v in opts.items():
            name = str(k).lower()
            if isinstance(v, Mapping):
                walk(v, f"{prefix}{name}.")
            elif name in IDENTITY_OPTIONS and v not in (None, ""):
                out[prefix + name] = _normal(str(v))
            elif name == "connection_string" and isinstance(v, str):
                for part in v.split(";"):
                    key, _, value = part.partition("=")
                    if key.strip().lower() in _CONNECTION_PARTS and value:
                        out[f"{prefix}{name}.{key.strip().lower()}"] = _normal(value.strip())

    walk(options, "")
    return out


def _normal(value: str) -> str:
    value = value.rstrip("/")
    if "://" not in value:  # (a host, an account, a port)
        return value.lower()
    parts = urlsplit(value)
    return urlunsplit(
        (parts.scheme.lower(), parts.netloc.lower(), parts.path, parts.query, "")
    ).rstrip("/")
