"""The command the self-checking examples suggest for a look at their checkpoints
(``resilient-ckpt ls DIR``): one helper for ``demo_resume.py``, ``lightning_resume.py`` and
``transformers_resume.py``.

The command runs the code the example ran. That is the venv's ``resilient-ckpt`` where the venv
imports, of itself, the ``resilient_callbacks`` this process imported; otherwise
``PYTHONPATH=<its src> <python> -m resilient_callbacks``. The second is the case of a venv set up
by another checkout (``RESILIENT_VENV`` shared by two clones): ``scripts/this_checkout.sh`` put
this checkout's ``src`` first on ``PYTHONPATH`` for the example, and the venv's console script
runs the other checkout's code.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

# what the venv's python imports of itself (no PYTHONPATH), without importing it
_PROBE = (
    "import importlib.util as u; s = u.find_spec('resilient_callbacks'); "
    "print(s.origin if s is not None and s.origin else '')"
)


def cli_command(*args: str) -> str:
    """A shell command, to run from the current directory, that runs ``resilient-ckpt`` with
    ``args`` on the ``resilient_callbacks`` this process imported."""
    import resilient_callbacks

    here = os.path.dirname(os.path.realpath(resilient_callbacks.__file__))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = [sys.executable, "-c", _PROBE]
    r = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60, check=False)
    own = r.stdout.strip() if r.returncode == 0 else ""
    script = os.path.join(os.path.dirname(sys.executable), "resilient-ckpt")  # unactivated
    if own and os.path.dirname(os.path.realpath(own)) == here and os.path.isfile(script):
        cmd = [shlex.quote(os.path.relpath(script))]
    else:
        src = os.path.relpath(os.path.dirname(here))
        python = os.path.relpath(sys.executable)
        cmd = [f"PYTHONPATH={shlex.quote(src)}", shlex.quote(python), "-m", "resilient_callbacks"]
    return " ".join([*cmd, *map(shlex.quote, args)])
