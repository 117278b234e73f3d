"""Which store a remote URL and its options name (:attr:`.remote.RemoteStore.key`): the
options that say which service or account holds it (:func:`store_identity`), normalised.
Moved from ``remote.py``. Which ranks call what: whoever opens a remote store; nothing
collective.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["IDENTITY_OPTIONS", "configured_endpoint", "gcs_endpoint", "store_identity"]


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


def store_identity(
    options: Mapping[str, Any], protocol: str = "", configured: str | None = None
) -> dict[str, str]:
    """The options of :data:`IDENTITY_OPTIONS` among ``options`` (also nested, as
    ``client_kwargs.endpoint_url``), and the account an Azure ``connection_string`` names,
    normalised so that one store spelled two ways gives one identity (two keys for one store
    would let two writers of this process write it at once): an option by its name whatever
    its depth (``endpoint`` as ``endpoint_url``; s3fs's top-level one before its
    ``client_kwargs``' one), a URL's scheme and host in lower case, without a trailing slash or
    its scheme's default port; for ``protocol``, the endpoint its client takes from the
    environment where no option gives one (S3: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``;
    GCS: ``STORAGE_EMULATOR_HOST``), the service's own public endpoint (any ``amazonaws.com``
    host on S3, ``storage.googleapis.com`` on GCS) as no endpoint, a port its default (22 on
    sftp) as none, and an Azure account however it is given (name, account URL or host,
    connection string) as its name. ``configured``: :func:`configured_endpoint` of
    ``protocol`` and ``options``, looked up already (None: looked up here where needed)."""
    found: dict[str, list[str]] = {}  # name -> values, the shallowest first

    def walk(opts: Mapping[str, Any]) -> None:
        nested = []
        for k, v in opts.items():
            name = str(k).lower()
            name = _ALIASES.get(name, name)
            if isinstance(v, Mapping):
                nested.append(v)
            elif name in IDENTITY_OPTIONS and v not in (None, ""):
                found.setdefault(name, []).append(str(v))
            elif name == "connection_string" and isinstance(v, str):
                for part in v.split(";"):
                    key, _, value = part.partition("=")
                    key = key.strip().lower()
                    if key in _CONNECTION_PARTS and value.strip():
                        found.setdefault(_CONNECTION_PARTS[key], []).append(value.strip())
        for v in nested:
            walk(v)

    walk(options)
    out = {name: _normal(values[0]) for name, values in found.items()}
    if configured is None and "endpoint_url" not in out:
        configured = configured_endpoint(protocol, options)
    if "endpoint_url" not in out and (value := configured):
        out["endpoint_url"] = _normal(value if "://" in value else f"http://{value}")
    host = urlsplit(out.get("endpoint_url", "")).hostname or ""
    if host and _public(protocol, host):
        del out["endpoint_url"]
    if protocol in _AZURE:
        for name in ("account_url", "account_host", "endpoint_url"):
            value = out.get(name, "")
            h = (urlsplit(value).hostname if "://" in value else value) or ""
            m = _AZURE_HOST.match(h)
            if m and out.get("account_name", m.group(1)) == m.group(1):
                out["account_name"] = m.group(1)
                del out[name]
        if out.get("endpointsuffix") == "core.windows.net":
            del out["endpointsuffix"]
    if out.get("port") == str(_DEFAULT_PORTS.get(protocol)):
        del out["port"]
    return out


_ALIASES = {"endpoint": "endpoint_url"}
# in an Azure connection string, the parts that name the account (never its key), as options
_CONNECTION_PARTS = {
    "accountname": "account_name",
    "blobendpoint": "account_url",
    "endpointsuffix": "endpointsuffix",
}
# the environment variables S3's client takes its endpoint from, in its order
_S3_ENV_ENDPOINTS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_S3 = ("s3", "s3a")
_GCS = ("gs", "gcs")
_AZURE = ("az", "abfs", "abfss", "adl")
_AZURE_HOST = re.compile(r"^([a-z0-9]+)\.(?:blob|dfs)\.core\.windows\.net$")
_DEFAULT_PORTS = {"http": 80, "https": 443, "sftp": 22, "ssh": 22, "ftp": 21, "smb": 445}


def configured_endpoint(protocol: str, options: Mapping[str, Any]) -> str:
    """The endpoint the client of ``protocol`` takes where ``options`` give none, "" if none: on
    S3 (as botocore looks it up) ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, then the AWS
    config file's profile (``-o profile=NAME``, else ``AWS_PROFILE``): its ``services``
    section's ``s3`` ``endpoint_url``, then its own ``endpoint_url``; on GCS
    ``STORAGE_EMULATOR_HOST``, as written (a host without a scheme stays so; ``default``, which
    gcsfs takes for unset, is none). Without the profile's, two servers reached by two profiles
    were one store to the claims (a second writer refused as another run's).
    ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` is botocore's: it leaves GCS's as it is (it hid an
    emulator from the key of a ``gs://`` store, which gcsfs still went to)."""
    if protocol in _GCS:
        value = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
        return "" if value == "default" else value
    if protocol not in _S3 or _env_endpoints_ignored():
        return ""
    for var in _S3_ENV_ENDPOINTS:
        if value := os.environ.get(var, "").strip():
            return value
    return _profile_endpoint(options.get("profile"))


def gcs_endpoint() -> str:
    """The endpoint gcsfs sends a ``gs://`` store's requests to where its options give no
    ``endpoint_url``, as it reads it now: ``STORAGE_EMULATOR_HOST`` (``http://`` before a host
    without a scheme, as gcsfs puts it), else Google's own (``https://storage.`` and
    ``GOOGLE_CLOUD_UNIVERSE_DOMAIN``, ``googleapis.com`` where unset). gcsfs reads the variable
    again at every request, not when the filesystem is made: :func:`.remote_url.pinned` gives
    this as the option, so that a store goes on to the server it opened on."""
    value = configured_endpoint("gs", {})
    if value:
        return value if value.startswith(("http://", "https://")) else f"http://{value}"
    domain = os.environ.get("GOOGLE_CLOUD_UNIVERSE_DOMAIN", "").strip() or "googleapis.com"
    return f"https://storage.{domain}"


def _profile_endpoint(profile: Any) -> str:
    """The S3 endpoint the AWS config file gives ``profile`` (None: the one botocore picks,
    ``AWS_PROFILE`` or the default); "" where none, or botocore cannot read it."""
    try:
        import botocore.session
    except ImportError:  # (no s3fs either: the store cannot be opened, said there)
        return ""
    try:
        session = botocore.session.Session(profile=str(profile) if profile else None)
        scoped = session.get_scoped_config()
        if str(scoped.get("ignore_configured_endpoint_urls", "")).lower() == "true":
            return ""
        services = session.full_config.get("services", {}).get(scoped.get("services", ""), {})
        value = services.get("s3", {}).get("endpoint_url") or scoped.get("endpoint_url")
    except Exception:  # a profile that is not there: s3fs's own error says so when it opens
        return ""
    return str(value or "").strip()


def _env_endpoints_ignored() -> bool:
    return os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true"


def _public(protocol: str, host: str) -> bool:
    """Whether ``host`` is the service's own endpoint, the one its client takes without one."""
    if protocol in _S3:  # (every region's, dual-stack, VPC: bucket names are global)
        return host == "amazonaws.com" or host.endswith(".amazonaws.com")
    if protocol in _GCS:
        return host in ("storage.googleapis.com", "www.googleapis.com")
    return False


def _normal(value: str) -> str:
    value = value.strip().rstrip("/")
    if "://" not in value:  # (a host, an account, a port)
        return value.lower()
    parts = urlsplit(value)
    scheme, netloc = parts.scheme.lower(), parts.netloc.lower()
    port = _DEFAULT_PORTS.get(scheme)
    if port is not None and netloc.endswith(f":{port}"):
        netloc = netloc[: -len(f":{port}")]
    return urlunsplit((scheme, netloc, parts.path, parts.query, "")).rstrip("/")
