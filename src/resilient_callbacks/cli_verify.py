"""``resilient-ckpt verify DIR``: every checksum of a local directory's newest checkpoint (or of
step N, or all), and the ``step_<n>`` folders without a manifest, which no save of ours leaves.
Imported only when it runs; it needs no torch."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import catalog
from .catalog import Depth, Entry, Status
from .cli_scan import (
    no_checkpoints,
    report_verified,
    resolve,
    row,
    say_links,
    scan,
    without_manifest,
)
from .commit import CKPT_RE, ckpt_name
from .errors import CheckpointNotFoundError
from .reader import by_commit, check, find, unordered
from .redact import command

NO_MANIFEST = (
    "no manifest.json, though named as a checkpoint: not a committed one (no save leaves such a "
    "folder: the checkpoint is damaged, or was copied without its manifest); never loaded, "
    "`resilient-ckpt gc` removes it"
)


def verify(args: argparse.Namespace) -> int:
    target = resolve(args.dir)
    say_links("verify", target)
    for _ in range(5):  # a run writing here may delete a checkpoint while it is verified
        try:
            scope, chosen, committed, broken = _to_verify(target, args)
        except CheckpointNotFoundError as nothing:
            if not args.json:
                raise
            # nothing to check (exit 3, 1 for a --step not there): still the object a script
            # parses, the note on stderr
            scope = "step" if args.step is not None else "all" if args.all else "newest"
            report_verified(args, target.root, scope, [], 0)
            print(f"resilient-ckpt verify: {nothing}", file=sys.stderr)
            return nothing.exit_code
        for e in chosen:
            check(e)
        if all(e.status is not Status.INCOMPLETE for e in chosen):
            break
    chosen = [e for e in chosen if e.status is not Status.INCOMPLETE]  # deleted meanwhile
    return _report_verified(args, target, scope, chosen + broken, committed)


def _to_verify(
    target: Any, args: argparse.Namespace
) -> tuple[str, list[Entry], list[Entry], list[Entry]]:
    """``(scope, the entries to verify, every committed entry, the step_<n> folders without a
    manifest in scope)`` of ``verify``'s arguments. Such a folder (in a directory of ours) fails
    the check: no save leaves one, so it is a damaged checkpoint."""
    entries = scan(target, Depth.NONE)
    committed = catalog.committed(entries)
    broken = _no_manifest(target, entries)
    if not committed and not broken:
        raise no_checkpoints(target.root)
    if target.only is not None:
        scope, chosen = "checkpoint", committed
        if args.step is not None:  # --step of another: raises, as inspect and export do
            find(committed, target.root, args.step, target.only)
    elif args.step is not None:
        scope = "step"
        chosen = [e for e in committed if e.step == args.step]
        broken = [e for e in broken if e.step == args.step]
        if not chosen and not broken:
            steps = sorted({e.step for e in committed if e.step is not None})
            raise CheckpointNotFoundError(
                f"no checkpoint of step {args.step} in {target.root} (its steps: "
                f"{', '.join(map(str, steps)) or 'none readable'})"
            )
    elif args.all:
        scope, chosen = "all", committed
    else:  # the newest, and a folder without a manifest that would be newer (or as new)
        scope = "newest"
        newest = by_commit(committed)[:1]
        top = newest[0].step if newest else None
        chosen = newest + unordered(committed, top)
        broken = [e for e in broken if top is None or (e.step is not None and e.step >= top)]
    return scope, chosen, committed, broken


def _no_manifest(target: Any, entries: list[Entry]) -> list[Entry]:
    """The ``step_<n>`` folders without a manifest among ``entries``, but for another tool's in a
    directory that is not ours (:func:`.catalog.foreign_folders`)."""
    if target.only is not None:
        return []
    out = without_manifest(target.root, entries)
    for e in out:
        e.problem = NO_MANIFEST
    return out


def _report_verified(
    args: argparse.Namespace, target: Any, scope: str, chosen: list[Entry], committed: list[Entry]
) -> int:
    rows = [row(e, Depth.FULL) for e in chosen]
    status = report_verified(args, target.root, scope, rows, len(committed))
    _say_misnamed(chosen)
    if status and scope != "newest" and not args.json:
        from .blob_damage import damage_note

        if note := damage_note(committed, args.dir):  # a shared blob: what else it corrupts
            print(note, file=sys.stderr)
    if status and scope == "newest" and not args.json:
        bad = [r for r in rows if r["status"] != "valid"]
        what = "corrupt" if any(r["status"] != "incomplete" for r in bad) else "incomplete"
        blob = _bad_blob(chosen)
        if blob is not None:  # incremental: other checkpoints may name it too
            print(
                f"the newest checkpoint is corrupt: its blob {blob} is missing or damaged, and "
                "every checkpoint that names it is corrupt too. "
                f"{command('verify', args.dir, '--all')} shows which are whole; with a remote "
                f"tier, {command('pull', 'URL', args.dir)} fetches a whole copy",
                file=sys.stderr,
            )
            return status
        every = len(committed) + len(_no_manifest(target, scan(target, Depth.NONE)))
        print(  # (--all checks the step_<n> folders without a manifest too)
            f"the newest checkpoint is {what}; {command('inspect', args.dir)} shows the newest "
            f"valid one, {command('verify', args.dir, '--all')} checks all {every}",
            file=sys.stderr,
        )
    return status


def _say_misnamed(chosen: list[Entry]) -> None:
    """Name on stderr a checkpoint whose folder is named for another step than its manifest
    says (renamed or copied by hand: no save names one so): ``--step``, a restore and
    retention go by the manifest's. Its checksums decide the exit status, as for any."""
    for e in chosen:
        named = CKPT_RE.match(e.name)
        if e.manifest is not None and named and int(named.group(1)) != e.manifest.step:
            print(
                f"resilient-ckpt verify: {e.path} is named for step {int(named.group(1))}, "
                f"but its manifest says step {e.manifest.step} (renamed or copied by hand: no "
                f"save names a folder so); --step, a restore and retention take it as step "
                f"{e.manifest.step}: rename it to {ckpt_name(e.manifest.step)} to have its name "
                "say so",
                file=sys.stderr,
            )


def _bad_blob(chosen: list[Entry]) -> str | None:
    """The blob a corrupt checkpoint's problem names (shared with other checkpoints), or None."""
    for e in chosen:
        if e.status is Status.CORRUPT and e.manifest is not None and e.problem:
            for b in e.manifest.blobs:
                if b.path in e.problem:
                    return b.path
    return None
