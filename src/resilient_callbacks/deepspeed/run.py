"""``python -m resilient_callbacks.deepspeed.run SCRIPT [ARGS...]``: run SCRIPT as ``__main__``
with ``deepspeed.initialize`` made resilient (see :mod:`.launch`). Works as
``deepspeed --module resilient_callbacks.deepspeed.run SCRIPT ...`` and under ``torchrun``.

The ``deepspeed`` launcher puts ``--local_rank=N`` before the module's arguments, that is before
SCRIPT: it is handed to SCRIPT first among its arguments, as ``deepspeed SCRIPT ...`` would."""

from __future__ import annotations

import os
import runpy
import sys


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """SCRIPT and the arguments it sees: any ``--local_rank=N`` / ``--local_rank N`` the
    ``deepspeed`` launcher put before SCRIPT moves after it. Raises SystemExit(2) when there
    is no SCRIPT."""
    moved: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("--local_rank"):
        if argv[i] == "--local_rank" and i + 1 < len(argv):
            moved += argv[i : i + 2]
            i += 2
        else:
            moved.append(argv[i])
            i += 1
    if i >= len(argv):
        print(__doc__.strip(), file=sys.stderr)
        raise SystemExit(2)
    return argv[i], [argv[i], *moved, *argv[i + 1 :]]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0)
    script, script_argv = split_argv(argv)
    if not os.path.isfile(script):
        print(f"resilient_callbacks.deepspeed.run: no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    from .launch import patch

    patch()
    sys.argv = script_argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
