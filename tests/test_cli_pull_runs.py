"""``resilient-ckpt pull URL DIR`` into a directory that holds another run's checkpoints, and
``push DIR URL`` into a store that does: the copy is made (it was asked for), and the command
says that the two runs are now mixed, which one a resume tries first, and how to keep them
apart."""

from __future__ import annotations

import json

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
