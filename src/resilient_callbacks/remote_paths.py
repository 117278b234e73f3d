"""fsspec calls that take a remote path literally.

fsspec reads a path given to ``rm``, ``cat``, ``get`` or ``put`` as a plain string (and each
path of a list given to ``rm`` or ``cat``) as a glob pattern where it holds ``*``, ``?`` or
``[``. A user's prefix may hold them (``s3://bucket/exp?1``, ``s3://bucket/run[1]``): as a
pattern, ``exp?1/step_000000001`` also names ``expA1/step_000000001``, another run's
checkpoint, and ``run[1]/...`` names ``run1/...`` and not itself. Every path the package
builds is literal, so these helpers never let fsspec expand one: a path without those
characters takes fsspec's batched call as before, one with them a call per object that does
not expand (``cat_file``, ``rm_file``, ``find``). ``get`` and ``put`` are always given two
lists (fsspec expands neither then), and :func:`escape` makes a pattern of a literal prefix.
On S3 (s3fs) :func:`delete` and :func:`rm_tree` send the keys themselves in batched deletes
(``DeleteObjects``, which expands nothing): a prefix with those characters no longer costs a
request per object, and the keys the store refuses in a batch are returned, not dropped.

Which ranks call what: whoever reads or writes the remote store; nothing collective.
"""

from __future__ import annotations

import errno
import re
from typing import Any

__all__ = ["cat", "delete", "escape", "has_magic", "rm", "rm_tree"]

_MAGIC = re.compile(r"[*?[]")
S3_BATCH = 1000  # keys per DeleteObjects request (S3's limit)


def has_magic(path: str) -> bool:
    """Whether fsspec would read ``path`` as a glob pattern."""
    return _MAGIC.search(path) is not None


def escape(path: str) -> str:
    """``path`` as a glob pattern that matches only itself (``exp?1`` -> ``exp[?]1``), to put
    in front of a pattern of one's own."""
    return _MAGIC.sub(lambda m: f"[{m.group(0)}]", path)


def cat(fs: Any, paths: list[str]) -> dict[str, Any]:
    """``fs.cat(paths, on_error="return")`` with every path taken literally: path (as the
    store spells it, without its protocol) -> bytes, or the exception its read raised."""
    plain = [p for p in paths if not has_magic(p)]
    got: dict[str, Any] = dict(fs.cat(plain, on_error="return")) if plain else {}
    for p in paths:
        if has_magic(p):
            try:
                got[fs._strip_protocol(p)] = fs.cat_file(p)
            except Exception as e:  # as fs.cat's on_error="return" gives it
                got[fs._strip_protocol(p)] = e
    return got


def rm(fs: Any, paths: list[str]) -> None:
    """Delete the objects ``paths`` (files, not folders), each taken literally."""
    plain = [p for p in paths if not has_magic(p)]
    if plain:
        fs.rm(plain)
    for p in paths:
        if has_magic(p):
            fs.rm_file(p)


def rm_tree(fs: Any, path: str) -> None:
    """``fs.rm(path, recursive=True)`` with ``path`` taken literally: every object under the
    folder ``path``, and the folder (``FileNotFoundError`` where there is nothing; the first
    object the store refused to delete raises its error, after the others went)."""
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if not has_magic(path) or proto in ("file", "local"):  # (a local rm expands nothing)
        fs.rm(path, recursive=True)
        return
    found = fs.find(path)
    if not found:
        raise FileNotFoundError(path)
    refused = delete(fs, found)
    if refused:
        raise next(iter(refused.values()))


def batches_literally(fs: Any, path: str) -> bool:
    """Whether :func:`delete` removes objects under ``path`` in batches (else one request
    each): always on S3, elsewhere where ``path`` holds nothing fsspec reads as a pattern."""
    return _s3(fs) or not has_magic(path)


def lists_by_prefix(fs: Any) -> bool:
    """Whether ``fs.find(path, prefix=...)`` lists only the names under ``path`` that start
    with it (S3: one request for a few markers among thousands of blobs)."""
    return _s3(fs)


def reports_refusals(fs: Any) -> bool:
    """Whether :func:`delete` names every object the store refused (S3); elsewhere a batch
    the store partly kept raises nothing (list again to know)."""
    return _s3(fs)


