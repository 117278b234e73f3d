#!/usr/bin/env bash
# Set up everything the tests need, then run the test suite. Slow, benchmark and GPU tests are
# deselected by default; pass `-m slow`, `-m benchmark` or `-m gpu` to run those.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
venv="${RESILIENT_VENV:-.venv}"
source scripts/this_checkout.sh
exec "$venv/bin/python" -m pytest "$@"
