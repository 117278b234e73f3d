"""``resilient-ckpt verify DIR``: every checksum of a local directory's newest checkpoint (or of
step N, or all), and the ``step_<n>`` folders without a manifest, which no save of ours leaves.
Imported only when it runs (it imports torch through the catalog)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import catalog
from .catalog import Depth, Entry, Status
from .cli_scan import no_checkpoints, report_verified, resolve, row, scan
from .errors import CheckpointNotFoundError
from .reader import by_commit, check, unordered


def verify(args: argparse.Namespace) -> int:
    target = resolve(args.dir)
    for _ in range(5):  # a run writing here may delete a checkpoint while it is verified
        scope, chosen, committed = _to_verify(target, args)
        for e in chosen:
            check(e)
        if all(e.status is not Status.INCOMPLETE for e in chosen):
            break
    chosen = [e for e in chosen if e.status is not Status.INCOMPLETE]  # deleted meanwhile
    return _report_verified(args, target, scope, chosen, committed)


def _to_verify(target: Any, args: argparse.Namespace) -> tuple[str, list[Entry], list[Entry]]:
    """``(scope, the entries to verify, every committed entry)`` of ``verify``'s arguments."""
    committed = catalog.committed(scan(target, Depth.NONE))
    if not committed:
        raise no_checkpoints(target.root)
    if target.only is not None:
        scope, chosen = "checkpoint", committed
    elif args.step is not None:
        scope = "step"
        chosen = [e for e in committed if e.step == args.step]
        if not chosen:
            steps = sorted({e.step for e in committed if e.step is not None})
            raise CheckpointNotFoundError(
                f"no checkpoint of step {args.step} in {target.root} (its steps: "
                f"{', '.join(map(str, steps)) or 'none readable'})"
            )
    elif args.all:
        scope, chosen = "all", committed
    else:
        scope = "newest"
        newest = by_commit(committed)[:1]
        chosen = newest + unordered(committed, newest[0].step if newest else None)
    return scope, chosen, committed


def _report_verified(
    args: argparse.Namespace, target: Any, scope: str, chosen: list[Entry], committed: list[Entry]
) -> int:
    rows = [row(e, Depth.FULL) for e in chosen]
    status = report_verified(args, target.root, scope, rows, len(committed))
    if status and scope == "newest" and not args.json:
        print(
            f"the newest checkpoint is corrupt; `resilient-ckpt inspect {args.dir}` shows "
            f"the newest valid one, `resilient-ckpt verify {args.dir} --all` checks all "
            f"{len(committed)}",
            file=sys.stderr,
        )
    return status
