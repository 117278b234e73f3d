"""``resilient-ckpt gc``: the command that deletes from a local checkpoint directory what its
retention does not keep, and the retention plan it shares with ``ls`` (:mod:`.cli_ls`;
``verify``: :mod:`.cli_verify`). Imported only when one of them runs; they need no torch."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
from typing import Any

from . import catalog
from .blob_damage import damaged_blobs, only_blobs, repair_note
from .blobs import BlobStore
from .catalog import Depth, Entry, Status
from .cli_format import (
    CORRUPT,
    as_run,
    print_json,
    status_text,
)
from .cli_nodes import (
    committed_keys,
    is_part,
    is_uploaded_by_run,
    keep_uncommitted_parts,
    not_uploaded_note,
)
from .cli_policy import recorded_policy
from .cli_scan import no_checkpoints, public, resolve, row
from .commit import (
    LATEST_TMP_PREFIX,
    STAGING_PREFIX,
    TRASH_PREFIX,
    remove_checkpoint,
    write_latest_pointer,
)
from .errors import CheckpointError
from .lock import DirLock, writer_alive
from .manifest import MANIFEST_NAME, NEWER_FORMAT
from .reader import by_commit, check
from .redact import url_text
from .retention import CORRUPT_KEPT, Plan, RetentionPolicy, plan


def _policy(entries: list[Entry], keep_last: int | None) -> RetentionPolicy:
    """The retention recorded in the newest valid manifest, ``keep_last`` overriding it
    (:func:`.cli_policy.recorded_policy`, as ``gc --remote`` picks the remote one)."""
    newest = next((e for e in by_commit(entries) if e.status is Status.VALID), None)
    m = newest.manifest if newest is not None else None
    got = recorded_policy(newest.name if newest else None, m, keep_last).policy
    assert got is not None  # (locally, nothing recorded keeps every checkpoint)
    return got


def dropped_archives(args: argparse.Namespace) -> str | None:
    """Which archive points ``gc``'s options let retention delete: ``"stale"`` (``--drop-archives``:
    those kept only by the ``keep_every_n_steps`` each was written with, which the policy now
    does not make), ``"all"`` (``--drop-all-archives``: the policy's own too), or None."""
    if getattr(args, "drop_all_archives", False):
        return "all"
    return "stale" if getattr(args, "drop_archives", False) else None


def _plan(
    entries: list[Entry], keep_last: int | None = None, drop_archives: str | None = None
) -> tuple[Plan, str | None]:
    """``drop_archives`` (:func:`dropped_archives`): ``"stale"``: an archive point of the
    policy a checkpoint was written with counts as any other, one of the policy now (the
    newest manifest's ``keep_every_n_steps``) stays; ``"all"``: every one counts as any other."""
    newest = next((e for e in by_commit(entries) if e.status is Status.VALID), None)
    run_id = newest.manifest.run_id if newest is not None and newest.manifest else None
    cands = catalog.retention_candidates(entries)
    policy = _policy(entries, keep_last)
    if drop_archives:
        cands = [dataclasses.replace(c, archived=False) for c in cands]
    if drop_archives == "all":
        policy = dataclasses.replace(policy, keep_every_n_steps=None)
    return plan(cands, policy, run_id), run_id


def _committed(entries: list[Entry], args: argparse.Namespace) -> set[tuple[str, int]] | None:
    """In a node's directory of a node-local run, or one of a run with a remote tier, with
    ``--remote``: the checkpoints the remote holds committed (:mod:`.cli_nodes`); None
    otherwise (not needed, or not known)."""
    if not getattr(args, "remote", None) or not any(
        is_part(e) or is_uploaded_by_run(e) for e in entries
    ):
        return None
    return committed_keys(args.remote, args.option)


def _kept(e: Entry, p: Plan) -> dict[str, Any]:
    why = p.keep.get(e.name, []) if e.status is not Status.INCOMPLETE else []
    if not why and e.status is Status.CORRUPT and e.manifest is None:
        # an unreadable manifest: no candidate of retention's, kept all the same (it said no
        # reason and "kept": false, and never named --remove-corrupt)
        why = [NEWER_KEPT if _newer_format(e) else CORRUPT_KEPT]
    # abandoned: on a branch a roll-back abandoned
    return {"kept": bool(why), "kept_by": list(why), "abandoned": e.name in p.abandoned}


# ---------------------------------------------------------------------- gc


def gc(args: argparse.Namespace) -> int:
    """``gc DIR``, and with ``--remote URL`` the remote store too (only it if DIR does not
    exist); DIR's lock is held throughout, so neither runs beside a live writer of DIR. The
    remote's first listing (under DIR's lock, before DIR is touched) is its plan's where DIR
    holds none of our checkpoints (nothing runs between); else the plan lists again, after
    DIR's gc."""
    remote = getattr(args, "remote", None)
    result: dict[str, Any] = {}
    lock: DirLock | None = None
    root: str | None = None
    st = None
    if remote:  # a URL that is one checkpoint or DIR, or a store that cannot be listed
        from .cli_remote import store  # (unreachable, a wrong -o): said before anything is

        st = store(remote, args.option, beside=args.dir)
    if remote and not os.path.exists(args.dir):
        missing_dir_note(args, remote)
    else:
        root = resolve(args.dir, single_ok=False).root
        found = catalog.scan(root, Depth.NONE)
        foreign = catalog.foreign_folders(root, found)  # another tool's step_<n>: not ours
        if len(found) == len(foreign) and not _our_blobs(root):
            if not remote:
                note = catalog.not_ours_note(root, foreign) if foreign else None
                _nothing_to_delete(args, root, f"nothing to delete: {note or no_checkpoints(root)}")
                return 0
            missing_dir_note(args, remote, "holds no checkpoint of ours")
            root = None
        lock = DirLock(args.dir, command="gc")
        if not args.dry_run:
            try:
                lock.acquire()
            except CheckpointError:
                print(
                    f"resilient-ckpt gc: a writer is open on {args.dir} (a training run, or "
                    "another command): gc deletes nothing beside it; run it once that has "
                    "stopped, or see what it would delete with --dry-run",
                    file=sys.stderr,
                )
                return 1
            except OSError as e:  # a read-only mount, no permission: nothing can be deleted
                print(
                    f"resilient-ckpt gc: cannot take the lock of {args.dir} ({e.strerror or e}): "
                    "gc can delete nothing there; see what it would delete with --dry-run",
                    file=sys.stderr,
                )
                return 1
    try:
        # the remote listed before anything is deleted here (unreachable, a wrong -o: said
        # first), under DIR's lock; its plan takes this listing where nothing ran since
        listed = st.scan_with_blobs() if st is not None else None
        if st is not None and listed is not None:  # (its plan's failure: before DIR's gc)
            from .cli_remote_gc import check_plannable

            check_plannable(args, st, listed, local=root is not None)
        if root is not None:
            result = _gc(args, root)
            listed = None  # (time passed deleting here: the remote plan lists afresh)
        if st is not None:
            from .cli_remote_gc import gc_remote, print_gc_remote

            result["remote"] = gc_remote(args, st, listed, alone=root is None)
            if not args.json:
                print_gc_remote(result["remote"], args)
    finally:
        if lock is not None:
            lock.release()
    if args.json:
        print_json(result)
    # (a folder here, or a checkpoint the remote store refused to delete: said, exit 1)
    return 1 if result.get("failed") or result.get("remote", {}).get("failed") else 0


def missing_dir_note(args: argparse.Namespace, remote: str, why: str = "does not exist") -> None:
    """``ls``/``gc DIR --remote URL`` where DIR does not exist (a typo, or the run's directory
    is on another machine), or (``why``) holds none of ours: the command goes on with the
    remote store alone, said on stderr."""
    what = "cleaning" if args.cmd == "gc" else "listing"
    print(
        f"resilient-ckpt {args.cmd}: {args.dir} {why}: {what} the remote store alone "
        f"({url_text(remote)}); give the run's own directory as DIR for its local checkpoints",
        file=sys.stderr,
    )


def _our_blobs(root: str) -> bool:
    """``root/blobs`` holds blobs of ours (an incremental run's whose checkpoints are gone):
    a ``blobs`` folder of another tool's (a Hugging Face cache's) is no sign of a directory of
    ours, and gc takes no lock there."""
    from .blobs import BLOBS_DIR, NAME_RE, TMP_PREFIX

    try:
        names = os.listdir(os.path.join(root, BLOBS_DIR))
    except OSError:
        return False
    return any(NAME_RE.match(n) or n.startswith(TMP_PREFIX) for n in names)


def _gc(args: argparse.Namespace, root: str) -> dict[str, Any]:
    entries = catalog.scan(root, Depth.SIZE)
    # a dry run takes no lock: a writer may be saving, and deleting by retention, beside it
    live = bool(args.dry_run and writer_alive(root))
    if live:
        print(
            f"resilient-ckpt gc: a writer is open on {args.dir} (a training run): gc without "
            "--dry-run refuses to run beside it; its save in progress (a .staging-/.trash- "
            "folder) is not listed, and what its own retention deletes meanwhile goes",
            file=sys.stderr,
        )
        entries = [e for e in entries if not e.name.startswith((STAGING_PREFIX, TRASH_PREFIX))]
    if foreign := catalog.foreign_folders(root, entries):  # only hidden leftovers of ours too
        print(f"resilient-ckpt gc: {catalog.not_ours_note(root, foreign)}", file=sys.stderr)
        entries = [e for e in entries if e.name not in foreign]
    committed = _committed(entries, args)  # (a node's directory: what the remote holds)
    verified: set[str] = set()
    every_corrupt = bool(getattr(args, "remove_blob_corrupt", False))
    if args.remove_corrupt or every_corrupt:
        for e in entries:
            check(e)
            verified.add(e.name)
    # Verify every checkpoint retention would keep before trusting the plan: one whose sizes
    # match but whose checksum does not would otherwise count as the newest valid checkpoint,
    # and the good one before it could be deleted.
    while True:  # (beside a writer: without what its retention deleted while this read it)
        entries = [e for e in entries if not catalog.gone(e.path)]
        p, run_id = _plan(entries, args.keep_last, dropped_archives(args))
        keep_uncommitted_parts(entries, p, committed)
        todo = [
            e
            for e in entries
            if e.name in p.keep and e.status is Status.VALID and e.name not in verified
        ]
        if not todo:
            break
        for e in todo:
            check(e)
            verified.add(e.name)
    damaged = damaged_blobs(entries)  # shared blobs: say the cause and the repair first
    if damaged:
        note = repair_note(damaged, args.dir, sum(e.manifest is not None for e in entries))
        print(note, file=sys.stderr if args.json else sys.stdout)
    held = p.held if args.remove_corrupt or every_corrupt else {}  # corrupt, kept: a roll-back
    sys.stderr.writelines(f"resilient-ckpt gc: {k} {n}\n" for k, n in held.items())
    doomed: list[tuple[Entry, str]] = []
    for e in entries:
        through = only_blobs(e, damaged)
        if e.status is Status.INCOMPLETE:
            doomed.append((e, f"incomplete ({e.problem})"))
        elif e.name in p.delete:
            doomed.append((e, "not kept by retention"))
        elif args.other_runs and _other_run(e, run_id):
            assert e.manifest is not None
            doomed.append((e, f"checkpoint of another run ({e.manifest.run_id})"))
        elif through and every_corrupt:
            doomed.append((e, f"corrupt through the damaged blob(s) {', '.join(through)}"))
        elif (
            (args.remove_corrupt or every_corrupt)
            and not through  # the blob can be repaired: only --remove-blob-corrupt deletes it
            and e.status is Status.CORRUPT
            and not _newer_format(e)
            and e.name not in held  # (it records a roll-back)
        ):
            doomed.append((e, f"corrupt: {e.problem}"))
    gone = {e.name for e, _ in doomed}

    def facts(e: Entry) -> dict[str, Any]:
        return public(row(e, Depth.FULL if e.name in verified else Depth.SIZE))

    delete = [facts(e) | {"why": why} for e, why in doomed]
    keep = [facts(e) | _kept(e, p) | _through(e, damaged) for e in entries if e.name not in gone]
    failed: list[dict[str, Any]] = []
    if not args.dry_run:  # first: a gc killed mid-way leaves `latest` naming one left
        _repoint_latest(root, gone, entries)
    for (e, _), d in zip(doomed, delete, strict=True):
        if args.dry_run:
            continue
        try:  # one folder that cannot be deleted (a busy NFS file) stops nothing else
            if e.status is Status.INCOMPLETE:
                shutil.rmtree(e.path)
            else:
                remove_checkpoint(e.path)
        except OSError as err:
            d["error"] = f"{type(err).__name__}: {err}"
            failed.append(d)
    delete = [d for d in delete if "error" not in d]
    if not args.dry_run:
        for name in os.listdir(root):  # a `latest` being rewritten when its writer was killed
            if name.startswith(LATEST_TMP_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(root, name))
    # blobs (incremental checkpoints) that no remaining checkpoint refers to; the lock is held,
    # so no save is in flight. A dry run counts what the remaining manifests would not name.
    recent: list[str] = []
    if args.dry_run:
        blobs, recent = _unused_blobs(root, gone)
    else:
        blobs = BlobStore(root).collect()
    result = _gc_result(
        root,
        args.dry_run,
        run_id,
        delete=delete,
        failed=failed,
        keep=keep,
        blobs_deleted=blobs,
        blobs_since_newest=recent,
        damaged_blobs=[dataclasses.asdict(d) for d in damaged.values()],
        writer_open=live,
    )
    if unsent := not_uploaded_note(args, keep):  # (gc DIR without --remote)
        print(f"resilient-ckpt gc: {unsent}", file=sys.stderr)
    if args.json:
        return result
    verb = "would delete" if args.dry_run else "deleted"
    for d in delete:
        print(f"{verb} {_label(d)}: {d['why']}")
    for d in failed:
        print(f"could not delete {_label(d)} ({d['why']}): {d['error']}", file=sys.stderr)
    for k in keep:
        why = as_run("; ".join(k["kept_by"]), args.dir)
        if k.get("damaged_blobs"):
            why = f"corrupt only through its damaged blob(s) {', '.join(k['damaged_blobs'])}: "
            why += "repair it (above), or delete it with --remove-blob-corrupt"
        elif k["status"] == CORRUPT:
            why = f"{k['problem']} ({why})" if why else str(k["problem"])
        print(f"keep {_label(k)}: {why}")
    if blobs:
        print(f"{verb} {len(blobs)} blob(s) no remaining checkpoint refers to")
    if recent:
        print(
            f"not counted: {len(recent)} blob(s) written since the newest checkpoint, that no "
            "checkpoint refers to yet: a running save's, or a crashed one's (gc deletes those "
            "only when no writer is open)"
        )
    print(
        f"{len(delete)} {'would be deleted' if args.dry_run else 'deleted'}, {len(keep)} kept"
        + (f", {len(failed)} could not be deleted" if failed else "")
        + (f" (current run {run_id})" if run_id else "")
    )
    return result


def _gc_result(root: str, dry_run: bool, run_id: str | None = None, **found: Any) -> dict[str, Any]:
    """``gc --json``'s object: what was (or would be) deleted, kept, and failed."""
    result: dict[str, Any] = {"dir": root, "dry_run": dry_run, "run_id": run_id}
    keys = ("delete", "failed", "keep", "blobs_deleted", "damaged_blobs")
    result |= {k: found.get(k, []) for k in keys}
    if dry_run:
        result["blobs_since_newest"] = found.get("blobs_since_newest", [])
        result["writer_open"] = bool(found.get("writer_open", False))
    return result


def _nothing_to_delete(args: argparse.Namespace, root: str, note: str) -> None:
    """``gc`` of a directory with nothing it may delete: ``note`` on stdout, or with ``--json``
    the usual object with empty lists (the note on stderr)."""
    if not args.json:
        print(note)
        return
    print_json(_gc_result(root, args.dry_run))
    print(f"resilient-ckpt gc: {note}", file=sys.stderr)


def _other_run(e: Entry, run_id: str | None) -> bool:
    """``e`` belongs to a run other than ``run_id`` (the run of the newest valid checkpoint)."""
    return run_id is not None and e.manifest is not None and e.manifest.run_id != run_id


def _unused_blobs(root: str, gone: set[str]) -> tuple[list[str], list[str]]:
    """The blobs ``gc`` would delete once the checkpoints ``gone`` are deleted, and apart those
    of them written since the newest commit: a live writer's save in flight's (a dry run takes
    no lock), which ``gc`` itself never sees (it runs only when no writer is open), or a
    crashed save's, which it deletes."""
    from .blobs import NAME_RE, TMP_PREFIX, copies_blobs, store_dir

    try:
        names = os.listdir(store_dir(root))
    except FileNotFoundError:
        return [], []
    live: set[str] = set()
    newest = 0.0  # when the newest checkpoint was committed (its manifest written)
    for e in catalog.scan(root, Depth.NONE):
        if e.status is Status.INCOMPLETE:
            continue
        with contextlib.suppress(OSError):
            newest = max(newest, os.stat(os.path.join(e.path, MANIFEST_NAME)).st_mtime)
        if e.name in gone:
            continue
        if e.manifest is None:
            return [], []  # its references are unknown: nothing would be deleted
        live.update(b.path for b in e.manifest.blobs)
    live |= copies_blobs(root)

    def written_since(name: str) -> bool:
        """Written after the newest commit: a save in flight's (a dry run takes no lock, so a
        writer may be open), or a crashed one's: left out of the count."""
        try:
            return os.stat(os.path.join(store_dir(root), name)).st_mtime > newest
        except OSError:
            return True  # gone meanwhile

    unused = [n for n in names if n.startswith(TMP_PREFIX) or (NAME_RE.match(n) and n not in live)]
    recent = {n for n in unused if written_since(n)}
    return sorted(set(unused) - recent), sorted(recent)


def _through(e: Entry, damaged: dict[str, Any]) -> dict[str, Any]:
    """A kept checkpoint corrupt only through shared blobs: which (``gc --json``)."""
    names = only_blobs(e, damaged)
    why = "corrupt only through a damaged shared blob: repair it, or --remove-blob-corrupt"
    return {"damaged_blobs": names, "kept_by": [why]} if names else {}


def _label(r: dict[str, Any]) -> str:
    step = r["step"] if r["step"] is not None else "?"
    return f"{r['name']} (step {step}, {status_text(r['status'], r['checked'])})"


NEWER_KEPT = "a newer version's checkpoint: kept, also by --remove-corrupt"


def _newer_format(e: Entry) -> bool:
    """A checkpoint a newer version of the library wrote (unreadable here, not damaged):
    ``gc --remove-corrupt`` keeps it."""
    return NEWER_FORMAT in (e.problem or "")


def _repoint_latest(root: str, deleted: set[str], entries: list[Entry]) -> None:
    """The advisory ``latest`` file names a checkpoint gc deletes: before any deletion, it is
    pointed at the newest one left that is not corrupt or incomplete, or removed when none is
    left; so a gc interrupted or killed mid-way never leaves it naming a deleted checkpoint
    (one it could not delete after all stays, and ``latest`` names an older one)."""
    path = os.path.join(root, "latest")
    try:
        with open(path) as f:
            if f.read().strip() not in deleted:
                return
    except OSError:
        return
    left = [e for e in entries if e.name not in deleted and e.manifest is not None]
    left = [e for e in left if e.status not in (Status.CORRUPT, Status.INCOMPLETE)]
    if left:
        write_latest_pointer(root, by_commit(left)[0].name)  # (the current lineage's)
    else:
        os.unlink(path)
