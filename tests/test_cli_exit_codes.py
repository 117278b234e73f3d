"""``resilient-ckpt``'s exit codes, one rule for every command (docs/cli.md, "Exit codes"):
0 success, 1 the command ran and failed, 2 a command line that cannot be right (also a DIR
that does not exist, a URL where a local directory belongs), 3 nothing to act on (DIR or the
store holds no checkpoint at all).

Before, a URL where a directory belongs (``pull``/``push`` swapped, ``export DIR s3://...``,
``report --output s3://...``), a DIR that does not exist and an empty DIR or store all exited 1,
as a corrupt checkpoint or an unreachable store did: a job script could not tell "no checkpoint
yet, start fresh" from "the store failed, do not start over"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import cli, flip_byte, make_run

EXE = os.path.join(os.path.dirname(sys.executable), "resilient-ckpt")


def _cases(tmp: Path) -> list[tuple[list[str], int, str]]:
    """``(arguments, exit code, words on stderr)`` over a run with a valid and a corrupt
    checkpoint, an empty directory and an empty local store."""
    good, bad, empty = str(tmp / "good"), str(tmp / "bad"), str(tmp / "empty")
    os.makedirs(empty, exist_ok=True)
    store = f"file://{tmp / 'store'}"  # never written: a store holding nothing
    nothing, out = str(tmp / "nothing"), str(tmp / "out")
    return [
        # 0: success, also listing nothing
        (["ls", good], 0, ""),
        (["verify", good], 0, ""),
        (["ls", empty], 0, ""),
        (["gc", empty, "--dry-run"], 0, ""),
        # 1: ran and failed
        (["verify", bad], 1, "failed verification"),
        (["inspect", bad, "--step", "20"], 1, ""),  # (CORRUPT said on stdout)
        (["verify", good, "--step", "99"], 1, "no checkpoint of step 99"),
        # 2: usage
        (["verify"], 2, "the following arguments are required: DIR"),
        (["ls", nothing], 2, "no such directory"),
        (["verify", nothing], 2, "no such directory"),
        (["push", good + "/step_000000010", store], 2, "is one checkpoint"),
        (["pull", good, store], 2, "pull takes the store's URL first"),
        (["push", store, good], 2, "push takes the local directory first"),
        (["pull", store, "s3://bucket/run1"], 2, "pull downloads into a local directory"),
        (["ls", "s3://bucket/run1"], 2, "is a remote store's URL"),
        (["export", good, "s3://bucket/model"], 2, "is a URL: an export is written"),
        (["report", good, "--output", "s3://bucket/r.html"], 2, "is a URL: the report"),
        (["verify", good, "-o", "anon=true"], 2, "DIR is local here"),
        (["push", good, f"file://{good}"], 2, "no second copy"),
        # a URL scheme fsspec does not know (a typo), on every command that takes a URL: usage
        *[
            (args, 2, "'s4://' is no scheme fsspec knows (did you mean s3://?)")
            for args in (
                ["verify", "s4://bucket/run1"],
                ["ls", good, "--remote", "s4://bucket/run1"],
                ["gc", good, "--remote", "s4://bucket/run1", "--dry-run"],
                ["pull", "s4://bucket/run1", str(tmp / "pulled")],
                ["push", good, "simplecache::s4://bucket/run1"],
                ["report", good, "--remote", "s4://bucket/run1", "--json"],
            )
        ],
        # 3: nothing to act on
        (["verify", empty], 3, "no checkpoints in"),
        (["inspect", empty], 3, "no checkpoints in"),
        (["export", empty, out], 3, "no checkpoints in"),
        (["push", empty, store], 3, "no checkpoints to push in"),
        (["pull", store, str(tmp / "pulled")], 3, "no checkpoints in"),
        (["verify", store], 3, "no checkpoints in"),
        (["report", empty], 3, "has no history.jsonl"),
        (
            ["report", good, "--run", "nope", "--json"],
            3,
            "no run 'nope' in history.jsonl; its runs",
        ),
    ]


def _make(tmp: Path) -> None:
    make_run(str(tmp / "good"), steps=(10,))
    make_run(str(tmp / "bad"), steps=(10, 20))
    flip_byte(
        next(
            str(p) for p in (tmp / "bad" / "step_000000020").iterdir() if p.name != "manifest.json"
        )
    )


def test_every_command_follows_the_rule(tmp_path):
    _make(tmp_path)
    for args, code, said in _cases(tmp_path):
        r = cli(*args)
        assert r.returncode == code, (args, r.returncode, r.stderr)
        assert said in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr, (args, r.stderr)
    assert not os.path.exists(tmp_path / "store")  # nothing written by a refused command
    assert not os.path.exists(tmp_path / "pulled") and not os.path.exists(tmp_path / "out")


def test_verify_json_of_nothing_still_prints_its_object_and_exits_3(tmp_path):
    os.makedirs(tmp_path / "empty")
    for where in (str(tmp_path / "empty"), f"file://{tmp_path / 'store'}"):
        r = cli("verify", where, "--json")
        assert r.returncode == 3, r.stderr
        assert json.loads(r.stdout)["ok"] is False and json.loads(r.stdout)["verified"] == 0


def test_the_real_executable_exits_0_1_2_3(tmp_path):
    """The console script itself (none of these imports torch: quick)."""
    _make(tmp_path)
    os.makedirs(tmp_path / "empty")
    for args, code in (
        (["verify", str(tmp_path / "good")], 0),
        (["verify", str(tmp_path / "bad")], 1),
        (["pull", str(tmp_path / "good"), f"file://{tmp_path / 'store'}"], 2),
        (["verify", str(tmp_path / "empty")], 3),
    ):
        r = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == code, (args, r.stderr)


@pytest.mark.slow
def test_every_code_through_the_module_entry_point(tmp_path):
    """The whole table through ``python -m resilient_callbacks`` (a process per case: slow)."""
    _make(tmp_path)
    for args, code, said in _cases(tmp_path):
        r = subprocess.run(
            [sys.executable, "-m", "resilient_callbacks", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == code, (args, r.returncode, r.stderr)
        assert said in r.stderr, (args, r.stderr)
