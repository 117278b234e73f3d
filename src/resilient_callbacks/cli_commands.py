"""The runner of each ``resilient-ckpt`` command, as :mod:`.cli_parser` binds it: each imports
its command's module only when it runs (``cli_ls``: ls; ``cli_local``: gc; ``cli_verify``;
``cli_inspect``; ``cli_remote``: pull, push; ``cli_remote_verify``: verify URL; ``cli_report``),
so a command starts without the others' imports. ``export``'s is :func:`.cli_export.cmd_export`.
"""

from __future__ import annotations

import argparse

from .errors import CheckpointError, usage


def cmd_ls(args: argparse.Namespace) -> int:
    from .cli_ls import ls

    return ls(args)


def cmd_verify(args: argparse.Namespace) -> int:
    from .cli_scan import is_url

    if is_url(args.dir):
        from .cli_remote_verify import verify as verify_remote

        return verify_remote(args)
    if args.option:
        raise usage(
            CheckpointError("-o/--option sets an option of a remote store: DIR is local here")
        )
    from .cli_verify import verify

    return verify(args)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .cli_inspect import inspect

    return inspect(args)


def cmd_gc(args: argparse.Namespace) -> int:
    from .cli_local import gc

    return gc(args)


def cmd_pull(args: argparse.Namespace) -> int:
    from .cli_remote import pull

    return pull(args)


def cmd_push(args: argparse.Namespace) -> int:
    from .cli_remote import push

    return push(args)


def cmd_report(args: argparse.Namespace) -> int:
    from .cli_report import report

    return report(args)
