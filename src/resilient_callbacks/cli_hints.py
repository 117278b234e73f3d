"""What the CLI adds to a remote store's own error: where its client takes what it lacked.
Imported only when such an error is said."""

from __future__ import annotations


def credentials_hint(e: Exception) -> str:
    """The store's client found no credentials (botocore's NoCredentialsError, google-auth's
    DefaultCredentialsError, ...): where to give them. It said only the client's words."""
    if not any("credential" in t.__name__.lower() for t in type(e).__mro__):
        return ""
    return (
        " (give the store's credentials as its client reads them: for s3://, AWS_ACCESS_KEY_ID "
        "and AWS_SECRET_ACCESS_KEY, or -o profile=NAME, or -o key=... -o secret=...; "
        "-o anon=true for a public bucket; docs/remote.md)"
    )
