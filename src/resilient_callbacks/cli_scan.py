"""What the ``resilient-ckpt`` commands share: finding the checkpoint directory a user meant,
judging its checkpoints, and one row of facts per checkpoint. Picking the newest valid one is
:mod:`.reader`'s.

A status is only ``valid`` when every checksum was read; a check of sizes alone gives
``unverified`` (see :mod:`.cli_format`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import catalog, checking, progress_lines, store_wait
from .catalog import Depth, Entry, Status
from .cli_format import (
    CHECKSUMS,
    CORRUPT,
    INCOMPLETE,
    MANIFEST,
    SIZES,
    UNVERIFIED,
    VALID,
    fmt_size,
    iso_time,
    print_json,
)
from .commit import CKPT_RE, STAGING_PREFIX
from .errors import CheckpointNotFoundError, nothing_found, usage
from .manifest import MANIFEST_NAME
from .redact import command

CHECKED = {Depth.FULL: CHECKSUMS, Depth.SIZE: SIZES, Depth.NONE: MANIFEST}


@dataclass
class Target:
    root: str  # the checkpoint directory (what Checkpointer(...) was given)
    only: str | None = None  # one checkpoint's name, when DIR was that checkpoint


def is_url(path: str) -> bool:
    """Whether ``path`` is a remote store's URL (``s3://bucket/run1``), not a local path."""
    return "://" in path and not os.path.exists(path)


def resolve(path: str, *, single_ok: bool = True) -> Target:
    """The checkpoint directory ``path`` names. ``path`` may also be one checkpoint in it (a
    directory holding ``manifest.json``) where ``single_ok``. A path that cannot be one (a URL,
    nothing, a file, one checkpoint where not ``single_ok``): marked a usage error (exit 2)."""
    if is_url(path):
        raise usage(
            CheckpointNotFoundError(
                f"{path} is a remote store's URL; this command reads a local checkpoint directory. "
                f"For the remote store: {command('ls', 'DIR', '--remote', path)} lists its copies "
                f"beside the local ones, {command('verify', path)} checks their checksums, and "
                f"{command('pull', path, 'DIR')} downloads one, verified"
            )
        )
    if not os.path.exists(path):
        raise usage(
            CheckpointNotFoundError(
                f"{path}: no such directory (give the directory the checkpoints were saved to, the "
                "one passed to Checkpointer(...) or ResilientCheckpoint(...))"
            )
        )
    if not os.path.isdir(path):
        raise usage(
            CheckpointNotFoundError(f"{path}: not a directory; give a checkpoint directory")
        )
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        parent = os.path.dirname(os.path.abspath(path))
        if not single_ok:
            name = os.path.basename(os.path.abspath(path))
            if not CKPT_RE.match(name):  # a copy under a name of one's own: gc leaves it alone
                raise usage(
                    CheckpointNotFoundError(
                        f"{path} is a copy of a checkpoint under a name of your own, not a "
                        f"directory of checkpoints: give the run's directory {parent} (gc never "
                        "deletes such a copy, nor pushes it; remove it yourself when done)"
                    )
                )
            raise usage(
                CheckpointNotFoundError(
                    f"{path} is one checkpoint, not a directory of checkpoints; give its parent "
                    f"directory {parent}"
                )
            )
        return Target(parent, os.path.basename(os.path.abspath(path)))
    return Target(path)


def scan(target: Target, depth: Depth) -> list[Entry]:
    if target.only is None:
        return catalog.scan(target.root, depth)
    if not CKPT_RE.match(target.only):  # a copy of the user's (step_N.bak, best): not listed
        one = catalog.check(target.only, os.path.join(target.root, target.only), depth)
        return [] if one is None else [one]
    return [e for e in catalog.scan(target.root, depth) if e.name == target.only]