def answered(fs: Any, e: BaseException) -> bool:
    """Whether a delete request that raised ``e`` was answered by the store, so that it did
    nothing and does nothing later: on a local filesystem or ``memory://`` always (done in
    this process); elsewhere an object missing, access denied (:func:`denied`), or an error
    answer of 4xx or 501 (a request the store does not take), whichever backend says it
    (:func:`status_of`). A timeout, a connection reset, a 500 or 503: no answer, the store
    may carry the delete out later."""
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if proto in ("file", "local", "memory"):
        return True
    for x in _chain(e):  # (the outermost error that says what happened decides)
        if _no_answer(x):
            return False
        if isinstance(x, FileNotFoundError):
            return True
        status = status_of(x)
        if status is not None:
            return 400 <= status < 500 or status == 501
        if _denied_here(x):
            return True
    return False


_DENIED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)
# gcsfs's batched delete raises the JSON of the first object's error answer as an OSError's text
_CODE_IN_TEXT = re.compile(r'"code"\s*:\s*"?(\d{3})\b')


def denied(e: BaseException) -> bool:
    """Whether ``e`` (or an error it carries) is a store's refusal for lack of rights, however
    the backend says it: ``PermissionError`` (s3fs's AccessDenied, a local filesystem), an
    ``OSError`` of errno EACCES, EPERM or EROFS, or an HTTP status 401 or 403
    (:func:`status_of`: gcsfs, adlfs, aiohttp, botocore). The outermost error that says what
    happened decides: a 5xx or a timeout raised while handling a 403 is no refusal, nor is a
    connection that failed before any answer (:func:`_no_answer`: aiohttp's
    ``ClientConnectorError`` carries the socket's errno, EPERM where a local firewall drops
    it, EACCES where SELinux does)."""
    for x in _chain(e):
        if _no_answer(x):
            return False
        status = status_of(x)
        if status is not None:
            return status in (401, 403)
        if _denied_here(x):
            return True
    return False


def _denied_here(x: BaseException) -> bool:
    return isinstance(x, PermissionError) or getattr(x, "errno", None) in _DENIED_ERRNOS


# the errors of a request that got no answer, by class name (no client imported): the store
# said nothing, whatever errno the local socket gave (aiohttp, botocore, azure-core)
_NO_ANSWER_CLASSES = frozenset(
    (
        "ClientConnectionError",  # aiohttp: ClientConnectorError, ServerDisconnectedError, ...
        "ServerTimeoutError",
        "EndpointConnectionError",  # botocore
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ServiceRequestError",  # azure-core: the request never reached the service
        "ServiceResponseError",
    )
)


def _no_answer(x: BaseException) -> bool:
    """Whether ``x`` says that a request got no answer (a connection that failed or was cut,
    a timeout): what it carries (the socket's error) says nothing of the store."""
    return isinstance(x, (ConnectionError, TimeoutError)) or any(
        c.__name__ in _NO_ANSWER_CLASSES for c in type(x).__mro__
    )


def status_of(e: BaseException) -> int | None:
    """The HTTP status of the error answer ``e`` stands for, where it says one: botocore's
    ``.response`` (s3fs's cause), ``.status_code`` (azure-core, adlfs; a requests
    ``.response``), ``.status`` (aiohttp), ``.code`` (gcsfs's ``HttpError``); gcsfs's 403 is
    an ``OSError`` whose text starts ``Forbidden:``, its batched delete's error the JSON of the
    answer (``"code": 403``)."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata")
        status = _status(meta.get("HTTPStatusCode")) if isinstance(meta, dict) else None
        if status is not None:
            return status
    elif response is not None:
        status = _status(getattr(response, "status_code", None))
        if status is not None:
            return status
    for attr in ("status_code", "status", "code"):
        status = _status(getattr(e, attr, None))
        if status is not None:
            return status
    if type(e) is OSError and e.errno is None:  # (gcsfs's: only its text says)
        text = str(e)
        if text.startswith("Forbidden:"):
            return 403
        if text.lstrip().startswith("{") and (m := _CODE_IN_TEXT.search(text)):
            return int(m.group(1))
    return None


def _status(value: Any) -> int | None:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
        return value
    return None


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the errors it carries: its cause, the error it was raised in the handling of,
    and one given among its arguments (adlfs: ``RuntimeError("Failed to remove %s for %s",
    path, e)``); a few levels deep."""
    out: list[BaseException] = []
    todo = [e]
    while todo and len(out) < 8:
        x = todo.pop(0)
        if any(x is y for y in out):
            continue
        out.append(x)
        if _no_answer(x):  # (what it carries is the local socket's: not looked into)
            continue
        inner = [a for a in x.args if isinstance(a, BaseException)]
        context = None if x.__suppress_context__ else x.__context__
        todo += [c for c in (x.__cause__, context, *inner) if c is not None]
    return out


