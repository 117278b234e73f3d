"""The ``resilient-ckpt`` argument parser: the top-level help (description, examples, exit
codes), ``--version``, and every command's arguments and help text, each command bound to its
runner in :mod:`.cli_commands` (``export``: :mod:`.cli_export`). Building it imports no command
module: :mod:`.cli` parses with it, then runs the command chosen. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .cli_commands import cmd_gc, cmd_inspect, cmd_ls, cmd_pull, cmd_push, cmd_report, cmd_verify
from .cli_export import add_export_arguments, cmd_export
from .cli_format import DIR_HELP, DIR_OR_ONE_HELP, PROG

DESCRIPTION = """\
Look at, verify and clean up a directory of checkpoints written by resilient_callbacks
(Checkpointer, ResilientCheckpoint, the DeepSpeed and DCP integrations), and copy checkpoints
to and from a remote store.

A checkpoint is "valid" only once every file's size and checksum has been checked against its
manifest; a check of sizes alone (ls --fast) says "sizes ok, not verified"."""

EPILOG = """\
examples:
  resilient-ckpt ls ckpts/run1                list checkpoints: status, size, why each is kept
  resilient-ckpt ls ckpts/run1 --fast         the same, checking sizes only (not verified)
  resilient-ckpt verify ckpts/run1            verify the newest checkpoint (--all: every one)
  resilient-ckpt inspect ckpts/run1           keys, shapes and metrics of the newest valid one
  resilient-ckpt inspect ckpts/run1 --step 20 --json
  resilient-ckpt gc ckpts/run1 --dry-run      what gc would delete, and why
  resilient-ckpt gc ckpts/run1 --other-runs   also delete other runs' checkpoints
  resilient-ckpt gc ckpts/run1 --remote s3://bucket/run1 --dry-run   the remote store too
  resilient-ckpt push ckpts/run1 s3://bucket/run1 -o endpoint_url=http://127.0.0.1:9000
  resilient-ckpt export ckpts/run1 hf_model   a from_pretrained directory (Transformers runs),
                                              or consolidated weights (DeepSpeed, FSDP runs)
  resilient-ckpt report ckpts/run1 --output report.html   goodput, failures, saves (--png, --json)

ls, verify, inspect, gc, pull, push and report take --json (typed values, ISO-8601 times).
Exit codes: 0 success; 1 the command ran and failed (a checkpoint checked is bad, the store
cannot be reached, the directory is locked); 2 bad usage (also a DIR that does not exist, a URL
where a local directory belongs, a URL scheme fsspec does not know); 3 nothing to act on (no
checkpoint in DIR or the store: verify, inspect, export, pull, push, report; no such report --run);
130 Ctrl-C. ls, gc and report exit 0 whatever the
checkpoints' states (they list them; ls of an empty directory too): verify's exit code says
whether they are good.
Run `resilient-ckpt COMMAND --help` for a command's options; docs/cli.md has more."""

OPTION_HELP = (
    "an fsspec option for the remote store, KEY=VALUE (repeatable); a VALUE that parses as "
    "JSON is used as JSON: -o endpoint_url=http://127.0.0.1:9000 "
    '-o \'client_kwargs={"region_name": "eu-west-1"}\''
)


def package_version() -> str:
    """The installed distribution's version, else ``resilient_callbacks.__version__``."""
    import importlib.metadata

    try:
        return importlib.metadata.version("resilient-callbacks")
    except importlib.metadata.PackageNotFoundError:
        package = sys.modules.get(__package__ or "resilient_callbacks")
        return str(getattr(package, "__version__", "unknown"))