def say_links(cmd: str, target: Target) -> None:
    """A note on stderr per ``step_<n>`` entry of the checkpoint directory that is a symbolic
    link: :func:`catalog.scan` never follows one (no save makes one), so it is not listed."""
    if target.only is not None:
        return
    try:
        names = sorted(os.listdir(target.root))
    except OSError:
        return
    for name in names:
        path = os.path.join(target.root, name)
        if CKPT_RE.match(name) and os.path.islink(path):
            print(
                f"resilient-ckpt {cmd}: note: {path} is a symbolic link: not listed or "
                "checked; checkpoints are never links",
                file=sys.stderr,
            )


def oldest_first(entries: list[Entry]) -> list[Entry]:
    """``entries`` (in :func:`catalog.scan`'s order) in the order ``ls`` lists them: by commit
    number, a checkpoint whose manifest cannot be read (no commit number) by the step in its
    folder name, before the first one of a larger step; those without a manifest last. The
    scan's own order (retention's) puts the unreadable ones first."""
    readable = [e for e in entries if e.manifest is not None]
    unreadable = sorted(
        (e for e in entries if e.manifest is None and e.status is not Status.INCOMPLETE),
        key=lambda e: (e.step is None, e.step or 0, e.name),
    )
    listed: list[Entry] = []
    for e in readable:
        while unreadable and unreadable[0].step is not None and unreadable[0].step < (e.step or 0):
            listed.append(unreadable.pop(0))
        listed.append(e)
    incomplete = [e for e in entries if e.status is Status.INCOMPLETE]
    return listed + unreadable + incomplete


#: a checkpoint at least this large gets a line on stderr before its checksums are read
LARGE_BYTES = 1 << 30


@contextlib.contextmanager
def reading_said(cmd: str) -> Iterator[None]:
    """While command ``cmd`` runs: a line on stderr before every checksum of a checkpoint of
    at least :data:`LARGE_BYTES` is read (at disk speed: minutes for hundreds of GB), and one
    when a remote store's listing is not done after a few seconds (:mod:`.store_wait`), and a
    transfer's progress where no bar shows it (stderr not a terminal: :mod:`.progress_lines`)."""

    def say(path: str, nbytes: int) -> None:
        if nbytes >= LARGE_BYTES:
            fast = " (--fast checks sizes only)" if cmd in ("ls", "inspect") else ""
            print(
                f"resilient-ckpt {cmd}: reading every checksum of {path} "
                f"({fmt_size(nbytes)}){fast}",
                file=sys.stderr,
                flush=True,
            )

    def waited(what: str, seconds: float) -> None:
        print(
            f"resilient-ckpt {cmd}: {what}: not done after {seconds:g} s; still waiting for "
            "the store (a store of many objects takes a while to list; a client that cannot "
            "connect retries, and a wrong endpoint or a store that is down ends in an error)",
            file=sys.stderr,
            flush=True,
        )

    def moved(line: str) -> None:  # a transfer's progress where no bar shows (not a terminal)
        print(f"resilient-ckpt {cmd}: {line}", file=sys.stderr, flush=True)

    with checking.said_by(say), store_wait.said_by(waited), progress_lines.said_by(moved):
        yield


def newer_without_manifest(path: str, step: int | None) -> list[str]:
    """The ``step_<n>`` folders without a manifest (no save leaves one: a damaged checkpoint)
    in the checkpoint directory ``path`` whose step is at least ``step``: what ``inspect`` and
    ``export`` pass over to show the newest valid checkpoint, as a restore does, saying so (as
    a restore warns). Another tool's in a directory that is not ours are left out."""
    if step is None or not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return []
    torn = without_manifest(path, catalog.scan(path, Depth.NONE))
    return [e.name for e in torn if e.step is not None and e.step >= step]


def without_manifest(root: str, entries: list[Entry]) -> list[Entry]:
    """The ``step_<n>`` folders without a manifest among ``entries`` (scanned in ``root``),
    but for another tool's in a directory that is not ours (:func:`.catalog.foreign_folders`)."""
    foreign = set(catalog.foreign_folders(root, entries))
    return [
        e
        for e in entries
        if e.status is Status.INCOMPLETE and CKPT_RE.match(e.name) and e.name not in foreign
    ]


