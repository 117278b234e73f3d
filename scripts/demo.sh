#!/usr/bin/env bash
# Set up, then run the demo: a training run is killed with SIGKILL partway, re-run, and shown to
# continue exactly where it stopped. Everything it writes goes to ./demo_output/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo_resume.py "$@"
