#!/usr/bin/env bash
# Set up, then run the test suite (slow and benchmark tests are deselected by default; pass
# `-m slow` or `-m benchmark` to run those).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