NOT_LOADED = (
    "no manifest.json: not a committed checkpoint (no save leaves such a folder: damaged), "
    "never loaded; `resilient-ckpt gc` removes it"
)


def no_checkpoints(path: str, what: str = "checkpoints") -> CheckpointNotFoundError:
    """The error for a directory without checkpoints, naming the subdirectories that hold some
    (``ls demo_output`` where the checkpoints are in ``demo_output/run1/checkpoints``):
    marked :func:`.errors.nothing_found` (exit 3), but for a ``step_<n>`` folder without a manifest given
    as ``path`` (a damaged checkpoint: exit 1)."""
    if (
        CKPT_RE.match(os.path.basename(os.path.normpath(path)))
        and not os.path.exists(os.path.join(path, MANIFEST_NAME))
        and not catalog.plain_dcp(path)
    ):
        parent = os.path.dirname(os.path.abspath(path))
        return CheckpointNotFoundError(
            f"{path} has no {MANIFEST_NAME}: it is named as a checkpoint but is not a committed "
            "one (no save leaves such a folder: damaged, or copied without its manifest), and is "
            f"never loaded; {command('verify', parent)} checks the directory's checkpoints"
        )
    note = catalog.plain_dcp_note(path)
    note = f"; {note}" if note else ""
    subs = catalog.holders(path)
    if not subs:
        note = note or other_tools_note(path) or _uncommitted_note(path)
        return nothing_found(CheckpointNotFoundError(f"no {what} in {path}{note}"))
    listed = ", ".join(f"{sub} ({n})" for sub, n in subs)
    first = os.path.join(path, subs[0][0])
    return nothing_found(
        CheckpointNotFoundError(
            f"no {what} in {path}; these subdirectories hold checkpoints: {listed} "
            f"(give one of them, e.g. {first}){note}"
        )
    )


def _uncommitted_note(path: str) -> str:
    """What to add to "no checkpoints in DIR" where DIR holds only saves that never committed
    (the first save of a run killed mid-write): which, and what removes them; ``""`` else."""
    try:
        names = sorted(n for n in os.listdir(path) if n.startswith(STAGING_PREFIX))
    except OSError:
        return ""
    if not names:
        return ""
    return (
        f"; only a save that never committed: {', '.join(names)} (being written, or left by a "
        f"crash; never loaded): {command('gc', path)} removes it, as the next run does"
    )


# what other tools save checkpoints as (torch.save, Lightning, the HF Trainer, safetensors)
OTHER_TOOLS = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pkl")


def other_tools_note(path: str, most: int = 3) -> str:
    """What to add to "no checkpoints in DIR" where DIR, or a folder directly in it, holds what
    other tools save checkpoints as (``model.pt``, ``checkpoint-500/pytorch_model.bin``,
    ``epoch=0-step=100.ckpt``): they are there, but not ours; ``""`` where there are none."""
    found: list[str] = []
    try:
        with os.scandir(path) as top:
            items = sorted(top, key=lambda d: d.name)
        for d in items:
            if d.name.startswith(".") or d.name == "blobs" or CKPT_RE.match(d.name):
                continue  # ours: a save under way, the shared blobs, a damaged checkpoint
            if d.is_dir(follow_symlinks=False):
                with os.scandir(d.path) as inner:
                    names = sorted(f.name for f in inner if f.name.endswith(OTHER_TOOLS))
                found += [os.path.join(d.name, n) for n in names[:1]]
            elif d.name.endswith(OTHER_TOOLS):
                found.append(d.name)
            if len(found) > most:
                break
    except OSError:
        return ""
    if not found:
        return ""
    shown = ", ".join(found[:most]) + (" and more" if len(found) > most else "")
    return (
        f"; it holds files another tool saved ({shown}): resilient_callbacks neither lists "
        "nor loads them, only the checkpoints a Checkpointer or ResilientCheckpoint wrote "
        "(give the directory passed to it)"
    )


