#!/usr/bin/env bash
# Set up what the demo needs (the core: torch and five small packages), then run it: a training
# run is killed with SIGKILL partway, re-run, and shown to continue exactly where it stopped.
# Everything it writes goes to ./demo_output/ (under the current directory).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bash "$here/scripts/setup.sh" core
venv="${RESILIENT_VENV:-.venv}"
[[ $venv == /* ]] || venv="$here/$venv" # setup.sh makes a relative one in the repository root
source "$here/scripts/this_checkout.sh"
exec "$venv/bin/python" "$here/examples/demo_resume.py" "$@"
