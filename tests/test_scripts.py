"""The README's commands (scripts/test.sh, scripts/demo.sh) run this checkout's code."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_key(root: Path) -> str:
    """setup.sh's key: what it finds ready (its marker files) it does not install again."""
    files = ("pyproject.toml", "setup.py", "scripts/setup.sh", "scripts/constraints.txt")
    key = hashlib.sha1(b"".join((root / f).read_bytes() for f in files)).hexdigest()[:12]
    torch = os.environ.get("RESILIENT_TORCH", "torch==2.13.0")
    index = os.environ.get("RESILIENT_TORCH_INDEX", "")
    line = f"{torch} {index}\n"  # setup.sh: echo "$TORCH $TORCH_INDEX" | sha1sum
    return f"{key}-{hashlib.sha1(line.encode()).hexdigest()[:8]}"


def test_test_sh_with_another_checkouts_venv_tests_this_checkout(tmp_path):
    """`RESILIENT_VENV=<a venv set up by another clone> bash scripts/test.sh` (two clones or
    git worktrees sharing one environment): setup.sh finds it ready and installs nothing, and
    the tests imported the other clone's package (pip install -e there), so they tested code
    that is not this checkout's, silently (found 2026-12-06 by a first-contact walk). The
    scripts now put this checkout's src/ first and say so."""
    venv = Path(sys.prefix)
    if not (venv / f".resilient-setup-test-{_setup_key(ROOT)}").exists():
        pytest.skip("this environment was not made by scripts/setup.sh (test or dev)")
    copy = tmp_path / "clone"
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    for f in ("pyproject.toml", "setup.py"):
        shutil.copy(ROOT / f, copy / f)
    (copy / "src" / "resilient_callbacks").mkdir(parents=True)
    (copy / "src" / "resilient_callbacks" / "__init__.py").write_text('WHERE = "the clone"\n')
    (copy / "tests").mkdir()
    (copy / "tests" / "test_where.py").write_text(
        "import resilient_callbacks\n\n\ndef test_where():\n"
        '    assert getattr(resilient_callbacks, "WHERE", None) == "the clone"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RESILIENT_VENV"] = str(venv)
    r = subprocess.run(
        ["bash", "scripts/test.sh", "-q", "-p", "no:cacheprovider", "tests/test_where.py"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "another checkout" in r.stderr and str(copy / "src") in r.stderr


def test_a_venv_that_cannot_import_the_package_runs_this_checkout(tmp_path):
    """A shared RESILIENT_VENV whose editable install points at a clone since deleted (or one
    that never installed the package) imports no resilient_callbacks: the scripts put this
    checkout's src/ first only when the venv imported another checkout's, so the demo and the
    tests failed with ModuleNotFoundError beside this checkout's own src/. Paths with spaces."""
    copy = tmp_path / "a clone"
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    (copy / "src" / "resilient_callbacks").mkdir(parents=True)
    (copy / "src" / "resilient_callbacks" / "__init__.py").write_text('WHERE = "the clone"\n')
    bare = tmp_path / "a venv" / "bin"  # its Python sees no site-packages: no package there
    bare.mkdir(parents=True)
    (bare / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    (bare / "python").chmod(0o755)
    script = (
        'set -euo pipefail; venv="$1"; source scripts/this_checkout.sh; '
        'exec "$venv/bin/python" -c "import resilient_callbacks as m; print(m.WHERE)"'
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        ["bash", "-c", script, "bash", str(bare.parent)],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "the clone", r.stdout + r.stderr


def _fake_df(tmp_path: Path, free_kb: int) -> dict[str, str]:
    """An environment whose `df` reports `free_kb` free (a full disk, as a CI machine had on
    2026-12-06), the rest of PATH unchanged."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    df = bin_dir / "df"
    df.write_text(
        "#!/bin/sh\n"
        "for last; do :; done\n"  # (as df: a path that does not exist is an error)
        'if [ ! -e "$last" ]; then echo "df: $last: No such file or directory" >&2; exit 1; fi\n'
        'echo "Filesystem 1024-blocks Used Available Capacity Mounted on"\n'
        f'echo "/dev/fake 1000000 900000 {free_kb} 90% /"\n'
    )
    df.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def _python_stops_here(tmp_path: Path, env: dict[str, str]) -> Path:
    """A stand-in interpreter for setup.sh (``PYTHON`` in ``env``): it says it is 3.11 and
    fails to create the environment (exit 3), so nothing is installed."""
    python = tmp_path / "fake-bin" / "python-stops-here"
    python.write_text(
        '#!/bin/sh\nif [ "$1" = "--version" ]; then echo "Python 3.11.0"; exit 0; fi\nexit 3\n'
    )
    python.chmod(0o755)
    env["PYTHON"] = str(python)
    return python


def _setup_test(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``bash scripts/setup.sh test`` in ``env``."""
    argv = ["bash", str(ROOT / "scripts" / "setup.sh"), "test"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_setup_refuses_a_disk_without_room_before_installing_anything(tmp_path):
    """CI's set-up ran out of disk space halfway through installing torch (pip's OSError, errno
    28) and left a half-built .venv. setup.sh now checks the free space first: too little, it
    says how much it needs and how much is free, and creates nothing."""
    env = _fake_df(tmp_path, free_kb=300 * 1024)
    env["RESILIENT_VENV"] = str(tmp_path / "venv")
    r = _setup_test(env)
    assert r.returncode == 1, r.stderr
    assert "not enough disk space: the test set-up needs about 1900 MB" in r.stderr
    assert "300 MB are free" in r.stderr and "RESILIENT_VENV" in r.stderr
    assert not (tmp_path / "venv").exists()


def test_setup_of_a_ready_environment_needs_no_room(tmp_path):
    """An environment already set up for this key needs no room at all: setup.sh returns
    before the disk check (the check's side with room: the test after this one)."""
    venv = Path(sys.prefix)
    if not (venv / f".resilient-setup-test-{_setup_key(ROOT)}").exists():
        pytest.skip("this environment was not made by scripts/setup.sh (test or dev)")
    env = _fake_df(tmp_path, free_kb=0)
    env["RESILIENT_VENV"] = str(venv)
    r = _setup_test(env)
    assert r.returncode == 0 and "disk space" not in r.stderr, r.stderr


def test_setup_with_room_goes_past_the_disk_check(tmp_path):
    """The check's other side: with room (a disk with 100 GB free) it says nothing and setup.sh
    goes on to create the environment, here with an interpreter that stops it there (nothing
    is installed)."""
    env = _fake_df(tmp_path, free_kb=100 * 1024 * 1024)
    env["RESILIENT_VENV"] = str(tmp_path / "venv")
    python = _python_stops_here(tmp_path, env)
    r = _setup_test(env)
    assert r.returncode == 3, r.stderr  # (the stand-in interpreter's "-m venv")
    assert "disk space" not in r.stderr, r.stderr
    assert f"creating {tmp_path / 'venv'} with {python} (Python 3.11.0)" in r.stderr, r.stderr


def test_setup_checks_the_disk_of_a_venv_folder_not_made_yet(tmp_path):
    """RESILIENT_VENV in folders that do not exist yet (setup.sh makes them): `df` of that
    parent failed, the check read no number ("integer expression expected") and went on, on a
    disk without room. Now it asks about the nearest folder that exists."""
    env = _fake_df(tmp_path, free_kb=300 * 1024)
    env["RESILIENT_VENV"] = str(tmp_path / "not" / "made" / "venv")
    _python_stops_here(tmp_path, env)
    r = _setup_test(env)
    assert r.returncode == 1, r.stderr
    assert "not enough disk space: the test set-up needs about 1900 MB" in r.stderr, r.stderr
    assert "integer expression" not in r.stderr, r.stderr
    assert not (tmp_path / "not").exists()