def state(e: Entry, depth: Depth) -> tuple[str, str | None]:
    """``(status, checked)`` of an entry scanned (or checked) at ``depth``."""
    if e.status is Status.INCOMPLETE:
        return INCOMPLETE, None
    if e.status is Status.CORRUPT:
        return CORRUPT, CHECKED[depth] if e.manifest is not None else MANIFEST
    return (VALID if depth is Depth.FULL else UNVERIFIED), CHECKED[depth]


def row(e: Entry, depth: Depth) -> dict[str, Any]:
    """The facts about one checkpoint, typed for JSON (the text output formats them)."""
    m = e.manifest
    status, checked = state(e, depth)
    return {
        "name": e.name,
        "step": e.step,
        "seq": m.seq if m else None,
        "status": status,
        "checked": checked,
        "time": iso_time(m.created) if m else None,
        "created": m.created if m else None,  # epoch seconds, for the text output; not in JSON
        "bytes": m.total_bytes if m else None,
        "run_id": m.run_id if m else None,
        "reason": m.reason if m else None,
        "metrics": dict(m.metrics) if m else {},
        "problem": e.problem,
        "path": e.path,
        "node_part": node_part(m),
    }


def node_part(m: Any) -> dict[str, Any] | None:
    """What part of a node-local checkpoint (docs/multinode.md) a manifest describes: the
    ranks whose files this node holds, of how many nodes and ranks; None for a whole one."""
    node = (m.extra.get("node") if m is not None else None) or None
    if not isinstance(node, dict):
        return None
    return {"ranks": node.get("ranks"), "nodes": node.get("nodes"), "world_size": m.world_size}


def node_part_note(rows: list[dict[str, Any]]) -> str | None:
    """The text outputs' word on rows that are node-local parts: "valid" is of this part."""
    parts = [r["node_part"] for r in rows if r.get("node_part")]
    if not parts:
        return None
    p = parts[-1]
    return (
        f"node-local: each checkpoint here is one node's part (the files of rank(s) "
        f"{', '.join(map(str, p['ranks'] or []))} of {p['world_size']} ranks on {p['nodes']} "
        "nodes); 'valid' means this part verifies. A checkpoint is whole with every node's "
        "part, or in the remote store (`resilient-ckpt verify URL`)."
    )


def public(r: dict[str, Any]) -> dict[str, Any]:
    """A row as written to JSON."""
    return {k: v for k, v in r.items() if k != "created"}


def report_verified(
    args: argparse.Namespace,
    where: str,
    scope: str,
    rows: list[dict[str, Any]],
    total: int,
    *,
    what: str = "checkpoint(s)",
    shown: str = "name",
    failed_hint: str = "",
    matched: str = "every checksum matches",
) -> int:
    """``verify``'s output for ``rows`` (each with ``name``, ``step``, ``status``, ``problem``
    and the key ``shown`` names) of ``total`` committed checkpoints in ``where``; the exit
    status. ``failed_hint`` ends the failure line on stderr."""
    bad = [r for r in rows if r["status"] != "valid"]
    if args.json:
        print_json(
            {
                "dir": where,
                "scope": scope,
                "ok": bool(rows) and not bad,  # (nothing checked is not ok: exit 1)
                "verified": len(rows),
                "failed": len(bad),
                "checkpoints": [public(r) for r in rows],
            }
        )
        return 1 if bad or not rows else 0
    for r in rows:
        step = r["step"] if r["step"] is not None else "?"
        if r["status"] == "valid":
            print(f"ok       step {step:>10}  {r[shown]}")
        else:
            label = "INCOMPLETE" if r["status"] == INCOMPLETE else "CORRUPT"
            print(f"{label:<7}  step {step:>10}  {r['name']}: {r['problem']}")
    if bad:
        print(f"{len(bad)} of {len(rows)} {what} failed verification{failed_hint}", file=sys.stderr)
        return 1
    if scope == "newest" and total > len(rows):
        matched += f" (the newest of {total}; --all verifies every one)"
    print(f"{len(rows)} {what} verified: {matched}")
    if note := node_part_note(rows):
        print(note)
    return 0
