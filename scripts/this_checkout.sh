# Sourced by demo.sh and test.sh after setup.sh, with $venv set: make the run use this
# checkout's src/. A .venv set up by another checkout (RESILIENT_VENV shared by two clones or
# git worktrees) has that checkout's package installed (pip install -e), and setup.sh, finding
# the environment ready, installs nothing: without this the demo ran, and the tests tested,
# the other checkout's code, silently.
here_pkg="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/src/resilient_callbacks"
there_pkg="$("$venv/bin/python" -c 'import os, resilient_callbacks as m; print(os.path.dirname(os.path.realpath(m.__file__)))' 2>/dev/null || true)"
# (one that imports none, its editable install's clone deleted say, gets this checkout's too)
if [[ $there_pkg != "$(realpath "$here_pkg")" ]]; then
    there="from $there_pkg, another checkout"
    [[ -n $there_pkg ]] || there="from nowhere (it cannot import it)"
    echo "[resilient] $venv imports resilient_callbacks $there;" \
        "using this checkout's $(dirname "$here_pkg") instead (PYTHONPATH)" >&2
    export PYTHONPATH="$(dirname "$here_pkg")${PYTHONPATH:+:$PYTHONPATH}"
fi
