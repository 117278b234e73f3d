"""``python -m resilient_callbacks.deepspeed.run SCRIPT [ARGS...]``: run SCRIPT as ``__main__``
with ``deepspeed.initialize`` made resilient (see :mod:`.launch`). Works as
``deepspeed --module resilient_callbacks.deepspeed.run SCRIPT ...`` and under ``torchrun``."""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        print(f"resilient_callbacks.deepspeed.run: no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    from .launch import patch

    patch()
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
