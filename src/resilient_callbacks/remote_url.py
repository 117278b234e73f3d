"""How :class:`.remote.RemoteStore` opens a URL with fsspec: the options it is given (an
``s3://`` endpoint from the environment or the AWS profile, a ``gs://`` one from
``STORAGE_EMULATOR_HOST`` or Google's, pinned: :func:`pinned`), the URLs
refused (behind fsspec's local cache, :func:`refuse_cache`; of a scheme no filesystem takes,
:func:`unknown_scheme_error`), and what a missing Azure
filesystem's error adds (:func:`azure_account_hint`). Which ranks call what: whoever opens a
remote store; nothing collective.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import fsspec

from .errors import ConfigError, RemoteUnavailableError, usage
from .redact import url_text
from .store_key import configured_endpoint, gcs_endpoint, store_identity

__all__ = ["azure_account_hint", "pinned", "refuse_cache", "unknown_scheme_error"]


def azure_account_hint(url: str, options: Mapping[str, Any]) -> str:
    """For an ``az://``/``abfs://`` URL whose options and environment name no storage account
    (adlfs cannot open it without one, and said so only once installed): what to give."""
    protocol = fsspec.core.split_protocol(url)[0] or ""
    if protocol not in ("az", "abfs", "abfss") or "account_name" in store_identity(
        options, protocol
    ):
        return ""
    if any(
        os.environ.get(v) for v in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_CONNECTION_STRING")
    ):
        return ""
    return (
        " adlfs also needs the storage account, which neither the URL's options nor the "
        "environment name: remote_options={'account_name': 'NAME'} (resilient-ckpt: -o "
        "account_name=NAME) or AZURE_STORAGE_ACCOUNT_NAME, with a credential (account_key, "
        "sas_token), or a connection_string (AZURE_STORAGE_CONNECTION_STRING)."
    )


def pinned(url: str, options: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``options`` for opening ``url``, with the endpoint its client takes from the environment
    given as ``endpoint_url`` where they name none. ``s3://``: the one of the environment or
    the AWS profile (:func:`.store_key.configured_endpoint`): fsspec keeps one filesystem per
    set of options, so one opened under ``AWS_ENDPOINT_URL=A`` (or ``AWS_PROFILE``) was used
    again for the same URL after it changed to B, writing to A what the store's key said was
    B's. ``gs://``: the one gcsfs would use now (:func:`.store_key.gcs_endpoint`: an emulator's
    ``STORAGE_EMULATOR_HOST``, else Google's), which it otherwise reads again at every request:
    a store opened on real GCS went to an emulator named later, and one opened on an emulator
    to the emulator named after it (or to real GCS once the variable was unset), while its key
    still said the first. Also the ``s3://`` endpoint looked up ("" where none is configured;
    None where none was looked up), which :func:`.store_key.store_identity` takes as
    ``configured`` rather than reading the AWS config through a botocore session again (about
    12 ms a store)."""
    protocol = fsspec.core.split_protocol(url)[0] or ""
    if "endpoint_url" in store_identity(options):
        return options, None
    if protocol in ("gs", "gcs"):
        return {**options, "endpoint_url": gcs_endpoint()}, None
    if protocol not in ("s3", "s3a"):
        return options, None
    endpoint = configured_endpoint(protocol, options)
    # (a variable without a scheme is left to the client: pinning it as http:// would send a
    # secure endpoint's traffic in the clear, where the client refuses it)
    return ({**options, "endpoint_url": endpoint} if "://" in endpoint else options), endpoint


def refuse_cache(fs: Any, url: str) -> None:
    """A :class:`ConfigError` (a usage error: exit 2 in the CLI) for a URL behind fsspec's local cache (``simplecache::``,
    ``filecache::``, ``blockcache::``): it keeps the first copy of an object it read, and the
    store's manifests, claims and commit marks change (a manifest read again after a push
    replaced it, or in a later run of the process, was the old one); the store behind it was
    also a second store to the claims (its own key), so two writers could write it at once."""
    from fsspec.implementations.cached import CachingFileSystem

    if isinstance(fs, CachingFileSystem):
        link = url.split("::", 1)[0]
        plain = url_text(url.split("::")[-1].rstrip("/"))
        raise usage(
            ConfigError(
                f"remote={url_text(url)!r}: a URL behind fsspec's local cache ({link}::) is not "
                "taken: the cache keeps the first copy of a manifest, claim or commit mark it "
                "read, and these change, so a stale one would be believed. Nothing was read or "
                f"written. Give the store's own URL, {plain!r}: every download is verified and "
                "written to the local directory already, so the cache saves nothing"
            )
        )


def _unknown_scheme(url: str) -> str | None:
    """The scheme of a link of ``url`` (any of a chained ``a::b://``) that fsspec knows no
    filesystem for (``s4``), or None."""
    known = fsspec.available_protocols()
    for link in url.split("::"):
        proto = fsspec.core.split_protocol(link)[0]
        if proto and proto not in known:
            return str(proto)
    return None


def _schemes() -> tuple[list[str], dict[str, str]]:
    """The schemes fsspec knows: those whose package is installed here, and the others with
    the package each needs (``{"gs": "gcsfs"}``). Finds the packages, imports none."""
    from fsspec.registry import known_implementations, registry

    installed = set(registry)  # (registered at run time: importable by definition)
    absent: dict[str, str] = {}
    for proto, impl in known_implementations.items():
        package = str(impl.get("class", "")).split(".")[0]
        try:
            found = bool(package) and importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            installed.add(proto)
        elif proto not in installed:
            absent[proto] = package
    return sorted(installed), dict(sorted(absent.items()))


def unknown_scheme_error(url: str, options: str) -> RemoteUnavailableError | None:
    """For a ``url`` of a scheme fsspec knows no filesystem for (``s4://``, a typo): a usage
    error (exit 2 in the CLI) naming it, the closest one known, the schemes installed here
    and those that need a package; None where every scheme of ``url`` is known."""
    proto = _unknown_scheme(url)
    if proto is None:
        return None
    installed, absent = _schemes()
    near = difflib.get_close_matches(proto, [*installed, *absent], n=1, cutoff=0.5)
    guess = ""
    if near:
        need = f", which needs the package {absent[near[0]]}" if near[0] in absent else ""
        guess = f" (did you mean {near[0]}://{need}?)"
    others = ", ".join(f"{p} ({pkg})" for p, pkg in absent.items())
    return usage(
        RemoteUnavailableError(
            f"remote={url_text(url)!r} with remote_options {options}: Protocol not known: "
            f"{proto}. '{proto}://' is no scheme fsspec knows{guess}: check its spelling, or "
            f"install the package that provides {proto}://. Installed here: "
            f"{', '.join(installed)}"
            + (f"; known to fsspec, their package not installed: {others}" if others else "")
        )
    )
