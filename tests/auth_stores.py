"""Stores that take no credentials, as gcsfs and adlfs say it, registered under ``gs``, ``gcs``,
``az`` and ``abfs`` in the process that imports this (a CLI run in a subprocess: see
test_cli_first_contact). Every request is answered with the error ``RC_AUTH_STYLE`` names, of
the types and texts those clients raise (gcsfs.retry.validate_response, azure-core's errors);
neither client is installed here."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class HttpError(Exception):
    """As gcsfs.retry.HttpError: the message and ``.code`` of a cloud error answer."""

    def __init__(self, error: dict[str, Any]) -> None:
        self.code, self.message = error.get("code"), f"{error.get('message', '')}, {error['code']}"
        super().__init__(self.message)


class AzureError(Exception):
    """As azure.core.exceptions.AzureError."""


class HttpResponseError(AzureError):
    """As azure.core.exceptions.HttpResponseError: ``.status_code``, ``.reason``."""

    def __init__(self, message: str, status_code: int, reason: str) -> None:
        super().__init__(message)
        self.status_code, self.reason = status_code, reason


class ClientAuthenticationError(HttpResponseError):
    """As azure.core.exceptions.ClientAuthenticationError (401; Azure Storage's
    AuthenticationFailed, a 403)."""


_ANON = "Anonymous caller does not have storage.objects.list access to the Google Cloud Storage"


def _error(style: str, path: str) -> Exception:
    if style == "gcs-401":  # gcsfs, fallen back to anonymous access: not retried, raised as is
        return HttpError({"code": 401, "message": f"{_ANON} bucket."})
    if style == "gcs-403-anon":  # gcsfs: validate_response's 403
        return OSError(f"Forbidden: {path}\n{_ANON} bucket.")
    if style == "gcs-403-rights":  # credentials taken, rights missing: a refusal
        return OSError(f"Forbidden: {path}\nrc@p.iam does not have storage.objects.list access")
    if style == "azure-auth":  # no or a wrong account key, SAS token
        msg = "Server failed to authenticate the request.\nErrorCode:AuthenticationFailed"
        return ClientAuthenticationError(msg, 403, "Server failed to authenticate the request.")
    if style == "azure-rights":  # credentials taken, rights missing: a refusal
        msg = "This request is not authorized to perform this operation using this permission."
        return HttpResponseError(msg, 403, "AuthorizationPermissionMismatch")
    raise AssertionError(style)


class NoCredentialsFS(MemoryFileSystem):
    """Every listing and read answered with ``RC_AUTH_STYLE``'s error."""

    protocol: ClassVar = ("gs", "gcs", "az", "abfs")
    store: ClassVar[dict] = {}
    pseudo_dirs: ClassVar[list] = [""]

    def _refuse(self, path: Any) -> Exception:
        return _error(os.environ["RC_AUTH_STYLE"], str(path))

    def ls(self, path, detail=True, **kwargs):
        raise self._refuse(path)

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        raise self._refuse(path)  # (as gcsfs's and adlfs's own find: not fsspec's walk)

    def info(self, path, **kwargs):
        raise self._refuse(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        raise self._refuse(path)


for _protocol in NoCredentialsFS.protocol:
    fsspec.register_implementation(_protocol, NoCredentialsFS, clobber=True)
