"""``resilient-ckpt`` given one checkpoint (``DIR/step_<n>``, ``URL/step_<n>``) rather than
the run's directory or store: what it checks is that checkpoint, and options that name another
one are not silently dropped (a script reads the exit code)."""

from __future__ import annotations

import json
import os

from test_cli import cli, make_run


def test_verify_of_one_checkpoint_with_another_step_fails_instead_of_checking_this_one(tmp_path):
    """``verify DIR/step_000000020 --step 30`` verified step 20, printed "ok" and exited 0: a
    script asking whether step 30 is good was told yes about another checkpoint."""
    root = str(tmp_path / "ck")
    make_run(root)
    one = os.path.join(root, "step_000000020")
    r = cli("verify", one, "--step", "30")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ok" not in r.stdout and "step 20" in r.stderr and "--step 30" in r.stderr, r.stderr
    assert root in r.stderr, r.stderr  # where to point it instead
    r = cli("verify", one, "--step", "30", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["ok"] is False and out["checkpoints"] == [], out
    r = cli("verify", one, "--step", "20", "--json")  # the step it is: checked as before
    out = json.loads(r.stdout)
    assert r.returncode == 0 and [c["step"] for c in out["checkpoints"]] == [20], out


def test_a_url_of_one_remote_checkpoint_names_its_store_and_push_writes_nothing_into_it(tmp_path):
    """``verify URL/step_000000020`` (the URL ``verify URL`` prints per checkpoint) said "no
    checkpoints in URL/step_000000020", and ``push DIR URL/step_000000020`` uploaded every
    checkpoint into that checkpoint's folder, exit 0. Each now names the store to give."""
    root = str(tmp_path / "ck")
    make_run(root)
    url = f"file://{tmp_path}/remote"
    assert cli("push", root, url).returncode == 0
    one = f"{url}/step_000000020"
    before = sorted(os.listdir(tmp_path / "remote" / "step_000000020"))
    for args in (
        ("verify", one),
        ("pull", one, str(tmp_path / "pulled")),
        ("push", root, one),
        ("ls", root, "--remote", one),
        ("gc", root, "--remote", one, "--keep-last", "1"),
    ):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)  # a usage error
        assert f"is one checkpoint (step 20) of the remote store {url}" in r.stderr, r.stderr
        assert "no checkpoints" not in r.stderr, r.stderr
    assert "--step 20" in cli("verify", one).stderr
    assert sorted(os.listdir(tmp_path / "remote" / "step_000000020")) == before
    assert not (tmp_path / "pulled").exists()
    # gc named the URL before it deleted anything locally
    assert [row["step"] for row in json.loads(cli("ls", root, "--json").stdout)] == [10, 20, 30]


def test_inspect_and_export_of_one_checkpoint_with_another_step_do_not_deny_the_run_has_it(
    tmp_path,
):
    """``inspect DIR/step_000000020 --step 30`` said "no checkpoint of step 30 in DIR (its
    steps: 20)", of a DIR holding steps 10, 20 and 30; ``export`` the same. Each now says the
    path given is one checkpoint of another step, and which directory to give."""
    root = str(tmp_path / "ck")
    make_run(root)
    one = os.path.join(root, "step_000000020")
    for args in (
        ("inspect", one, "--step", "30"),
        ("export", one, str(tmp_path / "out"), "--step", "30"),
    ):
        r = cli(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "no checkpoint of step 30" not in r.stderr, r.stderr
        assert f"{one} is one checkpoint, of step 20, not of step 30" in r.stderr, r.stderr
        assert f"give the run's directory {root} with --step 30" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    assert cli("inspect", one, "--step", "20").returncode == 0


def test_pull_into_one_checkpoint_a_file_or_a_url_is_refused_writing_nothing(tmp_path, monkeypatch):
    """``pull URL DIR/step_000000020`` nested the pulled checkpoint (and a lock file) inside a
    committed checkpoint's folder, exit 0; ``pull URL s3://...`` made a local folder "s3:" and
    printed "-> s3://.../step_000000030" as if it had gone there; ``pull URL FILE`` was a bare
    "FileExistsError". Each is refused now, naming what to give."""
    root = tmp_path / "ck"
    make_run(str(root))
    url = f"file://{tmp_path}/remote"
    assert cli("push", str(root), url).returncode == 0
    one = root / "step_000000020"
    before = sorted(os.listdir(one))
    r = cli("pull", url, str(one), "--step", "10")
    assert r.returncode == 2 and "is one checkpoint, not a directory" in r.stderr, r.stderr
    assert sorted(os.listdir(one)) == before
    (tmp_path / "afile").write_text("x")
    r = cli("pull", url, str(tmp_path / "afile"))
    assert r.returncode == 2 and "not a directory" in r.stderr, r.stderr
    monkeypatch.chdir(tmp_path)
    r = cli("pull", url, "s3://bucket/run1")
    assert r.returncode == 2 and "pull downloads into a local directory" in r.stderr, r.stderr
    assert not (tmp_path / "s3:").exists()


def test_export_to_a_url_and_push_into_the_directory_itself_are_refused(tmp_path, monkeypatch):
    """``export DIR s3://b/model`` wrote a local folder named "s3:" (exit 0); ``push DIR DIR``
    (or a store inside DIR) said every checkpoint was "already in" it, exit 0: a second copy
    that is the first."""
    root = tmp_path / "ck"
    make_run(str(root))
    monkeypatch.chdir(tmp_path)
    r = cli("export", str(root), "s3://bucket/model")
    assert r.returncode == 2 and "is a URL: an export is written to a local" in r.stderr, r.stderr
    assert not (tmp_path / "s3:").exists()
    before = sorted(os.listdir(root))
    for url in (str(root), f"file://{root}", f"file://{root}/backup"):
        r = cli("push", str(root), url)
        assert r.returncode == 2 and "already in" not in r.stdout, r.stdout + r.stderr
        assert "itself, or lies in it: no second copy" in r.stderr, r.stderr
    assert sorted(os.listdir(root)) == before
    assert cli("push", str(root), str(tmp_path / "elsewhere")).returncode == 0


def test_ls_gc_and_report_refuse_the_directory_itself_as_its_remote_store(tmp_path):
    """``ls DIR --remote DIR`` called every checkpoint "both" (a second copy there is none);
    ``gc DIR --remote DIR`` planned the same deletions twice, and in one node's directory of a
    node-local run would take the node's own parts for copies the remote holds committed."""
    root = tmp_path / "ck"
    make_run(str(root), keep_last=None)
    before = sorted(os.listdir(root))
    for args in (
        ("ls", str(root), "--remote", str(root)),
        ("ls", str(root), "--remote", f"file://{root}/", "--json"),
        ("gc", str(root), "--remote", str(root), "--keep-last", "1"),
        ("report", str(root), "--json", "-", "--remote", str(root)),
    ):
        r = cli(*args)
        assert r.returncode == 2 and '"both"' not in r.stdout, (args, r.stdout, r.stderr)
        assert "itself, or lies in it: no second copy" in r.stderr, r.stderr
    assert sorted(os.listdir(root)) == before
