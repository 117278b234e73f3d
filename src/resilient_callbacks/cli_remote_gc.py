"""``resilient-ckpt gc DIR --remote URL``: the remote store's part of ``gc`` (moved from
``cli_remote``). Imported only when it runs."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .catalog import archived, archived_point
from .cli_format import as_run
from .cli_local import dropped_archives
from .cli_policy import policy_text
from .cli_remote import remote_plan
from .errors import CheckpointError, RemoteDeleteRefusedError, usage
from .remote import NO_MANIFEST, STALE_UPLOAD_S, RemoteEntry, RemoteStore
from .remote_claims import REMOTE_CKPT_RE
from .retention import RetentionPolicy

DROPPED = "an archive point, deleted by --drop-archives/--drop-all-archives"
Listed = tuple[list[RemoteEntry], dict[str, int]]  # RemoteStore.scan_with_blobs()


def no_policy(args: argparse.Namespace, url: str, local: bool, why: str) -> CheckpointError:
    """The error of ``gc --remote URL`` whose newest checkpoint records no retention gc can
    apply (``why``: :func:`.cli_policy.recorded_policy`'s), said before anything is deleted
    (``local``: DIR is cleaned too, so --keep-last applies to it). A usage error: gc needs
    --keep-last."""
    too = f" (it applies to {args.dir} as well)" if local else ""
    return usage(
        CheckpointError(
            f"{url}: {why}, so gc cannot tell what it keeps: nothing was deleted; pass "
            f"--keep-last N{too}"
        )
    )


def check_plannable(args: argparse.Namespace, st: RemoteStore, listed: Listed, local: bool) -> None:
    """Raise :func:`no_policy`'s error where the store's listing gives ``gc`` no plan: before
    DIR's own gc deletes anything."""
    got, applied, _ = remote_plan(listed[0], args.keep_last, dropped_archives(args))
    if got is None:
        raise no_policy(args, st.url, local, applied.source)


def gc_remote(
    args: argparse.Namespace, st: RemoteStore, listed: Listed | None = None, alone: bool = False
) -> dict:
    """``gc DIR --remote URL``: delete what the remote retention recorded in the newest remote
    manifest does not keep (``--keep-last`` overriding it), with ``--other-runs`` and
    ``--remove-corrupt`` as for the local directory, uploads a crash left without a manifest
    once nothing was written to them for a day, then the blobs nothing refers to any more.
    Checks sizes, not checksums (nothing is downloaded). Returns what was (or would be)
    deleted and kept; ``listed``: the store's listing if just taken (no blobs: no collection);
    ``alone``: DIR holds none of the run's checkpoints (not the run's own directory)."""
    from . import remote_blobs
    from .blob_damage import remote_keep_note

    entries, names = st.scan_with_blobs() if listed is None else listed
    if not entries:  # a mistyped URL reads as an empty store: say so, as ls --remote does
        print(
            f"resilient-ckpt gc: the remote {st.url} holds no checkpoint: check the URL "
            "(a mistyped one reads as an empty store)",
            file=sys.stderr,
        )
    p, applied, run_id = remote_plan(entries, args.keep_last, dropped_archives(args))
    policy = applied.policy
    if p is None or policy is None:
        raise no_policy(args, st.url, False, applied.source)
    now = time.time()
    doomed: list[tuple[Any, str]] = []
    kept: list[tuple[Any, str]] = []
    for e in entries:
        m = e.manifest
        if m is None:
            age = -1.0 if e.modified is None else now - e.modified  # -1: time unknown
            torn = e.problem == NO_MANIFEST
            if not REMOTE_CKPT_RE.match(e.name):  # another folder under the URL: not ours to delete
                kept.append((e, "not a checkpoint's name: left alone"))
            elif torn and age >= 0 and age > STALE_UPLOAD_S:
                doomed.append((e, f"upload without a manifest, untouched for {age / 3600:.0f} h"))
            elif torn or e.unread:  # (unread: the store did not answer; not known damaged)
                kept.append((e, f"{e.problem}{'; may be an upload in progress' * torn}"))
            elif args.remove_corrupt:  # a manifest that cannot be read
                doomed.append((e, f"corrupt: {e.problem}"))
            else:
                kept.append((e, f"corrupt: {e.problem} (--remove-corrupt deletes it)"))
        elif e.name in p.delete:
            dropped = dropped_archives(args) is not None and archived(m)
            doomed.append((e, DROPPED if dropped else "not kept by the remote retention"))
        elif args.other_runs and run_id is not None and m.run_id != run_id:
            doomed.append((e, f"checkpoint of another run ({m.run_id})"))
        elif why := remote_keep_note(e.problem, args):  # a torn blob: push repairs it
            kept.append((e, why))
        elif e.name in p.held:  # corrupt, but it records a roll-back
            kept.append((e, p.held[e.name]))
        elif e.problem and (args.remove_corrupt or getattr(args, "remove_blob_corrupt", 0)):
            doomed.append((e, f"corrupt: {e.problem}"))
        else:
            kept.append((e, "; ".join(p.keep.get(e.name, []))))
    gone = {e.name for e, _ in doomed}
    if alone:
        _local_copies_note(args, [e.manifest for e, _ in doomed if e.manifest is not None])
    failed: dict[str, str] = {}  # name -> the store's refusal (one stops nothing else)
    for e, _ in [] if args.dry_run else doomed:
        try:
            st.delete(e.name)
        except RemoteDeleteRefusedError as err:
            failed[e.name] = str(err)
            print(f"resilient-ckpt gc: could not delete {st.url}/{e.name}: {err}", file=sys.stderr)
    after = [e for e in entries if e.name not in gone] if args.dry_run else None
    blobs = remote_blobs.collect(st, after, args.dry_run, names) if names else []  # (crashes')

    def facts(e: Any, why: str) -> dict[str, Any]:
        m = e.manifest
        return {
            "name": e.name,
            "step": m.step if m else None,
            "run_id": m.run_id if m else None,
            "path": f"{st.url}/{e.name}",
            "problem": e.problem,
            "why": why,
        }

    return {
        "url": st.url,
        "run_id": run_id,
        "retention": policy.to_json(),
        "retention_from": applied.source,
        "delete": [facts(e, why) for e, why in doomed if e.name not in failed],
        "failed": [
            facts(e, why) | {"error": failed[e.name]} for e, why in doomed if e.name in failed
        ],
        "keep": [facts(e, why) for e, why in kept],
        "blobs_deleted": blobs,
    }


def _local_copies_note(args: argparse.Namespace, doomed: list[Any]) -> None:
    """``gc --remote URL`` away from the run's directory: the archive points it deletes that
    the run's local tier keeps too (its retention, recorded in the manifest, has the same
    ``keep_every_n_steps``: a run with ``remote_every_n_saves`` > 1) stay there; said on
    stderr, with what deletes them (a restart does not upload them again: restore_remote)."""
    steps = [m.step for m in doomed if archived_point(m.step, m.retention)]
    if not steps:
        return
    print(
        f"resilient-ckpt gc: the run's local directory keeps its own copies of step "
        f"{', '.join(map(str, sorted(steps)))} (archive points: the run uploads only some of its "
        f"saves, remote_every_n_saves, so its local retention keeps them too); gc "
        f"{'would delete' if args.dry_run else 'deleted'} the remote copies only, and a restart "
        "of the run does not upload them again; to delete the local ones, run `resilient-ckpt "
        "gc DIR --drop-archives` (or --drop-all-archives) with the run's own directory as DIR",
        file=sys.stderr,
    )


def print_gc_remote(result: dict[str, Any], args: argparse.Namespace) -> None:
    verb = "would delete" if args.dry_run else "deleted"
    applied = policy_text(RetentionPolicy.from_json(result["retention"]))
    print(f"{result['url']}: remote retention {applied} ({result['retention_from']})")
    for d in result["delete"]:
        print(
            f"{verb} {d['path']} (step {d['step'] if d['step'] is not None else '?'}): {d['why']}"
        )
    for k in result["keep"]:
        why = as_run(k["why"], args.dir, "--remote", args.remote)
        print(f"keep {k['path']} (step {k['step'] if k['step'] is not None else '?'}): {why}")
    if result["blobs_deleted"]:
        print(f"{verb} {len(result['blobs_deleted'])} remote blob(s) no checkpoint refers to")
    n, kept, failed = len(result["delete"]), len(result["keep"]), len(result["failed"])
    print(
        f"{result['url']}: {n} {'would be deleted' if args.dry_run else 'deleted'}, {kept} kept"
        + (f", {failed} could not be deleted (the store refused)" if failed else "")
    )
