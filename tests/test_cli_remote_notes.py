"""What the remote commands say on stderr about the store they were given (a URL that holds
nothing is most often a typo)."""

from __future__ import annotations

from test_cli import cli, make_run


def test_gc_remote_of_a_mistyped_url_says_the_store_holds_no_checkpoint(tmp_path):
    """``gc DIR --remote URL`` with a URL that holds nothing (a typo) printed "URL: 0 deleted,
    0 kept", exit 0, as if it had cleaned the store; ``ls --remote`` says the store is empty."""
    root = str(tmp_path / "ck")
    make_run(root)
    typo = f"file://{tmp_path}/remotr"
    for extra in ((), ("--json",)):
        r = cli("gc", root, "--dry-run", "--remote", typo, *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"the remote {typo} holds no checkpoint" in r.stderr, r.stderr
    url = f"file://{tmp_path}/remote"
    assert cli("push", root, url).returncode == 0
    assert "holds no checkpoint" not in cli("gc", root, "--dry-run", "--remote", url).stderr
