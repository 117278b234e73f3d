"""What the remote commands say about the store they were given (a URL that holds nothing is
most often a typo), and that a store they cannot reach costs nothing local."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def test_gc_with_a_remote_it_cannot_list_deletes_nothing_locally(tmp_path):
    """``gc DIR --keep-last 1 --remote URL --json`` with an unreachable store deleted DIR's
    checkpoints first, then failed on the remote: exit 1, no JSON, and nothing said of what was
    deleted. The store is listed first now; nothing is deleted when it cannot be."""
    pytest.importorskip("s3fs")
    from test_cli import _unreachable_s3_options

    o = _unreachable_s3_options()
    root = tmp_path / "ck"
    make_run(str(root))
    before = sorted(os.listdir(root))
    r = cli("gc", str(root), "--keep-last", "1", "--json", "--remote", "s3://bucket/run", *o)
    assert r.returncode == 1 and "Could not connect" in r.stderr, r.stderr
    assert sorted(os.listdir(root)) == before


def _cli_process(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own: its stdout and stderr are its own. In this process
    (``test_cli.cli``) they are the process's ``sys.stdout``/``sys.stderr``, redirected for the
    call: whatever runs meanwhile in another thread (an uploader, a sink or a server an earlier
    test of the session left running, the logging of any of them) writes into them too."""
    return subprocess.run(
        [sys.executable, "-m", "resilient_callbacks", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_verify_url_json_with_nothing_to_check_prints_the_object(tmp_path):
    """``verify DIR --json`` with nothing to check prints ``"ok": false`` and no rows (exit 1);
    ``verify URL --json`` printed nothing on stdout, so a script's ``json.loads`` failed.
    The commands run in a process of their own (:func:`_cli_process`): run in the test's
    process, stdout failed once in a loaded full-suite run with json.loads's "Expecting value"
    (stdout empty or not starting with the JSON object) and passed again alone; stderr, which
    must start with the command's line, was as open to another thread's log lines."""
    import json

    root = str(tmp_path / "ck")
    make_run(root)
    url = f"file://{tmp_path}/remote"
    assert cli("push", root, url).returncode == 0
    for args, code in (  # 3: nothing to act on; 1: no such step; 2: a URL that is no store
        ((f"file://{tmp_path}/empty",), 3),
        ((url, "--step", "99"), 1),
        ((f"{url}/step_000000020",), 2),
    ):
        r = _cli_process("verify", *args, "--json")
        assert r.stdout.lstrip().startswith("{"), (args, r.returncode, r.stdout, r.stderr)
        out = json.loads(r.stdout)
        assert r.returncode == code and out["ok"] is False and out["checkpoints"] == [], out
        assert r.stderr.startswith("resilient-ckpt verify: "), r.stderr
    r = _cli_process("verify", url, "--json")
    assert r.stdout.lstrip().startswith("{"), (r.returncode, r.stdout, r.stderr)
    assert json.loads(r.stdout)["ok"] is True and r.returncode == 0, (r.stdout, r.stderr)


def test_a_store_that_holds_nothing_is_said_with_the_command_and_what_to_check(tmp_path):
    """``ls DIR --remote URL`` and ``report DIR --remote URL`` of a URL that holds nothing (a
    typo) said "resilient-ckpt: the remote URL holds no checkpoint": no command named, as
    every other line does, and nothing on what to check."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    typo = f"file://{tmp_path}/remotr"
    for command, extra in (("ls", ()), ("report", ("--json", str(tmp_path / "r.json")))):
        r = cli(command, root, "--remote", typo, *extra)
        assert r.returncode == 0, r.stderr
        said = [line for line in r.stderr.splitlines() if "holds no checkpoint" in line]
        assert said and said[0].startswith(f"resilient-ckpt {command}: the remote {typo}"), said
        assert "check the URL" in said[0], said


def test_gc_remote_keeps_the_checkpoints_a_killed_run_had_not_uploaded(tmp_path):
    """A run with a remote tier killed while its uploads were behind leaves newer checkpoints
    only in DIR; its restart uploads them. ``gc DIR --remote URL`` deleted them by the local
    ``keep_last`` (the trainer's own retention never deletes one waiting for its upload): the
    only copy of a checkpoint the remote retention would have kept. It keeps them now, saying
    why, and deletes them once the remote holds a newer checkpoint of the run."""
    import shutil

    import torch

    from resilient_callbacks import Checkpointer

    root, store = tmp_path / "ck", tmp_path / "remote"
    state = {"w": torch.zeros(4)}
    url = f"file://{store}"
    with Checkpointer(root, remote=url, keep_last=3, async_save=False) as ck:
        for step in (1, 2, 3):
            state["w"] += 1
            ck.save(step, state)
    for name in ("step_000000002", "step_000000003"):  # as if never uploaded
        shutil.rmtree(store / name)
    r = cli("gc", str(root), "--keep-last", "1", "--remote", url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (root / "step_000000002").is_dir(), r.stdout
    assert "keep step_000000002 (step 2, valid): not uploaded" in r.stdout, r.stdout
    assert "would delete" not in r.stdout and "deleted step_000000001" in r.stdout, r.stdout

    r = cli("push", str(root), url)  # the remote now holds step 3: step 2 may go
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("gc", str(root), "--keep-last", "1", "--remote", url)
    assert r.returncode == 0 and "deleted step_000000002" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000000003"]


def test_gc_without_remote_keeps_what_the_history_does_not_record_as_uploaded(tmp_path):
    """The same killed run, ``gc DIR`` without ``--remote``: the directory's history (the
    uploader's ``upload`` records) tells which checkpoints were uploaded. Those committed after
    the newest recorded upload are kept, saying why; they went by ``keep_last`` before."""
    import json

    import torch

    from resilient_callbacks import Checkpointer

    root = tmp_path / "ck"
    state = {"w": torch.zeros(4)}
    with Checkpointer(
        root, remote=f"file://{tmp_path}/remote", keep_last=4, async_save=False
    ) as ck:
        for step in (1, 2, 3, 4):
            state["w"] += 1
            ck.save(step, state)
    hist = root / "history.jsonl"
    lines = hist.read_text().splitlines(keepends=True)
    uploads = [json.loads(x) for x in lines if '"upload"' in x]
    assert [u["name"] for u in uploads] == [f"step_00000000{i}" for i in (1, 2, 3, 4)]
    # as if killed once step 1 was uploaded: no record of the others
    hist.write_text("".join(x for x in lines if '"upload"' not in x or '"step": 1,' in x))
    r = cli("gc", str(root), "--keep-last", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    for n in (2, 3):
        assert f"keep step_00000000{n} (step {n}, valid): not uploaded as far as the" in r.stdout
    assert "deleted step_000000001" in r.stdout, r.stdout
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_00000000{i}" for i in (2, 3, 4)]
    # how to delete them anyway, for a user who knows the store holds them (a history that
    # lost its records): it said only that `gc DIR --remote URL` checks the store
    said = [x for x in r.stderr.splitlines() if "kept step_000000002, step_000000003" in x]
    named = f"`resilient-ckpt gc {root} --remote URL --keep-last 1 --dry-run`"
    assert said and named in said[0] and f"`rm -r {root}/step_000000002`" in said[0], r.stderr
    url = f"file://{tmp_path}/remote"  # (it holds them: the command named deletes them)
    r = cli("gc", str(root), "--remote", url, "--keep-last", "1", "--dry-run")
    assert "would delete step_000000002" in r.stdout and "kept step_" not in r.stderr, r.stdout


def test_gc_without_remote_reads_an_upload_record_whose_lag_is_not_a_number(tmp_path):
    """An ``upload`` record with a ``lag_s`` that is no number (a foreign tool's line, bit rot)
    spoils only that record's commit time: gc took it with ``float`` and stopped with a
    ValueError. Its commit time is not known, so no checkpoint is taken as committed before
    it: those the history does not record as uploaded are kept (the record's own time, later
    than step 2's commit, would have let gc delete step 2, never uploaded)."""
    import json

    import torch

    from resilient_callbacks import Checkpointer

    root = tmp_path / "ck"
    with Checkpointer(
        root, remote=f"file://{tmp_path}/remote", keep_last=4, async_save=False
    ) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
    hist = root / "history.jsonl"
    lines = hist.read_text().splitlines(keepends=True)
    first = next(json.loads(x) for x in lines if '"upload"' in x and '"step": 1,' in x)
    first["lag_s"] = "soon"
    kept = [x for x in lines if '"upload"' not in x]  # killed once step 1 was uploaded
    hist.write_text("".join(kept) + json.dumps(first) + "\n")
    r = cli("gc", str(root), "--keep-last", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "keep step_000000002 (step 2, valid): not uploaded as far as the" in r.stdout, r.stdout
    assert "deleted step_000000001" in r.stdout, r.stdout
