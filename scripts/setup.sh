#!/usr/bin/env bash
# Create .venv (Python 3.11) with torch and this package, at the exact versions of
# scripts/constraints.txt (pip never has to search for a working set).
#
#   bash scripts/setup.sh core   # what the demo needs: torch, safetensors, fsspec, xxhash, numpy, tqdm
#   bash scripts/setup.sh test   # + what the test suite needs (Lightning, Transformers, s3fs, moto, ...)
#   bash scripts/setup.sh dev    # + ruff, mypy, matplotlib (lint, type checks, benchmark plots)
#
# Idempotent: re-running it with nothing changed takes a second. Environment:
#   PYTHON                  the interpreter for .venv (default: python3.11, else python3)
#   RESILIENT_TORCH         the torch to install: a requirement or a wheel file (default torch==2.13.0)
#   RESILIENT_TORCH_INDEX   a package index URL for torch alone, e.g. PyTorch's CPU-only wheel index,
#                           so an ordinary Linux machine does not download the multi-GB CUDA build
#   RESILIENT_VENV          where to create the environment (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:-dev}"
case "$profile" in
    core | test | dev) ;;
    *) echo "usage: bash scripts/setup.sh [core|test|dev]" >&2; exit 2 ;;
esac
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV="${RESILIENT_VENV:-.venv}"
TORCH="${RESILIENT_TORCH:-torch==2.13.0}"
TORCH_INDEX="${RESILIENT_TORCH_INDEX:-}"
t0=$SECONDS

say() { echo "[setup $(( SECONDS - t0 ))s] $*" >&2; }

# pip's own lines that show progress (what it collects and downloads, what it installed);
# the rest (already satisfied, index warnings) is dropped. pip's exit status is kept.
# pip's whole output also goes to $VENV/.resilient-pip.log, read when pip fails.
pip_install() {
    local status log="$VENV/.resilient-pip.log"
    set +e
    "$VENV/bin/python" -m pip install --progress-bar off "$@" 2>&1 \
        | tee "$log" \
        | grep --line-buffered -E '^(Collecting|Downloading|Installing|Successfully|ERROR|error|  error)' \
        | sed -u 's/^/    /' >&2
    status=("${PIPESTATUS[@]}")
    set -e
    if [ "${status[0]}" -ne 0 ]; then
        if grep -q 'No space left on device' "$log" 2>/dev/null; then
            say "pip ran out of disk space: $(free_mb) MB are free now on the disk of $VENV_PARENT."
            if [ "$created" = 1 ]; then
                # a half-installed environment helps no one and holds the space the next try needs
                rm -rf "$VENV"
                say "removed the half-built $VENV; free some space (or set RESILIENT_VENV to a disk with room) and run this again"
            fi
        else
            say "pip failed (exit ${status[0]}); its whole output is in $log, or run it again:"
            say "  $VENV/bin/python -m pip install $*"
        fi
        return "${status[0]}"
    fi
}

# free space in MB on the disk that holds (or will hold) $VENV: that of the nearest folder
# above it that exists (df fails on one not made yet, and the check then read no number)
free_mb() {
    local d="$VENV_PARENT"
    while [ ! -d "$d" ]; do d="$(dirname "$d")"; done
    df -Pk "$d" | awk 'NR == 2 { print int($4 / 1024) }'
}

key="$(cat pyproject.toml setup.py scripts/setup.sh scripts/constraints.txt | sha1sum | cut -c1-12)"
key="$key-$(echo "$TORCH $TORCH_INDEX" | sha1sum | cut -c1-8)"
# a profile includes the ones before it: core < test < dev
done_core="$VENV/.resilient-setup-core-$key"
done_test="$VENV/.resilient-setup-test-$key"
done_dev="$VENV/.resilient-setup-dev-$key"
case "$profile" in
    core) satisfied="$done_core $done_test $done_dev" ;;
    test) satisfied="$done_test $done_dev" ;;
    dev) satisfied="$done_dev" ;;
esac
for mark in $satisfied; do
    if [ -f "$mark" ]; then exit 0; fi
done

VENV_PARENT="$(dirname "$VENV")"
# what each profile takes on disk, measured on Linux x86_64 with the CPU build of torch 2.13
# (torch alone is about 750 MB), with 200 MB to spare for pip's temporary files
case "$profile" in
    core) need_mb=1200 ;;
    test) need_mb=1900 ;;
    dev) need_mb=2000 ;;
esac
have_mb=0
if [ -d "$VENV" ]; then have_mb="$(du -sm "$VENV" | cut -f1)"; fi
more_mb=$(( need_mb - have_mb ))
if [ "$more_mb" -gt 0 ] && [ "$(free_mb)" -lt "$more_mb" ]; then
    say "not enough disk space: the $profile set-up needs about $need_mb MB in $VENV" \
        "(about $more_mb MB more than it holds now), and $(free_mb) MB are free on the disk of $VENV_PARENT."
    say "free some space, or set RESILIENT_VENV to a folder on a disk with room."
    exit 1
fi

created=0
if [ ! -x "$VENV/bin/python" ]; then
    created=1
    say "creating $VENV with $PY ($("$PY" --version 2>&1))"
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "[setup] $VENV uses Python $("$VENV/bin/python" --version 2>&1); 3.11 or newer is needed." \
        "Remove $VENV and set PYTHON to a Python 3.11 interpreter." >&2
    exit 1
fi

if "$VENV/bin/python" - "$TORCH" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
want = sys.argv[1]
# an exact pin that is already installed (a local "+cpu" build counts) needs nothing
ok = want.startswith("torch==") and version("torch").split("+")[0] == want.split("==")[1]
sys.exit(0 if ok else 1)
EOF
    say "[1/2] $TORCH is already installed"
else
    if [ -n "$TORCH_INDEX" ]; then
        say "[1/2] installing $TORCH from $TORCH_INDEX (about 200 MB for a CPU build; a minute)"
        pip_install "$TORCH" --index-url "$TORCH_INDEX" -c scripts/constraints.txt
    else
        say "[1/2] installing $TORCH (a CPU build where the machine provides one; a minute)"
        pip_install "$TORCH" -c scripts/constraints.txt
    fi
fi

# the torch just installed stays: a dependency that needs another one is an error, not a swap
# (a requirement such as torch>=2.9 would otherwise replace the RESILIENT_TORCH asked for)
"$VENV/bin/python" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' \
    > "$VENV/.resilient-torch-pin.txt"
pin=(-c scripts/constraints.txt -c "$VENV/.resilient-torch-pin.txt")
case "$profile" in
    core)
        say "[2/2] installing resilient-callbacks and its core dependencies (pinned)"
        pip_install "${pin[@]}" -e .
        marks="$done_core" ;;
    test)
        say "[2/2] installing resilient-callbacks[test]: Lightning, Transformers, s3fs, moto, pytest, ... (pinned; a minute or two)"
        pip_install "${pin[@]}" -e ".[test]"
        marks="$done_core $done_test" ;;
    dev)
        say "[2/2] installing resilient-callbacks[dev]: the test dependencies, ruff, mypy, matplotlib (pinned; a minute or two)"
        pip_install "${pin[@]}" -e ".[dev]"
        marks="$done_core $done_test $done_dev" ;;
esac
rm -f "$VENV"/.resilient-setup-*
# shellcheck disable=SC2086
touch $marks
say "done: $VENV is ready ($profile)"
