"""``python -m resilient_callbacks.transformers export DIR OUT [--step N] [--force] ...``: the
same command as ``resilient-ckpt export`` (a Trainer run's checkpoint as a Hugging Face
``from_pretrained`` directory; any other run's model as consolidated safetensors)."""

from __future__ import annotations

import argparse
import sys

from ..cli_export import add_export_arguments


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m resilient_callbacks.transformers")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a from_pretrained directory (as `resilient-ckpt export`)",
    )
    add_export_arguments(p)
    args = ap.parse_args(argv)
    if args.cmd is None:  # argparse's own words were "required: cmd"
        ap.error(f"a command is required: {', '.join(sub.choices)} (`{ap.prog} COMMAND --help`)")
    # resilient-ckpt's export, whose options this parser shows: it ran the Transformers
    # exporter alone, which dropped --key and refused every other kind of checkpoint
    from ..cli import main as cli_main

    return cli_main(["export", *argv[argv.index("export") + 1 :]])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
