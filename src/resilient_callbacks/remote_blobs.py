"""The blob store of the remote tier: ``<url>/blobs/<name>``, shared by the remote checkpoints
as the local store is by the local ones (see :mod:`.blobs`).

- Upload (:mod:`.remote_blob_put`): a blob already there with its size is checked to hold the local blob's bytes, once
  per process (:mod:`.remote_blob_check`: a name is its tensor's hash, not its stored
  bytes'), and then not uploaded again; other bytes there are uploaded again, loudly, unless
  a committed remote checkpoint records them (another encoding of the tensor: then the
  upload fails). The blobs go up before the checkpoint's files and its manifest (the commit
  point), so a committed remote checkpoint never names a missing blob. While an upload runs,
  an in-flight marker ``blobs/.inflight-<id>.json`` lists the blobs it relies on (and the
  run), so that a collection by another process writing to the same URL (another run) does
  not delete them; a marker older than :data:`INFLIGHT_TTL_S` was left by a crash and is
  ignored and removed. A collection that read the markers before the upload wrote its own is
  announced (``blobs/.collect-<id>.json``): before the commit the upload waits for it to end
  and uploads again what it deleted (:func:`.remote_blob_put.settle`).
- A blob of the same name with another size is never replaced while a committed remote
  checkpoint or another run's fresh marker names it. Otherwise it is what a killed upload left
  (a torn copy: an earlier process of this run, the only one uploading the run) and is
  uploaded again. On a ``file://`` remote each blob is copied to a temporary name and renamed
  into place, so a kill leaves no torn blob there (an object store's put is atomic already).
- Collection (after the remote retention deleted checkpoints): the live set is every blob named
  by a committed remote manifest, plus those of fresh markers. A manifest that cannot be read
  stops the collection. Announced, bounded in time: see :func:`collect`.
- Download: each blob into the local store (``<dir>/blobs``), through a temporary name,
  verified (size, xxh3-64) before it is renamed into place (:mod:`.remote_blob_fetch`).

Which ranks call what: only the coordinator talks to the remote store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any

from . import remote_paths
from .blobs import BLOBS_DIR, NAME_RE
from .remote_blob_fetch import DIGESTING, download  # noqa: F401 (re-exported: their old home)
from .upload_thread import not_superseded

if TYPE_CHECKING:
    from .remote import RemoteEntry, RemoteStore

log = logging.getLogger("resilient_callbacks")

INFLIGHT_PREFIX = ".inflight-"
INFLIGHT_TTL_S = 24 * 3600.0
COLLECT_PREFIX = ".collect-"  # a collection running (see collect)
COLLECT_MAX_S = 60.0  # a collection deletes nothing later than this after announcing itself
COLLECT_MARGIN_S = 30.0  # for a delete sent before then that lands later
COLLECT_POLL_S = 0.5
LIST_PAGE = 1000  # keys per listing request (S3's page)
DELETE_BATCH = 500  # unused blobs deleted per request on an object store (S3 takes 1000)
UPLOAD_PREFIX = ".upload-"  # a blob being copied to a file:// remote, renamed when complete


def _dir(store: RemoteStore) -> str:
    return store._path(BLOBS_DIR)


def listing(store: RemoteStore) -> dict[str, int]:
    """Blob name -> size of every blob (and marker) under ``<url>/blobs``."""
    return {name: int(info.get("size") or 0) for name, info in _infos(store).items()}


def _infos(store: RemoteStore, prefix: str = "") -> dict[str, dict[str, Any]]:
    """Blob name -> the store's listing of it, for every blob (and marker) under ``<url>/blobs``
    whose name starts with ``prefix`` (on S3 listed by that prefix: the in-flight markers
    alone were read with every page of thousands of blobs)."""
    store.fs.invalidate_cache()
    by_prefix = {"prefix": prefix} if prefix and remote_paths.lists_by_prefix(store.fs) else {}
    try:
        found = store.fs.find(_dir(store), detail=True, **by_prefix)
    except FileNotFoundError:
        return {}
    out = {
        posixpath.basename(path.rstrip("/")): info
        for path, info in found.items()
        if info.get("type") != "directory"
    }
    return {n: info for n, info in out.items() if n.startswith(prefix)}


def _markers(store: RemoteStore) -> dict[str, tuple[bool, list[str], str | None]]:
    """Every in-flight marker: name -> (fresh, the blobs it names, its run or None)."""
    now, out = time.time(), {}
    for name in _infos(store, INFLIGHT_PREFIX):
        try:
            body: Any = json.loads(store.fs.cat_file(posixpath.join(_dir(store), name)))
            fresh = now - float(body["created"]) < INFLIGHT_TTL_S
            blobs, run = [str(b) for b in body["blobs"]], body.get("run_id")
        except Exception:  # torn or foreign: treat as stale
            fresh, blobs, run = False, [], None
        out[name] = (fresh, blobs, None if run is None else str(run))
    return out


def end_upload(store: RemoteStore, marker: str | None) -> None:
    if marker is not None:
        store.blobs_verified.beside_collection.discard(marker)
        with contextlib.suppress(Exception):
            store.fs.rm_file(marker)


def collect(
    store: RemoteStore,
    entries: list[RemoteEntry] | None = None,
    dry_run: bool = False,
    names: dict[str, int] | None = None,
) -> list[str]:
    """Delete the remote blobs no committed remote checkpoint and no fresh in-flight marker
    names. Returns the names deleted (with ``dry_run``, those it would delete, deleting
    nothing; ``entries``: the scan to plan with, after the deletions it plans, and ``names``
    the blobs that scan's listing saw, else listed; a real collection scans itself).

    Against another process writing to the same URL (another run), a collection announces
    itself first (a marker ``blobs/.collect-<id>.json`` naming its host and pid, removed when
    it ends; left in place where a delete request got no answer and may still land:
    :func:`_leave`), then reads the
    in-flight markers, then the manifests (an upload that committed meanwhile is seen), and
    stops deleting :data:`COLLECT_MAX_S` after its announcement (the rest is left for the next
    collection). An upload that relied on a blob re-checks it before its commit once no
    collection announced before is running (:func:`.remote_blob_put.settle`)."""
    if dry_run:
        if entries is None:
            entries, names = store.scan_with_blobs()
        return _collect(store, entries, None, names=names)
    not_superseded(store.url)  # (an upload thread the next writer took the store over from)
    if store.is_local:
        store.fs.makedirs(_dir(store), exist_ok=True)
    token = posixpath.join(_dir(store), f"{COLLECT_PREFIX}{uuid.uuid4().hex[:12]}.json")
    body: dict[str, Any] = {"created": time.time(), "host": socket.gethostname()}
    store.fs.pipe_file(token, json.dumps({**body, "pid": os.getpid()}).encode())
    unanswered: list[str] = []  # delete requests that may still land (see _delete)
    try:
        return _collect(store, None, time.monotonic() + COLLECT_MAX_S, unanswered)
    finally:
        if unanswered:
            _leave(store, token, body, unanswered)
        else:
            end_upload(store, token)


def _leave(store: RemoteStore, token: str, body: dict[str, Any], unanswered: list[str]) -> None:
    """Leave the collection marker ``token`` in place: a delete request got no answer and
    may still land, deleting a blob an upload relies on; an upload that lists the marker
    settles (waits out its time bound from then, or from the marker's time as the store lists
    it, and removes it). Written again without the pid, which would tell an upload of this
    host, once this process exited, not to wait for it."""
    log.info(
        "remote %s: leaving the collection marker %s/%s in place: %s got no answer from the "
        "store and may still delete blobs; the next upload waits until it can no longer "
        "land (at most %.0f s) before relying on a blob, then removes it",
        store.url,
        BLOBS_DIR,
        posixpath.basename(token),
        unanswered[0] if len(unanswered) == 1 else f"{len(unanswered)} delete requests",
        COLLECT_MAX_S + COLLECT_MARGIN_S,
    )
    with contextlib.suppress(Exception):
        store.fs.pipe_file(token, json.dumps({**body, "unanswered": unanswered}).encode())


def _collect(
    store: RemoteStore,
    entries: list[RemoteEntry] | None,
    deadline: float | None,
    unanswered: list[str] | None = None,
    names: dict[str, int] | None = None,
) -> list[str]:
    from .remote import NO_MANIFEST  # (remote imports this module)

    markers = _markers(store)  # before the manifests: see collect
    if entries is None:  # (the blobs as the scan listed them, before it read a manifest)
        entries, names = store.scan_with_blobs()
    elif names is None:
        names = listing(store)
    live: set[str] = set()
    for e in entries:
        if e.manifest is not None:
            live.update(b.path for b in e.manifest.blobs)
        elif e.problem and e.problem != NO_MANIFEST:  # damaged, unread, or of a newer format
            log.warning(
                "remote %s: not deleting unused blobs, the manifest of %s cannot be read",
                store.url,
                e.name,
            )
            return []
    for name, (fresh, blobs, _) in markers.items():
        if fresh:
            live.update(blobs)
        elif deadline is not None:
            with contextlib.suppress(Exception):
                store.fs.rm_file(posixpath.join(_dir(store), name))
    doomed = sorted(n for n in names if NAME_RE.match(n) and n not in live)
    if store.is_local:  # copies a kill left under their temporary names, a day old
        doomed += [n for n in names if n.startswith(UPLOAD_PREFIX) and _stale(store, n)]
    if deadline is None:
        return doomed
    sent, refused, unsure = _delete(
        store, doomed, deadline, [] if unanswered is None else unanswered
    )
    doomed = doomed[:sent]
    if unsure and doomed:  # (fsspec's rm reports no key the store refused to delete)
        left = set(listing(store)).intersection(doomed)
        refused.update((n, OSError("still listed after its delete")) for n in left)
    if refused:
        first = sorted(refused)[0]
        log.warning(
            "remote %s: the store did not delete %d of %d unused blob(s) in %s (%s: %s, %s; "
            "a policy that denies deletes?); the others are deleted, and these are left for "
            "the next collection",
            store.url,
            len(refused),
            len(doomed),
            BLOBS_DIR,
            first,
            type(refused[first]).__name__,
            refused[first],
        )
        doomed = [n for n in doomed if n not in refused]
    if doomed:
        log.info("remote: deleted %d unused blob(s) in %s/%s", len(doomed), store.url, BLOBS_DIR)
    return doomed


def _stale(store: RemoteStore, name: str) -> bool:
    try:
        age = time.time() - os.path.getmtime(posixpath.join(_dir(store), name))
    except OSError:
        return False
    return age > INFLIGHT_TTL_S


def _delete(
    store: RemoteStore, doomed: list[str], deadline: float, unanswered: list[str]
) -> tuple[int, dict[str, Exception], bool]:
    """Delete the blobs ``doomed`` in order, none after ``deadline``. Returns how many were
    sent, those the store refused (name -> its error: the collection goes on past them, and
    the next one tries again) and whether a batch may have kept some unsaid (fsspec's ``rm``
    on a store other than S3: listed again to know). Each request the store did not answer
    (a timeout, a reset, a 500: :func:`.remote_paths.answered`), which it may still carry out
    later, is added to ``unanswered``; so is one a ``BaseException`` interrupted.

    An object store deletes up to 1000 keys per request (S3's DeleteObjects, whose answer names
    each key refused: :func:`.remote_paths.delete`): thousands of unused blobs go in seconds,
    not one request each, also under a prefix holding ``[``, ``*`` or ``?``; a filesystem
    removes them one by one, and so does a store that refuses a batch as a whole (an
    S3-compatible one without DeleteObjects)."""
    batch = 1 if store.is_local else DELETE_BATCH
    single = not remote_paths.batches_literally(store.fs, _dir(store))
    refused: dict[str, Exception] = {}
    unsure = False
    for i in range(0, len(doomed), batch):
        paths = [posixpath.join(_dir(store), n) for n in doomed[i : i + batch]]
        if len(paths) > 1 and not single and time.monotonic() <= deadline:
            unanswered.append(f"a batched delete of {len(paths)} blobs")  # (until answered)
            try:
                got = remote_paths.delete(store.fs, paths)
                unanswered.pop()
                refused.update({posixpath.basename(p): e for p, e in got.items()})
                unsure = unsure or not remote_paths.reports_refusals(store.fs)
                continue
            except FileNotFoundError:  # (one went meanwhile: the others one by one)
                unanswered.pop()
            except Exception as e:
                if remote_paths.answered(store.fs, e):
                    unanswered.pop()
                else:
                    unanswered[-1] += f" ({type(e).__name__}: {e})"
                log.info(
                    "remote %s: a batched delete failed (%s: %s); deleting unused blobs one by one",
                    store.url,
                    type(e).__name__,
                    e,
                )
                single = True
        for k, p in enumerate(paths):
            if time.monotonic() > deadline:  # an upload may rely on what was unused then
                log.info(
                    "remote %s: blob collection stopped after %.0f s; %d unused blob(s) are "
                    "left for the next one",
                    store.url,
                    COLLECT_MAX_S,
                    len(doomed) - i - k,
                )
                return i + k, refused, unsure
            unanswered.append(f"the delete of {BLOBS_DIR}/{posixpath.basename(p)}")
            try:
                store.fs.rm_file(p)
                unanswered.pop()
            except FileNotFoundError:
                unanswered.pop()
            except Exception as e:  # refused, or no answer: the others still go
                refused[posixpath.basename(p)] = e
                if remote_paths.answered(store.fs, e):
                    unanswered.pop()
                else:
                    unanswered[-1] += f" ({type(e).__name__}: {e})"
    return len(doomed), refused, unsure
