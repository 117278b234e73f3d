#!/usr/bin/env bash
# Create .venv (Python 3.11) with a CPU build of torch and this package with its dev extras.
# Idempotent: re-running it with nothing changed takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $PY" >&2
    "$PY" -m venv .venv
fi
stamp=".venv/.resilient-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    echo "[setup] installing torch==2.13.0 (CPU) and resilient-callbacks[dev] into .venv" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    # Pinned here (not in pyproject, which says torch>=2.4): an unpinned torch pulls CUDA wheels.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[dev]"
    rm -f .venv/.resilient-setup-*
    touch "$stamp"
fi