class _Version(argparse.Action):
    """``--version``, computed only when asked for."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        kw.setdefault("help", f"print '{PROG} VERSION' and exit")
        super().__init__(
            option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kw
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"{PROG} {package_version()}")
        parser.exit()


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 1")
    return n


def _json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        help=f"print {what} as JSON (numbers and booleans typed, null when missing, ISO-8601 "
        "times); the shapes are in docs/cli.md",
    )


def _sub(sub: Any, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=help,
        description=description or help[0].upper() + help[1:] + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action=_Version)
    sub = ap.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")

    p = _sub(
        sub,
        "ls",
        "list checkpoints: step, time, size, status, and why each is kept",
        "List every checkpoint in DIR: step, time, size, status (valid / CORRUPT / incomplete),\n"
        "run, and why retention keeps it (or that gc would delete it). Every checksum is read\n"
        'unless --fast, which checks sizes only and says "sizes ok, not verified".',
    )
    p.add_argument("dir", metavar="DIR", help=DIR_OR_ONE_HELP)
    _json(p, "a list with one object per checkpoint")
    p.add_argument(
        "--fast", action="store_true", help="check sizes only, not checksums (not verified)"
    )
    p.add_argument("--remote", metavar="URL", help="also list this remote store (fsspec URL)")
    p.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", help=OPTION_HELP)
    p.set_defaults(fn=cmd_ls)

    p = _sub(
        sub,
        "verify",
        "check files' sizes and checksums (the newest checkpoint; --all: every one)",
        "Check every file of a checkpoint against its manifest: present, same size, same\n"
        "checksum. Without --step or --all: the newest checkpoint. Exits 1 if one checked is bad,\n"
        "3 if there is none.\n"
        "DIR may be a remote store's URL (s3://bucket/run1): its copies are read where they lie,\n"
        "nothing is written to local disk.",
    )
    p.add_argument(
        "dir",
        metavar="DIR",
        help=DIR_OR_ONE_HELP + ", or a remote store (fsspec URL, e.g. s3://bucket/run1)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, metavar="N", help="verify the checkpoint of step N")
    which.add_argument("--all", action="store_true", help="verify every checkpoint in DIR")
    _json(p, "the result")
    p.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", help=OPTION_HELP)
    p.set_defaults(fn=cmd_verify)

    p = _sub(
        sub,
        "inspect",
        "show a checkpoint's keys, shapes, dtypes, metrics and files",
        "Show one checkpoint: manifest (metrics, versions, files) and every key with its shape\n"
        "and dtype. It is verified first; without --step it is the newest valid checkpoint\n"
        "(a newer one skipped as corrupt is named on stderr). Exits 1 if it is corrupt.",
    )
    p.add_argument("dir", metavar="DIR", help=DIR_OR_ONE_HELP)
    p.add_argument(
        "--step", type=int, metavar="N", help="show step N (default: the newest valid checkpoint)"
    )
    p.add_argument(
        "--fast", action="store_true", help="check sizes only, not checksums (not verified)"
    )
    _json(p, "the checkpoint")
    p.set_defaults(fn=cmd_inspect)

    p = _sub(
        sub,
        "gc",
        "delete what retention does not keep, and leftovers of interrupted saves",
        "Delete leftovers of interrupted saves and the checkpoints the retention policy recorded\n"
        "in the newest manifest does not keep. Every checkpoint it keeps is verified first, so a\n"
        "corrupt one never counts as the newest valid one. Refuses to run beside a live writer.",
    )
    p.add_argument("dir", metavar="DIR", help=DIR_HELP)
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    p.add_argument(
        "--remove-corrupt",
        action="store_true",
        help="also delete corrupt checkpoints (not those corrupt only through a damaged shared "
        "blob, which can be repaired: see --remove-blob-corrupt)",
    )
    p.add_argument(
        "--remove-blob-corrupt",
        action="store_true",
        help="also delete the checkpoints corrupt only because a blob they share (incremental) "
        "is missing or damaged; gc names the blob and its repair first",
    )
    p.add_argument(
        "--other-runs",
        action="store_true",
        help="also delete the checkpoints of runs other than the newest valid checkpoint's",
    )
    p.add_argument(
        "--remote",
        metavar="URL",
        help="also clean this remote store (fsspec URL) by its recorded remote retention; "
        "it alone where DIR does not exist (said on stderr)",
    )
    p.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", help=OPTION_HELP)
    p.add_argument(
        "--keep-last",
        type=_at_least_one,
        metavar="N",
        help="keep the newest N, N >= 1 (overrides the keep_last recorded in the manifests)",
    )
    drop = p.add_mutually_exclusive_group()  # (both given, "all" won without a word)
    drop.add_argument(
        "--drop-archives",
        action="store_true",
        help="also delete the archive points of a keep_every_n_steps the newest checkpoint's "
        "policy no longer has (kept forever by the policy each was written with)",
    )
    all_help = "also delete every archive point, the newest policy's keep_every_n_steps too"
    drop.add_argument("--drop-all-archives", action="store_true", help=all_help)
    _json(p, "what is (or would be) deleted and what is kept")
    p.set_defaults(fn=cmd_gc)

    p = _sub(sub, "pull", "download a remote checkpoint (the newest, or --step N), verified")
    p.add_argument(
        "url", metavar="URL", help="the remote store (fsspec URL, e.g. s3://bucket/run1)"
    )
    p.add_argument("dir", metavar="DIR", help="the local checkpoint directory to download into")
    p.add_argument("--step", type=int, metavar="N", help="pull step N (default: the newest)")
    p.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", help=OPTION_HELP)
    _json(p, "what was pulled")
    p.set_defaults(fn=cmd_pull)

    p = _sub(
        sub,
        "push",
        "upload the valid local checkpoints the remote store lacks, and again those whose "
        "remote copy is damaged",
    )
    p.add_argument("dir", metavar="DIR", help=DIR_HELP)
    p.add_argument(
        "url", metavar="URL", help="the remote store (fsspec URL, e.g. s3://bucket/run1)"
    )
    p.add_argument("--step", type=int, metavar="N", help="push only step N (default: all)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read the remote copies that list as complete and check their checksums; upload "
        "again one whose content differs (by default sizes are compared)",
    )
    p.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", help=OPTION_HELP)
    _json(p, "what was pushed, already there, or skipped")
    p.set_defaults(fn=cmd_push)

    p = _sub(
        sub,
        "export",
        "write a Transformers checkpoint as a from_pretrained directory, or a Lightning, "
        "DeepSpeed, sharded or plain Checkpointer one as consolidated safetensors",
        "Write the model of a checkpoint where other tools load it: a Transformers run's as a\n"
        "from_pretrained directory (a PEFT run's adapters, or --merged), a Lightning, DeepSpeed\n"
        "or sharded (FSDP, tensor-parallel) run's, or a module of a plain Checkpointer state (--key),\n"
        "as consolidated safetensors (model.safetensors and export.json). Every checksum is\n"
        "verified first. docs/cli.md.",
    )
    add_export_arguments(p)
    p.set_defaults(fn=cmd_export)  # cli_export.py

    p = _sub(
        sub,
        "report",
        "a goodput report of a run: one HTML page with plots (--png, --json)",
        "From DIR's run history and checkpoints: a timeline of runs, saves, failures and\n"
        "restarts, the work lost per failure, time spent saving, goodput over time, the interval\n"
        "used beside Daly's optimum, and the checkpoints by tier, as one self-contained HTML page\n"
        "(plots need matplotlib: pip install 'resilient-callbacks[report]'). docs/monitoring.md.",
    )
    p.add_argument("dir", metavar="DIR", nargs="?", help=DIR_HELP)  # see cli._report_dir
    p.add_argument("--output", metavar="FILE", help="the HTML page (default report.html)")
    p.add_argument("--png", metavar="FILE", help="also (or only) every plot in one PNG")
    p.add_argument(
        "--json",
        metavar="FILE",
        nargs="?",
        const="-",
        help="the report's numbers as JSON: to stdout, or into FILE",
    )
    p.add_argument("--run", metavar="RUN_ID", help="the run to report (default: the newest)")
    p.add_argument("--remote", metavar="URL", help="also list this remote tier (fsspec URL)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every local checkpoint's checksums (reads them all; default: sizes only, "
        "status 'unverified')",
    )
    p.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", help=OPTION_HELP)
    p.set_defaults(fn=cmd_report)
    # DIR is required (optional to argparse only so that `report --json DIR` parses): said so
    p.usage = p.format_usage().removeprefix("usage: ").replace(" [DIR]", " DIR").rstrip()
    return ap
