"""``resilient-ckpt pull``, ``push``, ``ls --remote`` and ``gc --remote``: the commands that
talk to a remote store (any fsspec URL; ``verify URL`` is ``cli_remote_verify``'s). Imported
only when one of them runs."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys
from typing import Any

from . import catalog
from .catalog import Depth, Entry, Status
from .cli_format import CORRUPT, INCOMPLETE, SIZES, UNVERIFIED, fmt_size, iso_time, print_json
from .cli_policy import Recorded, recorded_policy
from .cli_scan import is_url, no_checkpoints, resolve
from .errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    usage,
)
from .lock import DirLock, writer_alive
from .manifest import MANIFEST_NAME
from .redact import command
from .remote import NO_MANIFEST, STALE_UPLOAD_S, RemoteEntry, RemoteStore
from .remote_claims import REMOTE_CKPT_RE, UNREADABLE, RemoteNameTaken, free_name
from .retention import Plan, RetentionPolicy


def remote_options(pairs: list[str] | None) -> dict[str, Any]:
    """``-o KEY=VALUE`` pairs as fsspec options; a value that parses as JSON is used as JSON."""
    opts: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CheckpointError(
                f"-o {pair!r}: expected KEY=VALUE (e.g. -o endpoint_url=http://127.0.0.1:9000)"
            )
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts


def store(
    url: str, pairs: list[str] | None, *, step_option: bool = False, beside: str | None = None
) -> RemoteStore:
    """The remote store at ``url``; :class:`CheckpointNotFoundError` naming the store to give
    when ``url`` is one checkpoint in a store (``s3://b/run1/step_000000060``, as ``verify``
    prints it): listing it as a store found "no checkpoints" there, and ``push`` wrote
    checkpoints into it. ``beside``: the local directory the command compares it with; a store
    that is that directory, or lies in it, is refused (no second copy: ``ls`` called every
    checkpoint "both", ``push`` "already in" it, ``gc`` a node's only copy committed remotely)."""
    st = RemoteStore(url, remote_options(pairs))
    here = os.path.realpath(beside) if beside is not None else None
    if (
        here is not None
        and st.is_local
        and (os.path.realpath(st.root) + os.sep).startswith(here + os.sep)
    ):
        raise usage(
            CheckpointError(
                f"the store {url} is the directory {beside} itself, or lies in it: no second copy; "
                "give the run's remote store (another disk, an object store)"
            )
        )
    step = one_checkpoint(st)
    if step is not None:
        parent = st.url.rsplit("/", 1)[0]
        raise usage(
            CheckpointNotFoundError(
                f"{st.url} is one checkpoint (step {step}) of the remote store {parent}, not a "
                f"store of checkpoints: give {parent}"
                + (f" with --step {step} for this checkpoint" if step_option else "")
            )
        )
    return st


def one_checkpoint(st: RemoteStore) -> int | None:
    """The step of the checkpoint ``st``'s URL is (a ``step_<n>`` folder holding a manifest),
    else None. Asks the store only for a URL named as a checkpoint."""
    named = REMOTE_CKPT_RE.match(st.root.rsplit("/", 1)[-1])
    if named is None or not st.fs.exists(f"{st.root}/{MANIFEST_NAME}"):
        return None
    return int(named.group(1))


def _damage(
    remote: list[RemoteEntry],
) -> tuple[dict[tuple[str, int], str], dict[str, str]]:
    """The damaged remote copies: by commit (a file missing or of the wrong size: ``push``
    uploads them again) and by name (a manifest that cannot be read: never replaced)."""
    by_key = {e.key: e.problem for e in remote if e.key is not None and e.problem}
    by_name = {
        e.name: e.problem
        for e in remote
        if e.manifest is None and e.problem not in (None, NO_MANIFEST)
    }
    return by_key, by_name


def add_tiers(entries: list[Entry], rows: list[dict[str, Any]], st: RemoteStore) -> None:
    """Add a ``tier`` to each local row (``local-only``, ``uploading``, ``remote-corrupt``,
    ``both``) and a row for
    each checkpoint that is only in the remote store (``remote``; its sizes checked against
    its manifest, its checksums not read)."""
    remote = st.scan()
    if not remote:  # a mistyped URL reads as an empty store: say so, not only "local-only"
        print(
            f"resilient-ckpt ls: the remote {st.url} holds no checkpoint: check the URL "
            "(a mistyped one reads as an empty store)",
            file=sys.stderr,
        )
    good = {e.key: e for e in remote if e.key is not None and e.problem is None}
    kept, _, _ = remote_plan(remote)  # why the remote keeps what only it has
    damaged, unreadable = _damage(remote)
    torn = {e.name for e in remote if e.problem == NO_MANIFEST}
    local_keys = set()
    for e, r in zip(entries, rows, strict=True):
        key = (e.manifest.run_id, e.manifest.seq) if e.manifest else None
        local_keys.add(key)
        if key in good:
            r["tier"] = "both"
            if kept is not None:  # (the remote retention decides about its copy on its own)
                r["remote_kept_by"] = list(kept.keep.get(good[key].name, ["not kept"]))
        elif key in damaged or e.name in unreadable:  # `push` uploads it again
            r["tier"] = "remote-corrupt"
            r["remote_problem"] = damaged[key] if key in damaged else unreadable[e.name]
        elif e.name in torn:
            r["tier"] = "uploading"  # or an upload a crash cut off: re-sent by the next run
        else:
            r["tier"] = "local-only"
    local_names = {e.name for e in entries}
    for re_ in remote:
        m = re_.manifest
        if m is None and re_.problem == NO_MANIFEST and re_.name not in local_names:
            rows.append(_torn_row(re_, st.url))  # its local copy is gone: only gc deletes it
            continue
        if m is None or re_.key in local_keys:
            continue
        rows.append(
            {
                "name": re_.name,
                "step": m.step,
                "seq": m.seq,
                "status": UNVERIFIED if re_.problem is None else CORRUPT,
                "checked": SIZES,
                "time": iso_time(m.created),
                "created": m.created,
                "bytes": m.total_bytes,
                "run_id": m.run_id,
                "reason": m.reason,
                "metrics": dict(m.metrics),
                "problem": re_.problem,
                "path": f"{st.url}/{re_.name}",
                "kept": None,  # local retention does not decide about it
                "kept_by": [],
                "remote_kept_by": (
                    None if kept is None else list(kept.keep.get(re_.name, ["not kept"]))
                ),
                "tier": "remote",
            }
        )
    rows.sort(key=lambda r: r["step"] if r["step"] is not None else -1)


def _torn_row(e: RemoteEntry, url: str) -> dict[str, Any]:
    """The row of a remote folder without a manifest or a local copy: an upload in progress
    elsewhere, or one a crash cut off (hidden before, while it used the store's space)."""
    named = REMOTE_CKPT_RE.match(e.name)
    return {
        "name": e.name,
        "step": int(named.group(1)) if named else None,
        "seq": None,
        "status": INCOMPLETE,
        "checked": SIZES,
        "time": iso_time(e.modified) if e.modified is not None else None,
        "created": e.modified,
        "bytes": sum(e.sizes.values()),
        "run_id": None,
        "reason": None,
        "metrics": {},
        "problem": f"{NO_MANIFEST}: an upload in progress, or one a crash cut off (deleted "
        f"once untouched for {STALE_UPLOAD_S / 3600:.0f} h by the uploader or `gc --remote`)",
        "path": f"{url}/{e.name}",
        "kept": None,
        "kept_by": [],
        "tier": "uploading",
    }


def _locked(path: str, what: str) -> DirLock | None:
    """``path``'s lock, taken (None: a writer holds it, said on stderr). A directory this user
    cannot write (a read-only mount, another user's) has no lock to take: without a live writer
    on this host the command goes on, reading only, and says so (a checkpoint deleted
    meanwhile fails its upload, which commits nothing)."""
    os.makedirs(path, exist_ok=True)
    lock = DirLock(path, command=what)
    try:
        lock.acquire()
    except PermissionError as err:  # EACCES, EPERM
        return None if _alive(path, what, err) else lock
    except OSError as err:
        if err.errno != errno.EROFS:
            raise
        return None if _alive(path, what, err) else lock
    except CheckpointError as err:
        print(
            f"resilient-ckpt {what}: {err}",
            file=sys.stderr,
        )
        return None
    return lock


def _unupload(st: RemoteStore, local: str, name: str, was: str | None) -> None:
    """Ctrl-C during the upload of ``local`` as ``name``: remove what went up unless a manifest
    is there (its own: committed, whole; another writer's, which committed the name meanwhile:
    never deleted). Never a copy that was there before (``was``: a damaged one being repaired
    stays as it was found, for the next push)."""
    if was is not None or st._manifest_bytes(name) is not None:
        return
    print(f"resilient-ckpt push: removing the partial upload of {name}", file=sys.stderr)
    st.delete(name)


def _alive(path: str, what: str, err: OSError) -> bool:
    """The lock of ``path`` cannot be taken (``err``): whether a writer is alive there (said)."""
    if writer_alive(path):
        print(
            f"resilient-ckpt {what}: a writer is open on {path}; try again once it has stopped",
            file=sys.stderr,
        )
        return True
    print(
        f"resilient-ckpt {what}: cannot take the lock of {path} ({err.strerror or err}): going "
        "on without it (reading only)",
        file=sys.stderr,
    )
    return False


UPLOADING_OR_CUT = "an upload in progress, or one a crash cut off"


def pull(args: argparse.Namespace) -> int:
    from . import pulling

    if is_url(args.dir) and not is_url(args.url):  # (push's order: DIR URL)
        raise usage(
            CheckpointError(
                f"{args.dir} is a URL: pull takes the store's URL first, then the local directory "
                f"to download into: {command('pull', args.dir, args.url)}"
            )
        )
    if is_url(args.dir):  # (a local folder named "s3:" would be made, and said as the URL)
        raise usage(
            CheckpointError(
                f"{args.dir} is a URL: pull downloads into a local directory; give one, e.g. "
                f"{command('pull', args.url, 'ckpts/run1')}"
            )
        )
    if os.path.exists(args.dir):  # a file, or one checkpoint (a pull would nest in it)
        resolve(args.dir, single_ok=False)
    st = store(args.url, args.option, step_option=True)
    passed: list[RemoteEntry] = []  # newer ones, not pulled: said
    usable = pulling.usable(st, args.step, passed)
    for e in passed:
        m = e.manifest
        why = f" (step {m.step}): {e.problem}" if m else f": {e.problem}: {UPLOADING_OR_CUT}"
        print(f"resilient-ckpt pull: passed over {st.url}/{e.name}{why}", file=sys.stderr)

    def skipping(e: RemoteEntry, err: CheckpointError) -> None:
        print(f"resilient-ckpt pull: skipping {st.url}/{e.name}: {err}", file=sys.stderr)

    try:
        entry, final, pulled = pulling.pull_newest_whole(st, usable, args.dir, "pull", skipping)
    except CheckpointLockedError as err:
        print(f"resilient-ckpt pull: {err}", file=sys.stderr)
        return 1
    m = entry.manifest
    assert m is not None
    summary = {
        "name": entry.name,
        "step": m.step,
        "time": iso_time(m.created),
        "bytes": m.total_bytes,
        "from": f"{st.url}/{entry.name}",
        "path": final,
        "pulled": pulled,
        "status": "valid",
        "checked": "checksums",
    }
    if args.json:
        print_json(summary)
    elif pulled:
        print(
            f"pulled {summary['from']} (step {m.step}, {fmt_size(m.total_bytes)}) -> {final}, "
            "every checksum verified"
        )
    else:
        print(f"{entry.name} (step {m.step}) is already in {args.dir}, verified")
    from .cli_runs import pulled_beside_other_runs

    pulled_beside_other_runs(args.dir, m.run_id)
    return 0


def push(args: argparse.Namespace) -> int:
    from .progress import Progress

    if is_url(args.dir) and not is_url(args.url):  # (pull's order: URL DIR)
        raise usage(
            CheckpointError(
                f"{args.dir} is a URL: push takes the local directory first, then the store's URL: "
                f"{command('push', args.url, args.dir)}"
            )
        )
    target = resolve(args.dir, single_ok=False)
    if not catalog.committed(catalog.scan(target.root, Depth.NONE)):
        raise no_checkpoints(target.root, "checkpoints to push")
    st = store(args.url, args.option, beside=target.root)
    lock = _locked(target.root, "push")
    if lock is None:
        return 1
    done: dict[str, list[dict[str, Any]]] = {"pushed": [], "present": [], "skipped": []}
    try:
        every = catalog.committed(catalog.scan(target.root, Depth.FULL))
        local = [e for e in every if args.step is None or e.step == args.step]
        if not local:
            steps = ", ".join(map(str, sorted({e.step for e in every if e.step is not None})))
            raise CheckpointNotFoundError(
                f"no checkpoint of step {args.step} in {args.dir} (its steps: {steps})"
            )
        scanned = st.scan()
        from .cli_runs import pushing_beside_other_runs

        pushing_beside_other_runs(st.url, scanned, local)
        remote = {e.key: e for e in scanned if e.key is not None and e.problem is None}
        damaged, unreadable = _damage(scanned)  # (an unreadable one's name is never free)
        at = {e.key: e.name for e in scanned if e.key is not None}  # (its remote name)
        taken = {n: k for k, n in at.items()} | dict.fromkeys(unreadable, UNREADABLE)
        rotten: dict[tuple[str, int], list[str]] = {}  # blobs read and found rotten, by commit
        for e in local:
            item = {"name": e.name, "step": e.step, "path": e.path}
            problem = e.problem
            if e.manifest is not None and e.status is Status.VALID and e.manifest.extra.get("node"):
                problem = (
                    "one node's part of a node-local checkpoint (its ranks' files only); the "
                    "run's own uploads commit it remotely once every node's part is there"
                )
            if problem is not None or e.status is not Status.VALID or e.manifest is None:
                done["skipped"].append(item | {"problem": problem})
                if not args.json:
                    print(f"skipped {e.name}: {problem}")
                continue
            item["bytes"] = e.manifest.total_bytes
            item["url"] = f"{st.url}/{e.name}"
            key = (e.manifest.run_id, e.manifest.seq)
            if key in remote and args.verify:  # read the copy: a same-size rot lists as fine
                from .remote_verify import check_remote

                found = check_remote(st, remote[key], first_only=False)
                if found.problem is not None:
                    damaged[key], rotten[key] = found.problem, found.bad_blobs
                    del remote[key]
            if key in remote:
                item["checked"] = "checksums" if args.verify else "sizes"
                done["present"].append(item)
                if not args.json:
                    how = "checksums read, they match" if args.verify else "sizes match"
                    print(f"{e.name} (step {e.step}) is already in {st.url} ({how})")
                continue
            was = damaged.get(key)  # repaired where it lies; else a name no other commit has
            name = at[key] if was is not None else free_name(e.name, key, taken)
            item["url"] = f"{st.url}/{name}"
            bar = Progress(e.manifest.total_bytes, f"pushing {e.name}")
            try:
                while True:  # a name marked or committed since the scan: the next free one
                    try:
                        st.upload(e.path, e.manifest, name, bar, repair=was is not None,
                                  blobs_again=rotten.get(key, []))  # fmt: skip
                        break
                    except RemoteNameTaken as now:
                        if was is not None:
                            raise
                        taken[now.name] = UNREADABLE  # (never this commit's key)
                        name = free_name(e.name, key, taken)
                        item["url"] = f"{st.url}/{name}"
            except KeyboardInterrupt:
                _unupload(st, e.path, name, was)
                raise
            finally:
                bar.close()
            if was is not None:
                item["repaired"] = was  # the remote copy's problem, now uploaded again
            done["pushed"].append(item)
            if not args.json:
                again = "" if was is None else f"; its remote copy was damaged ({was})"
                named = "" if name == e.name else f" as {name} ({e.name} holds another commit)"
                size = fmt_size(e.manifest.total_bytes)
                if e.manifest.blobs:  # incremental: the blobs it names, sent where missing
                    size += (
                        f" + {len(e.manifest.blobs)} blob(s), {fmt_size(e.manifest.blob_bytes)},"
                        " those the remote lacked uploaded"
                    )
                print(f"pushed {e.name}{named} (step {e.step}, {size}){again}")
    finally:
        lock.release()
    if args.json:
        print_json({"url": st.url, **done})
    return 1 if done["skipped"] else 0


# ---------------------------------------------------------------------- gc --remote


def remote_plan(
    entries: list[RemoteEntry], keep_last: int | None = None, drop_archives: str | None = None
) -> tuple[Plan | None, Recorded, str | None]:
    """The remote retention's plan for the store's ``entries``: by the policy recorded in its
    newest manifest (:func:`.cli_policy.recorded_policy`: its remote retention, or the run's
    own where it had no remote tier; ``keep_last`` overriding it; ``drop_archives``: archive
    points count as any other), that policy with where it came from, and the newest
    checkpoint's run. No plan where the newest records no policy and ``keep_last`` is not
    given."""
    from .remote import retention_candidates
    from .retention import plan

    committed = [e for e in entries if e.manifest is not None]
    newest = next((e for e in reversed(committed) if e.problem is None), None)
    m = newest.manifest if newest is not None else None
    run_id = m.run_id if m is not None else None
    got = recorded_policy(newest.name if newest else None, m, keep_last, remote=True)
    policy = got.policy
    if policy is None and not committed:  # (an empty store: nothing to plan, nothing to say)
        policy = RetentionPolicy(keep_last=keep_last)
    if policy is None:
        return None, got, run_id
    cands = retention_candidates(committed)
    if drop_archives:  # those archive points under the policy they were written with
        cands = [dataclasses.replace(c, archived=False) for c in cands]
    if drop_archives == "all":  # and the policy's own
        policy = dataclasses.replace(policy, keep_every_n_steps=None)
    return plan(cands, policy, run_id), Recorded(policy, got.source), run_id
