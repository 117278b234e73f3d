"""``resilient-ckpt ls``: the table (or ``--json`` list) of a local checkpoint directory's
checkpoints, and with ``--remote`` of the remote tier beside it.

Each row says the checkpoint's step, time, size, status (sizes checked with ``--fast``, every
checksum otherwise; one checkpoint named as DIR is verified alone) and what keeps it, by the
retention recorded in the newest manifest (the plan ``gc`` applies: :mod:`.cli_local`). A
command run by one process, no ranks; it takes no lock and writes nothing, so it may run beside
a live writer. Imported only when ``ls`` runs; needs no torch. Moved from ``cli_local.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import catalog, cli_scan
from .blob_damage import damage_note
from .catalog import Depth, Entry
from .cli_format import UNVERIFIED, fmt_size, local_time, print_json, row_note, status_text, table
from .cli_local import _committed, _kept, _plan, missing_dir_note
from .cli_nodes import keep_uncommitted_parts
from .cli_scan import no_checkpoints, node_part_note, public, resolve, row, scan
from .reader import check
from .redact import command

__all__ = ["ls"]


def _step_cell(r: dict[str, Any]) -> str:
    """The step, and the name's suffix where it has one (``step_000000200-1``: ``200 (-1)``),
    so two checkpoints of one step can be told apart."""
    if r["step"] is None:
        return "?"
    base = f"step_{r['step']:09d}"
    name = str(r.get("name") or "")
    return f"{r['step']} ({name[len(base) :]})" if name.startswith(base + "-") else str(r["step"])


def ls(args: argparse.Namespace) -> int:
    depth = Depth.SIZE if args.fast else Depth.FULL
    rows: list[dict[str, Any]] = []
    entries: list[Entry] = []
    foreign: set[str] = set()
    root = args.dir
    st = None
    if args.remote:  # a URL that is one checkpoint, or DIR itself: said first
        from .cli_remote import store

        st = store(args.remote, args.option, beside=args.dir)
    if args.remote and not os.path.exists(args.dir):
        missing_dir_note(args, args.remote)
    else:
        target = resolve(args.dir)
        root = target.root
        cli_scan.say_links("ls", target)
        # DIR is one checkpoint: the others are only needed for the retention plan (sizes)
        everything = catalog.scan(target.root, depth if target.only is None else Depth.SIZE)
        entries = [e for e in everything if target.only is None or e.name == target.only]
        if target.only is not None and not entries:  # a copy of the user's (step_N.bak)
            entries = scan(target, Depth.SIZE)
        if target.only is not None and depth is Depth.FULL:
            entries = [check(e) for e in entries]
        p, _ = _plan(everything)
        keep_uncommitted_parts(everything, p, _committed(everything, args))
        foreign = set(catalog.foreign_folders(target.root, everything))
        if st is not None and target.only is None and len(everything) == len(foreign):
            missing_dir_note(args, args.remote, "holds no checkpoint of ours")  # (as gc says)
        entries = cli_scan.oldest_first(entries)
        rows = [row(e, depth) | _kept(e, p) for e in entries]
        for r in rows:
            if target.only is not None and r["name"] not in {e.name for e in everything}:
                r["copy"] = True  # the user's copy (step_N.bak): no checkpoint of the directory
    if st is not None:
        from .cli_remote import add_tiers

        add_tiers(entries, rows, st)
    if args.json:
        print_json([public(r) for r in rows])
        if not rows:
            print(f"resilient-ckpt ls: {_nothing(root, args.remote)}", file=sys.stderr)
        return 0
    if not rows:
        print(_nothing(root, args.remote))
        return 0
    header = ["STEP", "TIME", "SIZE", "STATUS", "RUN", "KEPT / PROBLEM"]
    if args.remote:
        header.insert(4, "TIER")
    cells = []
    for r in rows:
        line = [
            _step_cell(r),
            local_time(r["created"]),
            fmt_size(r["bytes"]),
            status_text(r["status"], r["checked"]),
            r["run_id"] or "-",
            row_note(r, foreign),
        ]
        if args.remote:
            line.insert(4, r.get("tier", "-"))
        cells.append(line)
    print(table(header, cells, right=frozenset({0, 2})))
    if note := node_part_note(rows):
        print(f"\n{note}")
    if note := damage_note(entries, args.dir):  # one shared blob: which checkpoints, repair
        print(f"\n{note}")
    unverified = [r for r in rows if r["status"] == UNVERIFIED]
    if any(r.get("tier") != "remote" for r in unverified):
        print(
            "\nnot verified: sizes were checked, checksums not read (--fast); "
            f"{command('verify', args.dir, '--all')} reads them"
        )
    if any(r.get("tier") == "remote" for r in unverified):
        print(
            "\nremote only, not verified: the sizes the store lists were checked, checksums "
            "not read; `resilient-ckpt pull` verifies every checksum of what it downloads"
        )
    for r in rows:
        if r.get("tier") == "remote-corrupt":
            print(f"\n{r['name']}: its remote copy is damaged ({r['remote_problem']}); "
                  f"{command('push', args.dir, args.remote)} uploads it again")  # fmt: skip
    return 0


def _nothing(root: str, remote: str | None) -> str:
    if remote:
        return f"no checkpoints in {root} or {remote}"
    return str(no_checkpoints(root)) if os.path.isdir(root) else f"no checkpoints in {root}"
