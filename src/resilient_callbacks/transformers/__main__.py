"""``python -m resilient_callbacks.transformers export DIR OUT [--step N] [--force]``: write a
checkpoint written by ResilientCheckpoint as a Hugging Face ``from_pretrained`` directory."""

from __future__ import annotations

import argparse
import sys

from ..cli_export import add_export_arguments
from .export import cli_export


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilient_callbacks.transformers")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    p = sub.add_parser("export", help="write a checkpoint as a from_pretrained directory")
    add_export_arguments(p)
    args = ap.parse_args(argv)
    if args.cmd is None:  # argparse's own words were "required: cmd"
        ap.error(f"a command is required: {', '.join(sub.choices)} (`{ap.prog} COMMAND --help`)")
    return cli_export(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