def delete_right(protocol: str) -> str:
    """What to grant for deletes on a store of ``protocol``, for a message."""
    if protocol in ("s3", "s3a"):
        return "s3:DeleteObject in the credentials' policy"
    if protocol in ("gs", "gcs"):
        return "storage.objects.delete (a role such as Storage Object Admin)"
    if protocol in ("az", "abfs", "abfss", "adl"):
        return (
            "delete rights on the container (a role such as Storage Blob Data Contributor, "
            "or a SAS token with the d permission)"
        )
    if protocol in ("file", "local"):
        return "write permission on the folder (not a read-only mount)"
    return "delete rights to the credentials in remote_options"


def delete(fs: Any, paths: list[str]) -> dict[str, Exception]:
    """Delete the objects ``paths`` (files, each taken literally), in batches where the store
    can; returns those the store refused, each with its error (an object already gone is
    deleted). On S3 a batch is one ``DeleteObjects`` of the keys themselves, whose answer names
    each key refused (s3fs's ``rm`` drops that answer); elsewhere the paths without pattern
    characters go in one ``fs.rm`` (which raises for the batch; what it silently kept is not
    known here) and the others one by one; a batch the store answered with an error (a
    refusal, :func:`answered`) is sent again one object at a time, each refusal returned. A
    request that fails without an answer (a batch, or one object's) raises."""
    if _s3(fs):
        return _s3_delete(fs, paths)
    refused: dict[str, Exception] = {}
    plain = [p for p in paths if not has_magic(p)]
    single = [p for p in paths if has_magic(p)]
    if plain:
        try:
            fs.rm(plain)
        except Exception as e:
            if not answered(fs, e):
                raise  # (no answer: the store may still carry it out; the caller says so)
            # the store answered the batch with an error (a refusal: gcsfs's OSError, adlfs's
            # RuntimeError; an object gone meanwhile), which does not say which objects it
            # kept: each one again by itself, so that each refusal is named
            single = paths
    for p in single:
        try:
            fs.rm_file(p)
        except FileNotFoundError:
            pass
        except Exception as e:
            if not answered(fs, e):
                raise  # (a timeout, a 5xx: an outage, not a refusal; as for the batch)
            refused[p] = e
    return refused


def _s3(fs: Any) -> bool:
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return proto in ("s3", "s3a") and callable(getattr(fs, "call_s3", None))


def _s3_delete(fs: Any, paths: list[str]) -> dict[str, Exception]:
    refused: dict[str, Exception] = {}
    by_bucket: dict[str, dict[str, str]] = {}  # bucket -> key -> the path given
    for p in paths:
        bucket, key, _ = fs.split_path(p)
        by_bucket.setdefault(bucket, {})[key] = p
    for bucket, keys in by_bucket.items():
        names = list(keys)
        for i in range(0, len(names), S3_BATCH):
            chunk = names[i : i + S3_BATCH]
            objects = [{"Key": k} for k in chunk]
            try:
                out = fs.call_s3(
                    "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
                )
            finally:
                for k in chunk:
                    fs.invalidate_cache(keys[k])
            for err in out.get("Errors") or []:
                key, code = str(err.get("Key")), str(err.get("Code") or "Error")
                if key in keys and code != "NoSuchKey":
                    why = f"{code}: {err.get('Message') or 'refused'} ({keys[key]})"
                    refused[keys[key]] = (
                        PermissionError(why) if code == "AccessDenied" else OSError(why)
                    )
    return refused
