"""A command a message hands the user works when pasted into a shell, whatever the path.

Hints such as "`resilient-ckpt verify DIR --all` reads them" named the path as it was, so a
directory with a space or a quote in its name gave a command the shell split into other
arguments, or could not parse. Each hint here is taken from a real message and run through a
real shell (``subprocess`` with ``shell=True``), ``resilient-ckpt`` the installed executable.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import torch

import resilient_callbacks
from resilient_callbacks import Checkpointer, ForeignCheckpointsWarning
from resilient_callbacks.redact import command, push_command
from test_cli import cli, flip_byte, make_run

ODD = "run's dir"  # a space and a quote


def _env() -> dict[str, str]:
    src = os.path.dirname(os.path.dirname(resilient_callbacks.__file__))
    return {
        **os.environ,
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }


def hints(text: str, sub: str) -> list[str]:
    """The backquoted ``resilient-ckpt SUB ...`` commands in ``text``."""
    return re.findall(rf"`(resilient-ckpt {sub}\b[^`]*)`", text)


def shell(cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=300, env=_env())


def test_each_word_of_a_command_is_one_argument_in_a_shell():
    words = ["verify", "/tmp/a b/it's here", "--all", "s3://bucket/x?y=1 2", "$HOME", "-o", "k=..."]
    cmd = command(*words)
    assert cmd.startswith("`resilient-ckpt verify ") and cmd.endswith("`")
    r = shell(cmd.strip("`").replace("resilient-ckpt", "printf '%s\\n'", 1))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == words
    assert push_command("/tmp/a b", "file:///x", {"key": 1}).startswith(
        "`resilient-ckpt push '/tmp/a b' file:///x -o key=...`"
    )


def test_ls_fast_hint_verifies_a_directory_with_a_space_and_a_quote(tmp_path):
    root = str(tmp_path / ODD)
    make_run(root)
    r = cli("ls", root, "--fast")
    assert r.returncode == 0, r.stderr
    (hint,) = hints(r.stdout, "verify")
    done = shell(hint)
    assert done.returncode == 0, (hint, done.stderr)
    assert "3 checkpoint(s) verified: every checksum matches" in done.stdout, done.stdout


def test_verify_hints_of_a_corrupt_newest_work_in_a_shell(tmp_path):
    root = str(tmp_path / ODD)
    make_run(root)
    flip_byte(os.path.join(root, "step_000000030", "shared.safetensors"))
    r = cli("verify", root)
    assert r.returncode == 1
    (inspect,) = hints(r.stderr, "inspect")
    (verify_all,) = hints(r.stderr, "verify")
    shown = shell(inspect)
    assert shown.returncode == 0 and "step_000000020" in shown.stdout + shown.stderr, shown
    checked = shell(verify_all)
    assert checked.returncode == 1 and "CORRUPT" in checked.stdout, checked  # (not usage, 2)
    assert "step_000000010" in checked.stdout


def test_the_other_runs_warning_names_a_gc_that_works_in_a_shell(tmp_path):
    root = str(tmp_path / ODD)
    make_run(root, steps=(10,))
    state = {"model": torch.nn.Linear(4, 3)}
    with Checkpointer(root, resume="never") as ck, warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ck.save(1, state)
    (msg,) = [str(w.message) for w in got if issubclass(w.category, ForeignCheckpointsWarning)]
    (gc,) = hints(msg, "gc")
    done = shell(gc + " --dry-run")
    assert done.returncode == 0, (gc, done.stderr)
    assert "step_000000010" in done.stdout, done.stdout


def test_pull_over_a_folder_without_manifest_names_a_gc_that_works_in_a_shell(tmp_path):
    """pull refuses to replace a ``step_<n>`` folder without a manifest, naming the gc that
    removes it: pasted into a shell, it does, and the pull then works."""
    src, dest = str(tmp_path / "src"), str(tmp_path / ODD)
    make_run(src, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", src, url).returncode == 0
    make_run(dest, steps=(5,))  # a checkpoint directory of ours, with a damaged folder:
    os.makedirs(os.path.join(dest, "step_000000010"))  # no manifest
    r = cli("pull", url, dest)
    assert r.returncode == 1, r.stderr
    (gc,) = hints(r.stderr, "gc")
    done = shell(gc)
    assert done.returncode == 0, (gc, done.stderr)
    assert cli("pull", url, dest).returncode == 0
    assert os.path.isfile(os.path.join(dest, "step_000000010", "manifest.json"))
