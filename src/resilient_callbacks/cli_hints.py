"""What the CLI adds to a remote store's own error: where its client takes what it lacked.
Imported only when such an error is said."""

from __future__ import annotations

from .remote_paths import _chain, _no_answer, status_of

# what each client reads, in its own option names (s3fs, gcsfs, adlfs); -o KEY=VALUE passes
# them through as they are
_S3 = (
    "for s3://, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or -o profile=NAME, or -o key=... "
    "-o secret=...; -o anon=true for a public bucket"
)
_GCS = (
    "for gs://, GOOGLE_APPLICATION_CREDENTIALS=KEY.json or `gcloud auth application-default "
    "login`, or -o token=KEY.json; -o token=anon for a public bucket"
)
_AZURE = (
    "for az:// and abfs://, -o account_name=NAME with -o account_key=... or -o sas_token=..., "
    "or -o connection_string=... alone"
)
_GENERIC = "as -o KEY=VALUE options, named as its fsspec filesystem's arguments are, or its own"
_BY_PROTOCOL = {
    "s3": _S3,
    "s3a": _S3,
    "gs": _GCS,
    "gcs": _GCS,
    "az": _AZURE,
    "abfs": _AZURE,
    "abfss": _AZURE,
}


def protocol(url: str) -> str:
    """The protocol of the store ``url`` names: of the last link of a chained URL
    (``simplecache::s3://b/run1``: ``s3``); "" for a path without one."""
    last = url.split("::")[-1]
    return last.split("://", 1)[0].lower() if "://" in last else ""


_ENDPOINTS = {
    "s3": "AWS_ENDPOINT_URL or -o endpoint_url=URL",
    "s3a": "AWS_ENDPOINT_URL or -o endpoint_url=URL",
    "gs": "STORAGE_EMULATOR_HOST or -o endpoint_url=URL",
    "gcs": "STORAGE_EMULATOR_HOST or -o endpoint_url=URL",
    "az": "-o account_name=NAME or -o connection_string=...",
    "abfs": "-o account_name=NAME or -o connection_string=...",
    "abfss": "-o account_name=NAME or -o connection_string=...",
}


def hint(e: BaseException, url: str) -> str:
    """What the CLI adds to the store's error ``e``: where credentials go
    (:func:`credentials_hint`), or what to check when the store did not answer."""
    return credentials_hint(e, url) or no_answer_hint(e, url)


def no_answer_hint(e: BaseException, url: str) -> str:
    """The store's client got no answer (a refused connection, a timeout; ``e`` or an error
    it carries): that the store is up and reachable, and its endpoint, as ``url``'s client
    takes it. It said only the client's words ("Could not connect to the endpoint URL")."""
    if not any(_no_answer(x) for x in _chain(e)):
        return ""
    where = _ENDPOINTS.get(protocol(url))
    endpoint = f"the endpoint it was given ({where})" if where else "the URL's host"
    return (
        f" (the store did not answer: check that it is up and reachable from here, and {endpoint})"
    )


def credentials_hint(e: BaseException, url: str) -> str:
    """The store's client found no credentials, or the store did not take those it was given
    (:func:`lacks_credentials`): where the client of ``url``'s protocol takes them. It said
    only the client's words."""
    if not lacks_credentials(e):
        return ""
    where = _BY_PROTOCOL.get(protocol(url), _GENERIC)
    return f" (give the store's credentials as its client reads them: {where}; docs/remote.md)"


# azure-core's error for a 401 and for Azure Storage's AuthenticationFailed and
# InvalidAuthenticationInfo (a 403 for want of rights is its HttpResponseError: not this)
_AUTHENTICATION_CLASSES = frozenset(("ClientAuthenticationError",))


def lacks_credentials(e: BaseException) -> bool:
    """Whether ``e`` (or an error it carries) says the store's client had no credentials or
    the store did not take them: an error type named for credentials (botocore's
    NoCredentialsError, google-auth's DefaultCredentialsError, azure-identity's
    CredentialUnavailableError), azure-core's ClientAuthenticationError (adlfs), an HTTP 401
    (gcsfs's HttpError, which gcsfs raises once it fell back to anonymous access), or a 403
    that names an anonymous caller (gcsfs's ``OSError("Forbidden: ...")``). A 403 to
    credentials the store took is a refusal of rights, not this (``remote_paths.denied``:
    a refused delete is said on its own); an error of a request that got no answer is not
    this either, whatever it was raised in the handling of."""
    for x in _chain(e):  # (the outermost error that says what happened decides)
        if _no_answer(x):
            return False
        names = [t.__name__ for t in type(x).__mro__]
        if any("credential" in n.lower() for n in names) or _AUTHENTICATION_CLASSES & set(names):
            return True
        status = status_of(x)
        if status is not None:
            return status == 401 or (status == 403 and "anonymous caller" in str(x).lower())
    return False
