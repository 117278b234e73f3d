"""``resilient-ckpt pull URL DIR`` into a directory that holds another run's checkpoints, and
``push DIR URL`` into a store that does: the copy is made (it was asked for), and the command
says that the two runs are now mixed, which one a resume tries first, and how to keep them
apart."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

from test_cli import cli, make_run


def test_pull_into_another_runs_directory_says_it_now_holds_two_runs(tmp_path):
    """The pull printed only "pulled ...", exit 0: the directory now held two runs' checkpoints
    and a resume there took whichever was committed last, with nothing said until then."""
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    make_run(mine)
    make_run(theirs, steps=(40, 50, 60, 70))
    url = f"file://{tmp_path}/remote"
    assert cli("push", theirs, url).returncode == 0
    runs = {row["run_id"] for row in json.loads(cli("ls", mine, "--json").stdout)}
    r = cli("pull", url, mine)
    assert r.returncode == 0 and "pulled" in r.stdout, r.stdout + r.stderr
    (other,) = runs
    assert f"{mine} also holds checkpoints of another run ({other})" in r.stderr, r.stderr
    assert "step_000000070" in r.stderr and "pull into an empty directory" in r.stderr, r.stderr
    # into an empty directory, or one of the same run: nothing to say
    assert cli("pull", url, str(tmp_path / "empty")).stderr == ""
    assert cli("pull", url, str(tmp_path / "empty"), "--step", "50").stderr == ""


def test_push_into_a_store_holding_another_run_says_so(tmp_path):
    """``push DIR URL`` into a store of another run uploaded beside it (``step_<n>-r1`` where
    the names clash) and said nothing of the two runs the store now mixes."""
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    make_run(mine)
    make_run(theirs)
    url = f"file://{tmp_path}/remote"
    assert cli("push", theirs, url).returncode == 0
    (other,) = {row["run_id"] for row in json.loads(cli("ls", theirs, "--json").stdout)}
    r = cli("push", mine, url)
    assert r.returncode == 0 and "pushed" in r.stdout, r.stdout + r.stderr
    assert f"{url} holds checkpoints of another run ({other})" in r.stderr, r.stderr
    assert "give each run its own URL" in r.stderr, r.stderr
    assert cli("push", theirs, f"file://{tmp_path}/remote2").stderr == ""


def _run_the_hint(stderr: str) -> None:
    """Run the one command in backquotes that ``stderr`` gives to clear the way."""
    (hint,) = re.findall(r"`([^`]+)`(?: does)?\)?,? or pull into an empty directory", stderr)
    words = shlex.split(hint)
    if words[0] == "resilient-ckpt":
        r = cli(*words[1:])
        assert r.returncode == 0, r.stdout + r.stderr
    else:
        subprocess.run(words, check=True, timeout=120)


def test_the_pull_refusing_a_folder_without_manifest_names_a_command_that_removes_it(tmp_path):
    """``pull URL DIR`` where ``DIR/step_<n>`` has no manifest said "Remove it (`resilient-ckpt
    gc DIR` does)"; where nothing else in DIR shows it is ours, gc leaves the folder alone (exit
    0) and the pull was refused again. The command the refusal names now removes it, in both
    cases: gc in a directory of ours, by hand in one that is not."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    url = f"file://{tmp_path}/remote"
    assert cli("push", root, url).returncode == 0
    for ours in (False, True):
        dst = tmp_path / f"dst-{ours}"
        if ours:  # a committed checkpoint there: a directory of ours
            assert cli("pull", url, str(dst), "--step", "10").returncode == 0
        (dst / "step_000000020").mkdir(parents=True)
        (dst / "step_000000020" / "model.safetensors").write_text("a torn copy")
        r = cli("pull", url, str(dst))
        assert r.returncode == 1 and "is not a committed checkpoint" in r.stderr, r.stderr
        _run_the_hint(r.stderr)
        r = cli("pull", url, str(dst))
        assert r.returncode == 0 and "pulled" in r.stdout, r.stdout + r.stderr
