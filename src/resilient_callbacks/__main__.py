"""``python -m resilient_callbacks``: the ``resilient-ckpt`` command line (see docs/cli.md)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
