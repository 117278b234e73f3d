"""What the CLI adds to a remote store's own error: where its client takes what it lacked.
Imported only when such an error is said."""

from __future__ import annotations

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


def credentials_hint(e: Exception, url: str) -> str:
    """The store's client found no credentials (botocore's NoCredentialsError, google-auth's
    DefaultCredentialsError, ...): where the client of ``url``'s protocol takes them. It said
    only the client's words."""
    if not any("credential" in t.__name__.lower() for t in type(e).__mro__):
        return ""
    where = _BY_PROTOCOL.get(protocol(url), _GENERIC)
    return f" (give the store's credentials as its client reads them: {where}; docs/remote.md)"
