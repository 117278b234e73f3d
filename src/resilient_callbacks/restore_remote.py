"""The remote tier's part of a restore: downloading a remote candidate into the directory, and
queueing the uploads a crash interrupted.

Which ranks call what: :func:`fetch` on every rank (the coordinator downloads and broadcasts
the result); :func:`url_of` on any rank; :func:`reconcile_uploads` on the coordinator only.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import catalog, dist, history, remote_best, stall
from .blobs import key_of
from .candidates import Candidate
from .catalog import Status
from .commit import fsync_dir, remove_checkpoint
from .errors import CheckpointNotFoundError, RemoteWaitPreemptedError
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .redact import url_text
from .retention import plan

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .remote import RemoteEntry

log = logging.getLogger("resilient_callbacks")


def url_of(ck: Checkpointer, c: Candidate) -> str:
    """The URL of the remote candidate ``c`` (as messages show it), on every rank: only the
    coordinator opens the remote store, the others take the URL from the configuration."""
    remote = ck._dir.remote
    if remote is not None:
        return f"{remote.url}/{c.remote}"
    configured = ck.config.remote
    return f"{url_text(str(configured).rstrip('/'))}/{c.remote}" if configured else str(c.remote)


def fetch(ck: Checkpointer, c: Candidate) -> Candidate:
    """Every rank: the coordinator downloads and verifies a remote checkpoint into dirpath;
    all ranks get its local path, or the problem. A preemption request that ends the
    coordinator's wait for the store (:func:`.stall.run`) is raised on every rank,
    :class:`RemoteWaitPreemptedError`: no fallback to an older checkpoint."""
    d = ck._dir
    result: dict[str, Any] = {"path": None, "problem": None, "preempted": None}
    raised: RemoteWaitPreemptedError | None = None
    if ck.is_coordinator:
        assert d.sync is not None and d.remote is not None
        url = f"{d.remote.url}/{c.remote}"
        try:
            # the entry listed by merge_tiers moments ago (its manifest is read already)
            entry = next((e for e in d.sync.entries() if e.name == c.remote), None)
            if entry is None or entry.manifest is None:
                raise CheckpointNotFoundError(f"{url} is gone")
            log.warning("restoring from the remote copy %s", url)
            keys = [key_of(b.path) for b in entry.manifest.blobs]
            with d.blobs.pinned(keys):  # no collection between download and install
                staging, name = _download(ck, entry, url)
                result["path"] = _install(ck, staging, name, entry.manifest)
        except RemoteWaitPreemptedError as e:  # (the limit is longer than a grace period)
            raised, result["preempted"] = e, str(e)
        except Exception as e:
            result["problem"] = f"remote copy {url}: {type(e).__name__}: {e}"
    msg = dist.broadcast_json(result)
    if msg["preempted"] is not None:  # every rank ends the restore alike
        raise raised or RemoteWaitPreemptedError(msg["preempted"])
    return replace(c, path=msg["path"] or c.remote, problem=msg["problem"])


def _download(ck: Checkpointer, entry: RemoteEntry, url: str) -> tuple[str, str]:
    """:meth:`RemoteStore.download`, given up once no byte has arrived for
    :func:`.stall.limit_s` (a store that stalls every read hung the restart forever), or at
    once on a preemption request (it waited out that limit past the grace period)."""
    assert ck._dir.remote is not None
    return stall.download(ck._dir.remote, entry, ck.dirpath, url, preemptible=True)


def _install(ck: Checkpointer, staging: str, name: str, manifest: Manifest) -> str:
    """Move a downloaded checkpoint into dirpath under its own name, replacing a damaged local
    copy of the same checkpoint (no longer kept as corrupt by retention: the name now holds a
    verified copy); another checkpoint of that name is never touched."""
    d = ck._dir
    final = os.path.join(d.dirpath, name)
    if os.path.lexists(final):
        try:
            m = read_manifest(final)
            same = (m.run_id, m.seq) == (manifest.run_id, manifest.seq)
        except Exception:
            same = True  # unreadable manifest: a damaged copy
        if not same:  # under the next free name; the downloaded manifest stays as it is
            with open(os.path.join(staging, MANIFEST_NAME), "rb") as f:
                return d.commit.commit(staging, manifest.step, f.read())
        remove_checkpoint(final)
    os.rename(staging, final)
    fsync_dir(d.dirpath)
    d.found_corrupt.discard(name)  # the damaged copy of that name is gone: count this one
    return final


def reconcile_uploads(ck: Checkpointer) -> None:
    """Coordinator, after a restore: queue this run's local checkpoints whose upload a crash
    interrupted, if the remote retention policy would keep them."""
    d = ck._dir
    assert d.sync is not None and d.remote is not None
    remote_entries = d.sync.entries()  # listed by this restore's merge_tiers
    entries = d.checkpoints()
    # (an archive point or one of the best: due whatever the interval)
    best = remote_best.best(entries, d.sync.policy, d.run_id, d.found_corrupt)
    local = [
        e
        for e in entries
        if e.manifest is not None
        and e.status is Status.VALID
        and e.manifest.run_id == d.run_id
        and not d.sync.is_uploaded(e.manifest)
        and remote_best.why_due(
            d.remote_due is None or d.remote_due(e.manifest.seq, e.manifest.reason),
            e.manifest.step,
            d.sync.policy,
            functools.partial(set.__contains__, best, e.name),
            catalog.archived(e.manifest),
        )
    ]
    if not local:
        return
    from .remote import retention_candidates

    # planned under the remote policy: an archive point under the remote policy it was
    # written with is kept, whatever this run's options (the local manifest's own retention,
    # what catalog.retention_candidates reads, records none with a remote)
    by_name = {e.name: e.manifest for e in local if e.manifest is not None}
    mine = [
        replace(c, archived=catalog.archived(by_name[c.name]))
        for c in catalog.retention_candidates(local)
    ]
    cands = mine + retention_candidates(remote_entries, prefix="\0remote/")
    keep = plan(cands, d.sync.policy, d.run_id).keep
    missing = [e.name for e in local if e.name in keep]
    # One the history records as uploaded, older than a commit of this run the remote holds,
    # was deleted there on purpose since (`gc --remote URL --drop-archives` without this
    # directory): not again. Never uploaded (not due under an earlier remote_every_n_saves,
    # skipped by sync._coalesce under an earlier keep_last): uploaded now, as it never was
    later = max(
        (m.seq for e in remote_entries if (m := e.manifest) and m.run_id == d.run_id), default=0
    )
    held = {e.key for e in remote_entries}  # (a copy there that differs: not deleted)
    sent = history.uploads(ck.dirpath, d.run_id) if missing else {}
    dropped = [
        n
        for n in missing
        if (m := by_name[n]) is not None
        and m.seq < later
        and (m.run_id, m.seq) not in held
        and n in sent
        and sent[n].time >= m.created  # (not an upload of an earlier folder of that name)
    ]
    if dropped:
        log.info(
            "%d checkpoint(s) of this run were uploaded to %s and deleted from it since (by "
            "`resilient-ckpt gc --remote`, by hand, or by the retention of an earlier process "
            "of the run): not uploaded again; their local copies "
            "stay while the local retention keeps them (`resilient-ckpt gc %s "
            "--drop-archives`, or --drop-all-archives, deletes archive points here): %s",
            len(dropped),
            d.remote.url,
            ck.dirpath,
            ", ".join(dropped),
        )
        missing = [n for n in missing if n not in dropped]
    if missing:
        why = "were not uploaded to %s before the last run stopped"
        if not d.sync.own.listed:  # (one already there is not sent again: RemoteStore.upload)
            why = "may not be on %s (it could not be listed to tell)"
        log.warning(
            f"%d checkpoint(s) of this run {why}; uploading them now: %s",
            len(missing),
            d.remote.url,
            ", ".join(missing),
        )
    for name in missing:
        d.sync.enqueue(name)
