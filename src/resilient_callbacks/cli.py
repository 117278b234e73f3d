"""The ``resilient-ckpt`` command line (also ``python -m resilient_callbacks``): look at, verify
and clean up a checkpoint directory, and copy checkpoints to and from a remote store.

This module runs a command line: :mod:`.cli_parser` builds the parser, :mod:`.cli_commands`
binds each command to its module, imported only when it runs (``cli_ls``: ls; ``cli_local``: gc;
``cli_verify``; ``cli_inspect``; ``cli_remote``: pull, push; ``cli_remote_verify``: verify URL).
Only ``export`` (and ``inspect`` of a ``dcp.save`` checkpoint) imports torch
(:mod:`.cli_torch_import`): the others start in a fraction of its ~2 s import. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .cli_format import PROG
from .cli_parser import build_parser
from .errors import CheckpointError

DEBUG_ENV = "RESILIENT_CKPT_TRACEBACK"  # set: a remote store's own error shows its traceback


def _command_parser(parser: argparse.ArgumentParser, cmd: str | None) -> argparse.ArgumentParser:
    """The parser of command ``cmd`` (``parser`` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and cmd in action.choices:
            return action.choices[cmd]
    return parser


def _expand_home(args: argparse.Namespace) -> None:
    """``~`` and ``~user`` in the local paths given, as a shell expands them where they are
    not quoted (``DIR="~/ckpts"`` in a script, ``--output=~/r.html``): ``ls '~/run'`` said
    "no such directory". A URL's own paths are the store's (fsspec expands a local one)."""
    for name in ("dir", "out", "output", "png", "json"):
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))


def _remote_url(args: argparse.Namespace) -> str:
    """The URL of the remote store the command reads or writes; "" where it has none."""
    if args.cmd == "verify":  # `verify URL` reads a remote store
        from .cli_scan import is_url

        return str(args.dir) if is_url(args.dir) else ""
    return getattr(args, "remote", None) or getattr(args, "url", None) or ""


def _report_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``report --json DIR``: argparse gives DIR to --json's optional FILE; a directory there
    is the DIR meant, with the JSON to stdout (a file is never written over a directory)."""
    if args.json not in (None, "-") and os.path.isdir(args.json):
        args.dir, args.json = args.json, "-"
    else:
        parser.error("the following arguments are required: DIR")


class _PipeSafe:
    """stdout for a command piped into ``head``: once the reader has gone, the rest of the
    output goes to /dev/null and the command runs to its end, so its exit status is its own
    (``verify ... | head`` still says 1 for a corrupt checkpoint)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def _guard(self, fn: Any, *a: Any) -> Any:
        if self._gone:
            return None
        try:
            return fn(*a)
        except BrokenPipeError:
            self._gone = True
            import contextlib
            import os

            # later flushes (at exit too) go nowhere instead of failing
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            return None

    def write(self, s: str) -> int:
        self._guard(self._stream.write, s)
        return len(s)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, not the list of commands (`ls --bogus DIR`)
        _command_parser(parser, args.cmd).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.cmd is None:
        parser.print_help(sys.stderr)
        print(
            f"\n{PROG}: no command given; try `{PROG} ls DIR`, or `{PROG} COMMAND --help`",
            file=sys.stderr,
        )
        return 2
    _expand_home(args)
    if args.cmd == "report" and args.dir is None:
        _report_dir(_command_parser(parser, "report"), args)
    if getattr(args, "option", None) and hasattr(args, "remote") and not args.remote:
        _command_parser(parser, args.cmd).error(
            "-o/--option sets an option of the remote store: give --remote URL"
        )
    if getattr(args, "option", None):
        from .cli_remote import remote_options

        try:
            remote_options(args.option)
        except CheckpointError as e:
            parser.error(f"{args.cmd}: {e}")
    stdout, sys.stdout = sys.stdout, _PipeSafe(sys.stdout)
    try:
        from .catalog import blobs_read_once
        from .cli_scan import reading_said
        from .cli_torch_import import torch_import_guarded

        # a shared blob checked once; torch, imported only by a command that needs tensors
        # (export; inspect of a dcp.save checkpoint), cannot swallow a Ctrl-C
        with torch_import_guarded(), blobs_read_once(), reading_said(args.cmd):
            return int(args.fn(args))
    except CheckpointError as e:  # 2: an argument that cannot be right; 3: nothing to act on
        print(f"{PROG} {args.cmd}: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # from a stream other than stdout (see _PipeSafe)
        return 1
    except KeyboardInterrupt:  # what it was doing cleaned up on the way out
        print(f"\n{PROG} {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the remote store failed (unreachable, missing bucket, ...)
        from .cli_hints import hint as store_hint

        url = _remote_url(args)
        hint = store_hint(e, url) if url else ""
        said = " ".join(str(e).splitlines()) if url else e  # (gcsfs's 403: two lines)
        print(f"{PROG} {args.cmd}: {type(e).__name__}: {said}{hint}", file=sys.stderr)
        return 1
    except Exception as e:
        url = _remote_url(args)
        if not url or os.environ.get(DEBUG_ENV):
            raise  # a bug of ours (or asked for): its traceback
        from .cli_hints import hint as store_hint

        # the store's own errors (botocore's, an option its client rejects): one line
        hint = " (check the -o options)" if isinstance(e, TypeError) else store_hint(e, url)
        print(
            f"{PROG} {args.cmd}: the remote store failed: {type(e).__name__}: "
            f"{' '.join(str(e).splitlines())}{hint} "  # (azure-storage's: lines of fields)
            f"({DEBUG_ENV}=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        sys.stdout = stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
