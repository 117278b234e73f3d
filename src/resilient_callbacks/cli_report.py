"""``resilient-ckpt report DIR [--remote URL [-o K=V]] [--output report.html] [--png FILE]
[--json [FILE]]``: the
goodput report of a run from its history and checkpoints (see :mod:`.report`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from . import catalog, history
from .cli_format import iso_time, jsonable
from .cli_scan import no_checkpoints, resolve
from .errors import CheckpointNotFoundError, ConfigError, nothing_found, usage
from .export_target import within


def report(args: argparse.Namespace) -> int:
    from . import report as rep

    # a URL, a missing path, a file, one checkpoint: said as ls and gc say it, with what to give
    root = os.path.abspath(resolve(args.dir, single_ok=False).root)
    if not rep.history_exists(root):
        if _node_part(root):
            raise nothing_found(
                CheckpointNotFoundError(
                    f"{args.dir} has no history.jsonl: it holds another node's parts of a "
                    "node-local run, whose history is kept on rank 0's node (the dirpath there)"
                )
            )
        if catalog.holders(root):  # `report demo_output`: the runs are further down
            raise no_checkpoints(args.dir, what="history.jsonl")
        raise nothing_found(
            CheckpointNotFoundError(
                f"{args.dir} has no history.jsonl: it is not a directory a Checkpointer wrote "
                "(or its runs predate the history)"
            )
        )
    remote = None
    if args.remote:
        from .cli_remote import store

        remote = store(args.remote, args.option, beside=root)
    rows = rep.checkpoint_rows(root, remote, verify=args.verify)
    if remote is not None and not any(r["tier"] == "remote" for r in rows):
        # a mistyped URL reads as an empty store: say so (as ls --remote does)
        print(
            f"resilient-ckpt report: the remote {remote.url} holds no checkpoint: check the URL "
            "(a mistyped one reads as an empty store)",
            file=sys.stderr,
        )
    read = history.read_lines(root)  # (read once: a history of many thousand records)
    data = rep.analyse(root, run_id=args.run, checkpoints=rows, now=time.time(), lines=read)
    if skipped := history.unreadable(root, lines=read):  # torn by a crash, foreign: said, not shown
        where = os.path.join(args.dir, history.HISTORY_NAME)
        lines = "line" if skipped == 1 else "lines"
        print(
            f"resilient-ckpt report: skipped {skipped} unreadable history {lines} in {where}",
            file=sys.stderr,
        )
    data["remote"] = remote.url if remote is not None else None
    if data.get("missing"):  # no run's records at all: failed, 1 (as verify --step N)
        missing = CheckpointNotFoundError(f"{args.dir}: {data['missing']}")
        if args.run is not None and rep.run_ids(history.records(root, lines=read)):
            raise nothing_found(missing)  # no such --run (the runs there named): 3
        raise missing
    for target in (args.json, args.png, args.output or "report.html"):
        if target and target != "-":
            _refuse_run_file(root, args.dir, target)
    wrote = []
    if args.json == "-":
        print(_json(data))
    elif args.json:
        _write(args.json, _json(data).encode())
        wrote.append(args.json)
    if args.output or args.png or not args.json:
        from . import report_html

        if args.png:
            _write(args.png, report_html.overview_png(data))
            wrote.append(args.png)
        if args.output or not args.png:
            out = args.output or "report.html"
            page = report_html.render_html(data, report_html.figure_pngs(data))
            _write(out, page.encode())
            wrote.append(out)
    s = data["summary"]
    if s:
        g = s["goodput"]
        goodput = (
            f"goodput {g:.1%}"
            if g is not None
            else "goodput unknown (no step() call was timed: useful time is measured between "
            "step() calls)"
        )
        lost = _work_lost(s)
        print(
            f"run {data['run_id']}: {goodput}, {s['failures']} failure(s), "
            f"{s['saves']} save(s), {s['saving_blocked_s']:.2f} s blocked saving, {lost}"
            + _last_life(data.get("lives") or []),
            file=sys.stderr,
        )
    if wrote:
        print("wrote " + ", ".join(wrote), file=sys.stderr)
    return 0


def _work_lost(s: dict[str, Any]) -> str:
    """The summary line's work lost to failures: the lower bound the records show, "unknown"
    for the failures whose process recorded nothing past the checkpoint resumed from (it said
    ">= 0.0 s of work lost" for a SIGKILL 7 steps past a save), and the time no record covers."""
    n, unknown = s["failures"], s.get("work_lost_unknown", 0)
    if not n:
        return f">= {s['work_lost_s_at_least']:.1f} s of work lost"
    gap = (
        f"{s['unaccounted_s']:.1f} s {{}}from the failures' last records to the restarts "
        "(lost work, time down or restarting: not told apart)"
    )
    if unknown == n:
        return (
            "work lost unknown (nothing recorded past the step resumed from: killed before "
            "the next heartbeat), " + gap.format("")
        )
    lost = f">= {s['work_lost_s_at_least']:.1f} s of work lost"
    if unknown:
        lost += f" (unknown for {unknown} of the {n} failures: no record past their checkpoint)"
    return lost + ", " + gap.format("more ")


def _last_life(lives: list[dict[str, Any]]) -> str:
    """How the run's last process ended, where it did not close: a kill is counted as a failure
    only once a restart follows it, so "0 failure(s)" alone read as a run that is fine."""
    last = lives[-1] if lives else {}
    if last.get("ended") == "killed":
        return (
            f"; its last process did not close (killed, or its machine lost) after step "
            f"{last['last_step']}: a restart resumes it (and counts it as a failure)"
        )
    if last.get("ended") == "failed":
        return f"; its last process failed ({last['error']}) after step {last['last_step']}"
    return "; its last process is still running" if last.get("ended") == "running" else ""


def _json(data: dict[str, Any]) -> str:
    """The report as the other commands write JSON (:mod:`.cli_format`): times ISO-8601 in UTC
    (``generated``, each checkpoint's ``time``), non-finite numbers as strings, strict JSON."""
    out = dict(data, generated=iso_time(data["generated"]))
    out["checkpoints"] = [
        {**{k: v for k, v in r.items() if k != "created"}, "time": iso_time(r.get("created"))}
        for r in data.get("checkpoints") or []
    ]
    return json.dumps(jsonable(out), indent=2, allow_nan=False, default=str)


_REPORT_SUFFIXES = (".html", ".htm", ".png", ".json")


def _refuse_run_file(root: str, shown: str, path: str) -> None:
    """Refuse an output ``path`` that could be one of the run's own files: inside the
    checkpoint directory ``root`` a report may only be a new-named ``.html``/``.png``/``.json``
    file directly in it, never its ``history.jsonl``, ``latest`` or anything in a checkpoint's
    folder (``report DIR --json DIR/history.jsonl`` replaced the history with the report)."""
    if "://" in path and not os.path.exists(path):  # (made a local folder named "s3:")
        raise usage(
            ConfigError(f"{path} is a URL: the report is written to a local file; give one")
        )
    target, run = os.path.realpath(path), os.path.realpath(root)
    if target == run:
        raise usage(ConfigError(f"{path} is the checkpoint directory itself"))
    if not within(target, run):
        return
    if os.path.dirname(target) == run and target.lower().endswith(_REPORT_SUFFIXES):
        return
    raise usage(
        ConfigError(
            f"{path} lies in the checkpoint directory {shown} and could replace the run's "
            "own files (its history, a checkpoint); write the report elsewhere, or as a new "
            ".html/.png/.json file directly in the directory"
        )
    )


def _write(path: str, data: bytes) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _node_part(root: str) -> bool:
    """Whether ``root`` holds node-local parts of checkpoints without rank 0's files."""
    from . import catalog
    from .cli_scan import node_part

    for e in catalog.scan(root, catalog.Depth.NONE):
        part = node_part(e.manifest)
        if part is not None and 0 not in (part["ranks"] or []):
            return True
    return False
