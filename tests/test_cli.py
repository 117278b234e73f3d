"""The resilient-ckpt CLI, run as a user would: a real subprocess on real checkpoints."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import resilient_callbacks
from resilient_callbacks import Checkpointer
from resilient_callbacks.cli import main
from resilient_callbacks.cli_parser import build_parser, package_version

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in-process (fast); one test below runs the real executable."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse usage errors
            code = int(e.code or 0)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_real_executable_and_module_entry_points(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    exe = os.path.join(os.path.dirname(sys.executable), "resilient-ckpt")
    for cmd in ([exe], [sys.executable, "-m", "resilient_callbacks"]):
        r = subprocess.run(
            [*cmd, "ls", root, "--json"], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
        assert [row["step"] for row in json.loads(r.stdout)] == [10, 20, 30]


def make_run(root: str, steps=(10, 20, 30), **kw) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = {"model": model, "extra": {"epoch": 1, "name": "run"}}
    with Checkpointer(root, **kw) as ck:
        for s in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(s, state, metrics={"loss": 1.0 / s})
    return state


def flip_byte(path: str, offset: int = -5) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_ls_json_lists_steps_status_and_reasons(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, keep_last=2)
    r = cli("ls", root, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["step"] for row in rows] == [20, 30]
    assert all(row["status"] == "valid" and row["checked"] == "checksums" for row in rows)
    assert rows[-1]["kept"] is True and "newest" in rows[-1]["kept_by"]
    assert "last 2" in rows[0]["kept_by"]
    # typed values: numbers as numbers, ISO-8601 times with a zone
    assert isinstance(rows[0]["bytes"], int) and isinstance(rows[0]["seq"], int)
    assert rows[0]["metrics"] == {"loss": 0.05}
    assert all(ISO.match(row["time"]) for row in rows)
    human = cli("ls", root)
    assert human.returncode == 0 and "STATUS" in human.stdout and "newest" in human.stdout


def test_ls_shows_corrupt_and_incomplete(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    flip_byte(os.path.join(root, "step_000000020", "shared.safetensors"))
    os.makedirs(os.path.join(root, "step_000000040"))  # torn: no manifest
    rows = {row["name"]: row for row in json.loads(cli("ls", root, "--json").stdout)}
    assert rows["step_000000020"]["status"] == "corrupt"
    assert "checksum" in rows["step_000000020"]["problem"]
    assert rows["step_000000040"]["status"] == "incomplete"
    assert rows["step_000000010"]["status"] == rows["step_000000030"]["status"] == "valid"
    # --fast checks sizes only: the flipped byte is not seen, so nothing is called valid
    fast = {row["name"]: row for row in json.loads(cli("ls", root, "--json", "--fast").stdout)}
    assert fast["step_000000020"]["status"] == "unverified"
    assert fast["step_000000020"]["checked"] == "sizes"
    assert all(row["status"] != "valid" for row in fast.values())
    text = cli("ls", root, "--fast").stdout
    assert "sizes ok, not verified" in text and not re.search(r"\bvalid\b", text)


def test_verify_exit_codes_name_the_bad_file(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    ok = cli("verify", root, "--all")
    assert ok.returncode == 0 and ok.stdout.count("ok ") == 3
    flip_byte(os.path.join(root, "step_000000030", "rank_00000.safetensors"))
    bad = cli("verify", root)
    assert bad.returncode == 1
    assert "rank_00000.safetensors" in bad.stdout and "step_000000030" in bad.stdout
    assert cli("verify", root, "--all").returncode == 1
    assert cli("verify", root, "--step", "20").returncode == 0
    assert cli("verify", root, "--step", "30").returncode == 1
    missing = cli("verify", root, "--step", "99")
    assert missing.returncode == 1 and "no checkpoint of step 99" in missing.stderr
    assert cli("verify", str(tmp_path / "empty")).returncode == 2  # no such directory: usage
    os.makedirs(tmp_path / "empty")
    assert cli("verify", str(tmp_path / "empty")).returncode == 3  # nothing to act on


def test_inspect_shows_keys_shapes_dtypes_metrics(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    r = cli("inspect", root, "--step", "20")
    assert r.returncode == 0, r.stderr
    assert "model.weight" in r.stdout and "float32" in r.stdout and "[3, 4]" in r.stdout
    assert "loss" in r.stdout and "extra.epoch" in r.stdout
    info = json.loads(cli("inspect", root, "--step", "20", "--json").stdout)
    assert info["step"] == 20 and info["metrics"] == {"loss": 0.05}
    keys = {k["key"]: k for k in info["keys"]}
    assert keys["model.weight"]["shape"] == [3, 4] and keys["model.weight"]["dtype"] == "float32"
    assert cli("inspect", root, "--step", "5").returncode == 1


def test_gc_dry_run_then_delete(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20, 30, 40), keep_last=None)
    os.makedirs(os.path.join(root, ".staging-step_000000050-abc"))
    with open(os.path.join(root, ".latest.0a1b2c3d"), "w") as f:  # a killed `latest` rewrite
        f.write("step_000000040\n")
    dry = cli("gc", root, "--dry-run", "--keep-last", "2")
    assert dry.returncode == 0
    assert (
        "would delete step_000000010" in dry.stdout and "would delete step_000000020" in dry.stdout
    )
    assert ".staging-step_000000050-abc" in dry.stdout
    assert len(os.listdir(root)) >= 5  # nothing deleted
    done = cli("gc", root, "--keep-last", "2")
    assert done.returncode == 0, done.stderr
    left = sorted(n for n in os.listdir(root) if n.startswith(("step_", ".staging", ".latest")))
    assert left == ["step_000000030", "step_000000040"]


def test_gc_goes_on_past_a_checkpoint_it_cannot_delete_and_says_so(tmp_path, monkeypatch, capsys):
    """One checkpoint holding a file that cannot be deleted (a busy NFS file): gc stopped at it
    with a bare PermissionError after deleting others without a word."""
    from resilient_callbacks import cli_local

    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20, 30, 40), keep_last=None)
    real = cli_local.remove_checkpoint

    def remove(path, *a, **k):
        if path.endswith("step_000000010"):
            raise PermissionError(13, "Operation not permitted", path + "/.nfs000000001")
        return real(path, *a, **k)

    monkeypatch.setattr(cli_local, "remove_checkpoint", remove)
    assert main(["gc", root, "--keep-last", "1"]) == 1
    out, err = capsys.readouterr()
    assert "could not delete step_000000010" in err and ".nfs000000001" in err
    assert "deleted step_000000020" in out and "1 could not be deleted" in out
    left = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    assert left == ["step_000000010", "step_000000040"]


def test_gc_on_a_directory_it_cannot_lock_says_so(tmp_path, monkeypatch, capsys):
    """A read-only mount: gc printed a bare "OSError: [Errno 30] Read-only file system: .lock"
    (a user probe). It says gc can delete nothing there and points at --dry-run."""
    import errno

    from resilient_callbacks import lock

    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20), keep_last=None)

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", root + "/.lock")

    monkeypatch.setattr(lock.DirLock, "acquire", read_only)
    assert main(["gc", root, "--keep-last", "1"]) == 1
    err = capsys.readouterr().err
    assert f"cannot take the lock of {root} (Read-only file system)" in err, err
    assert "see what it would delete with --dry-run" in err


def test_ls_says_all_are_kept_without_keep_last_in_words(tmp_path):
    """A run without keep_last: ls's KEPT column and gc said `keep_last=None keeps all`, a
    Python literal a user of the CLI may never have written; it says `all` (as "last 3")."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20), keep_last=None)
    rows = json.loads(cli("ls", root, "--json").stdout)
    assert [r["kept_by"] for r in rows] == [["all"], ["newest", "all"]]
    for said in (cli("ls", root).stdout, cli("gc", root, "--dry-run").stdout):
        assert "None" not in said and "newest; all" in said, said


def test_gc_keeps_corrupt_unless_asked_and_refuses_beside_a_writer(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, keep_last=None)
    flip_byte(os.path.join(root, "step_000000010", "shared.safetensors"))
    cli("gc", root)
    assert os.path.isdir(os.path.join(root, "step_000000010"))
    r = cli("gc", root, "--remove-corrupt")
    assert r.returncode == 0 and "corrupt" in r.stdout
    assert not os.path.exists(os.path.join(root, "step_000000010"))
    with Checkpointer(root):
        locked = cli("gc", root)
        assert locked.returncode == 1 and "a writer is open on" in locked.stderr


def test_gc_removing_the_newest_checkpoint_points_latest_at_the_newest_left(tmp_path):
    """``gc --remove-corrupt`` deleted a corrupt newest checkpoint and left the advisory
    ``latest`` file naming it (the docs walkthrough): a shell script following it broke."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20), keep_last=None)
    latest = os.path.join(root, "latest")
    assert Path(latest).read_text().strip() == "step_000000020"
    flip_byte(os.path.join(root, "step_000000020", "shared.safetensors"))
    assert cli("gc", root, "--remove-corrupt").returncode == 0
    assert Path(latest).read_text().strip() == "step_000000010"
    flip_byte(os.path.join(root, "step_000000010", "shared.safetensors"))
    assert cli("gc", root, "--remove-corrupt").returncode == 0
    assert not os.path.exists(latest)  # no checkpoint left to name


def test_gc_other_runs_deletes_what_the_foreign_warning_names(tmp_path):
    """A directory reused by a new run (resume="never"): the writer's warning names the gc
    command that deletes the old run's checkpoints; plain gc keeps them, --other-runs deletes
    them and nothing of the current run."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20), keep_last=None)
    with pytest.warns(resilient_callbacks.ForeignCheckpointsWarning) as rec:
        make_run(root, steps=(1, 2), keep_last=None, resume="never")
    message = str(rec[0].message)
    assert f"resilient-ckpt gc {root} --other-runs" in message
    assert cli("gc", root).returncode == 0
    assert len([n for n in os.listdir(root) if n.startswith("step_")]) == 4
    dry = cli("gc", root, "--other-runs", "--dry-run", "--json")
    assert sorted(d["step"] for d in json.loads(dry.stdout)["delete"]) == [10, 20]
    done = cli(*message.split("`")[1].split()[1:])  # the command as the warning names it
    assert done.returncode == 0, done.stderr
    assert "checkpoint of another run" in done.stdout
    left = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    assert left == ["step_000000001", "step_000000002"]
    assert [r["step"] for r in json.loads(cli("ls", root, "--json").stdout)] == [1, 2]


@pytest.mark.parametrize(
    "args",
    [["ls"], ["frobnicate", "x"], ["inspect"], ["verify", "x", "--all", "--step", "1"]],
)
def test_usage_errors_exit_2(args):
    assert cli(*args).returncode == 2


# ---------------------------------------------------------------------- defaults


def test_verify_and_inspect_default_to_the_newest_checkpoint(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    flip_byte(os.path.join(root, "step_000000010", "shared.safetensors"))  # an old one
    r = cli("verify", root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step_000000030" in r.stdout and "step_000000010" not in r.stdout
    assert "--all" in r.stdout  # says that only the newest was verified
    every = cli("verify", root, "--all", "--json")
    assert every.returncode == 1
    res = json.loads(every.stdout)
    assert res["scope"] == "all" and res["ok"] is False and res["failed"] == 1
    assert [c["status"] for c in res["checkpoints"]] == ["corrupt", "valid", "valid"]
    one = json.loads(cli("verify", root, "--json").stdout)
    assert one["scope"] == "newest" and one["ok"] is True and one["verified"] == 1
    assert one["checkpoints"][0]["step"] == 30 and ISO.match(one["checkpoints"][0]["time"])

    shown = cli("inspect", root)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("step_000000030: step 30, valid")
    assert shown.stderr == ""  # nothing newer was skipped


def test_inspect_of_an_unreadable_manifest_says_why_its_keys_are_unknown(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    with open(os.path.join(root, "step_000000020", "manifest.json"), "w") as f:
        f.write('{"format_version": 1, "ste')  # torn
    r = cli("inspect", root, "--step", "20", "--json")
    assert r.returncode == 1
    info = json.loads(r.stdout)
    assert info["keys"] is None and "unreadable manifest" in info["keys_problem"], info
    assert "unreadable manifest" in cli("inspect", root, "--step", "20").stdout


def test_inspect_json_is_typed(tmp_path):
    root = str(tmp_path / "ck")
    torch.manual_seed(0)
    state = {
        "model": torch.nn.Linear(2, 2),
        "extra": {"epoch": 3, "lr": 0.5, "done": True, "name": "run", "none": None},
        "limits": {"top": float("inf")},
    }
    with Checkpointer(root) as ck:
        ck.save(7, state, metrics={"loss": 0.25})
    r = cli("inspect", root, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout, parse_constant=pytest.fail)  # strict JSON: no NaN/Infinity
    assert info["step"] == 7 and info["world_size"] == 1 and isinstance(info["bytes"], int)
    assert info["status"] == "valid" and info["checked"] == "checksums"
    assert info["metrics"] == {"loss": 0.25}
    assert ISO.match(info["time"]) and "created" not in info
    values = {k["key"]: k for k in info["keys"] if k["kind"] == "value"}
    assert values["extra.epoch"]["value"] == 3 and values["extra.epoch"]["type"] == "int"
    assert values["extra.lr"]["value"] == 0.5
    assert values["extra.done"]["value"] is True and values["extra.done"]["type"] == "bool"
    assert values["extra.name"]["value"] == "run"
    assert values["extra.none"]["value"] is None
    # JSON has no infinity: a non-finite float is the string "inf", typed float
    assert values["limits.top"] == {
        "key": "limits.top",
        "kind": "value",
        "type": "float",
        "value": "inf",
    }
    assert all(isinstance(f["size"], int) and isinstance(f["rank"], int) for f in info["files"])
    text = cli("inspect", root).stdout
    # a readable local time, not an epoch number
    assert re.search(r"saved: +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text)
    assert "loss=0.25" in text


def test_dir_may_be_one_checkpoint_for_verify_and_inspect(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    one = os.path.join(root, "step_000000020")
    v = cli("verify", one, "--json")
    assert v.returncode == 0 and [c["step"] for c in json.loads(v.stdout)["checkpoints"]] == [20]
    assert cli("inspect", one).stdout.startswith("step_000000020: step 20, valid")
    g = cli("gc", one)
    assert g.returncode == 2 and "give its parent directory" in g.stderr


@pytest.mark.parametrize("command", ["ls", "verify", "inspect", "gc", "push", "export"])
def test_a_parent_directory_points_at_the_subdirectories_that_hold_checkpoints(tmp_path, command):
    parent = tmp_path / "demo_output"
    make_run(str(parent / "a"), steps=(1, 2, 3))
    make_run(str(parent / "b" / "checkpoints"), steps=(1, 2))
    make_run(str(parent / "c" / "run" / "x" / "checkpoints"), steps=(1,))  # the demo's depth
    (parent / "empty").mkdir()
    extra = {"push": ["memory://nowhere"], "export": [str(tmp_path / "hf")]}
    args = [command, str(parent), *extra.get(command, [])]
    r = cli(*args)
    assert r.returncode == (0 if command in ("ls", "gc") else 3)  # (3: nothing to act on)
    said = r.stdout + r.stderr
    assert f"no checkpoints in {parent}" in said or f"no checkpoints to push in {parent}" in said
    assert (
        "these subdirectories hold checkpoints: a (3), b/checkpoints (2), c/run/x/checkpoints (1)"
        in said
    )
    assert not os.path.exists(parent / ".lock")  # gc did not lock a directory it does not own


# ---------------------------------------------------------------------- JSON everywhere


def test_gc_dry_run_json_says_what_would_be_deleted(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20, 30), keep_last=None)
    r = cli("gc", root, "--dry-run", "--keep-last", "1", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["dry_run"] is True
    assert [d["step"] for d in res["delete"]] == [10, 20]
    assert all(d["why"] == "not kept by retention" for d in res["delete"])
    assert [(k["step"], k["status"], k["kept"]) for k in res["keep"]] == [(30, "valid", True)]
    assert all(ISO.match(x["time"]) for x in res["delete"] + res["keep"])
    assert len([n for n in os.listdir(root) if n.startswith("step_")]) == 3


def test_push_and_pull_json_summaries(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    url = (tmp_path / "remote").as_uri()
    pushed = cli("push", root, url, "--json")
    assert pushed.returncode == 0, pushed.stderr
    res = json.loads(pushed.stdout)
    assert [p["step"] for p in res["pushed"]] == [10, 20] and res["skipped"] == []
    again = json.loads(cli("push", root, url, "--json").stdout)
    assert again["pushed"] == [] and [p["step"] for p in again["present"]] == [10, 20]
    rows = json.loads(cli("ls", root, "--remote", url, "--json").stdout)
    assert {r["tier"] for r in rows} == {"both"}
    pulled = cli("pull", url, str(tmp_path / "copy"), "--step", "10", "--json")
    assert pulled.returncode == 0, pulled.stderr
    got = json.loads(pulled.stdout)
    assert got["step"] == 10 and got["pulled"] is True and isinstance(got["bytes"], int)
    assert ISO.match(got["time"])
    only_remote = json.loads(cli("ls", str(tmp_path / "copy"), "--remote", url, "--json").stdout)
    remote_row = next(r for r in only_remote if r["step"] == 20)
    # the remote listing checks sizes only: not called valid
    assert remote_row["tier"] == "remote" and remote_row["status"] == "unverified"


def test_pull_into_a_directory_holding_part_of_the_checkpoint_refuses(tmp_path):
    """A node-local copy (one node's ranks' files, its own manifest listing those) of the
    remote's checkpoint: pull used to say "already there, verified", exit 0."""
    from resilient_callbacks.manifest import SELF_CHECKSUM, self_checksum

    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    ckpt = os.path.join(root, "step_000000010")
    with open(os.path.join(ckpt, "manifest.json")) as f:
        m = json.load(f)
    dropped = next(e for e in m["files"] if e["path"] != "shared.json")
    m["files"].remove(dropped)  # as a node's manifest lists only that node's files
    m["extra"]["node"] = {"ranks": [1], "nodes": 2, "remote_name": "step_000000010"}
    m[SELF_CHECKSUM] = self_checksum(m)
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(m, f)
    os.remove(os.path.join(ckpt, dropped["path"]))
    r = cli("pull", url, root)
    assert r.returncode != 0, r.stdout
    assert "holds only part of that checkpoint (node-local: ranks [1])" in r.stderr
    whole = cli("pull", url, str(tmp_path / "empty"))
    assert whole.returncode == 0, whole.stderr


def test_push_repairs_a_damaged_remote_copy(tmp_path):
    """The remote copy of a local checkpoint has a torn file: push uploads it again (it said
    "pushed", exit 0, and left the copy torn: its manifest matched the local one)."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    torn = tmp_path / "remote" / "step_000000010" / "shared.safetensors"
    torn.write_bytes(torn.read_bytes()[:10])
    listed = cli("ls", root, "--remote", url)
    assert "remote-corrupt" in listed.stdout and "its remote copy is damaged" in listed.stdout
    (row,) = json.loads(cli("ls", root, "--remote", url, "--json").stdout)
    assert row["tier"] == "remote-corrupt" and "shared.safetensors" in row["remote_problem"]
    r = cli("push", root, url, "--json")
    assert r.returncode == 0, r.stderr
    (item,) = json.loads(r.stdout)["pushed"]
    assert "shared.safetensors" in item["repaired"]
    rows = json.loads(cli("ls", root, "--remote", url, "--json").stdout)
    assert [x["tier"] for x in rows] == ["both"]
    assert cli("pull", url, str(tmp_path / "copy")).returncode == 0


def test_remote_listing_tells_an_unreadable_manifest_from_an_upload_in_progress(tmp_path):
    """Every remote manifest is fetched in one call: a garbled one is its checkpoint's
    problem alone ('remote-corrupt'; gc keeps it unless --remove-corrupt, and no longer calls
    it an upload in progress; push uploads beside it); a folder with files and no manifest is
    'uploading'."""
    from resilient_callbacks.remote import NO_MANIFEST, RemoteStore

    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20, 30))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    (tmp_path / "remote" / "step_000000020" / "manifest.json").write_bytes(b"{garbled")
    (tmp_path / "remote" / "step_000000030" / "manifest.json").unlink()
    problems = {e.name: e.problem for e in RemoteStore(url).scan()}
    assert problems["step_000000010"] is None and problems["step_000000030"] == NO_MANIFEST
    assert "unreadable manifest" in problems["step_000000020"]
    rows = {r["step"]: r for r in json.loads(cli("ls", root, "--remote", url, "--json").stdout)}
    assert [rows[s]["tier"] for s in (10, 20, 30)] == ["both", "remote-corrupt", "uploading"]
    gc = cli("gc", root, "--remote", url, "--keep-last", "5", "--dry-run", "--json")
    said = gc.stdout
    assert "may be an upload in progress" in said, said
    assert "corrupt: " in said and "(--remove-corrupt deletes it)" in said
    pushed = json.loads(cli("push", root, url, "--json").stdout)["pushed"]
    # the unreadable copy may be another commit's (a re-save after a fallback) or readable
    # again later: push never replaces it (it did), gc --remove-corrupt deletes it
    assert [(p["step"], p["url"].rsplit("/", 1)[1], "repaired" in p) for p in pushed] == [
        (20, "step_000000020-r1", False),
        (30, "step_000000030", False),
    ]
    assert (tmp_path / "remote" / "step_000000020" / "manifest.json").read_bytes() == b"{garbled"


def test_pull_next_to_leftovers_and_a_folder_without_manifest(tmp_path):
    """A killed pull's staging folder is swept by the next pull (under the lock); a folder of
    the checkpoint's name without a manifest is refused before downloading (the pull failed on
    a raw 'Directory not empty' and left a full downloaded copy each time)."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    dst = tmp_path / "dst"
    (dst / ".staging-step_000000010-0123456789ab").mkdir(parents=True)
    (dst / "step_000000010").mkdir()
    (dst / "step_000000010" / "notes.txt").write_text("someone's")
    r = cli("pull", url, str(dst))
    assert r.returncode == 1 and "is not a committed checkpoint" in r.stderr, r.stderr
    assert sorted(os.listdir(dst)) == [".lock", "step_000000010"]
    (dst / "step_000000010" / "notes.txt").unlink()
    (dst / "step_000000010").rmdir()
    assert cli("pull", url, str(dst)).returncode == 0


# ---------------------------------------------------------------------- help, version


def _parsers():
    ap = build_parser()
    yield "resilient-ckpt", ap
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_the_examples_in_the_help_parse():
    """Each ``resilient-ckpt ...`` example of ``--help`` is a command line the parser takes
    (one showed ``report ... -o report.html`` after ``-o`` became a remote option)."""
    import shlex

    from resilient_callbacks.cli_parser import EPILOG

    examples = [
        re.split(r"\s{2,}", line.strip())[0]
        for line in EPILOG.splitlines()
        if line.startswith("  resilient-ckpt ")
    ]
    assert len(examples) >= 8
    for example in examples:
        args = build_parser().parse_args(shlex.split(example)[1:])
        assert args.cmd, example
        if args.cmd == "report":
            assert args.option is None, example  # -o is a remote option there


def test_every_argument_and_option_has_help():
    seen = 0
    for name, parser in _parsers():
        assert parser.description, f"{name}: no description"
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, f"{name} {choice.dest}: no help"
                continue
            what = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help != argparse.SUPPRESS, f"{what}: no help text"
            seen += 1
    assert seen > 30  # every subcommand was looked at


def test_help_is_plain_text_with_examples():
    r = cli("--help")
    assert r.returncode == 0
    assert "``" not in r.stdout and "examples:" in r.stdout
    assert "resilient-ckpt verify" in r.stdout and "Exit codes" in r.stdout


def test_version():
    r = cli("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"resilient-ckpt {importlib.metadata.version('resilient-callbacks')}"
    assert r.stdout.strip() == f"resilient-ckpt {resilient_callbacks.__version__}"


def test_version_falls_back_to_the_package_attribute(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setattr(resilient_callbacks, "__version__", "9.9.9-test")
    assert package_version() == "9.9.9-test"


def test_no_command_prints_help_and_a_hint():
    r = cli()
    assert r.returncode == 2
    assert "usage: resilient-ckpt" in r.stderr and "commands:" in r.stderr
    assert "no command given" in r.stderr and "required" not in r.stderr


# ---------------------------------------------------------------------- no torch for --help

_NO_TORCH = """
import contextlib, io, sys, types
if sys.argv[1] == "stub":  # the CLI module alone, without the package's __init__
    pkg = types.ModuleType("resilient_callbacks")
    pkg.__path__ = [sys.argv[2]]
    sys.modules["resilient_callbacks"] = pkg
from resilient_callbacks import cli
for argv in (["--help"], ["--version"], ["ls"], ["verify", "x", "--bogus"], [], ["gc", "-h"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.main(argv)
        except SystemExit:
            pass
heavy = sorted(m for m in ("torch", "numpy", "fsspec", "safetensors") if m in sys.modules)
print(",".join(heavy))
"""


def test_help_version_and_usage_errors_do_not_import_torch():
    """The CLI module imports its commands (and so torch) only when one runs."""
    src = os.path.dirname(resilient_callbacks.__file__)
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, "stub", src], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"imported by --help/--version: {r.stdout}"


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_module_entry_point_help_does_not_import_torch(flag):
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "resilient_callbacks", flag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "resilient-ckpt" in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "torch" not in imported


def test_a_checkpoint_deleted_while_it_is_read_is_not_reported_corrupt(tmp_path, monkeypatch):
    """A run writing beside the CLI deletes its old checkpoints (retention renames each out of
    sight, then deletes it). One that goes while ls/verify reads it is gone, not corrupt: they
    reported "CORRUPT ... listed in the manifest but missing", or crashed on the vanished
    manifest. Here the newest goes while its files are hashed: verify checks the next."""
    from resilient_callbacks import verification

    root = tmp_path / "ck"
    with Checkpointer(root, async_save=False) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
    real = verification.digest_file
    newest = str(root / "step_000000003")

    def deleting(path, like=None):  # retention of the writing run, at the worst moment
        if path.startswith(newest + os.sep) and os.path.isdir(newest):
            os.rename(newest, str(root / ".trash-step_000000003"))
        return real(path, like=like)

    monkeypatch.setattr(verification, "digest_file", deleting)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["verify", str(root)]) == 0
    assert "CORRUPT" not in out.getvalue() and "step          2" in out.getvalue()


def test_inspect_lists_shapes_of_compressed_and_blob_stored_tensors(tmp_path):
    pytest.importorskip("zstandard")
    for options in ({"compression": "zstd"}, {"incremental": True}):
        root = str(tmp_path / next(iter(options)))
        with Checkpointer(root, **options) as ck:
            ck.save(1, {"w": torch.ones(64, 64), "b": torch.zeros(10), "n": 3})
        r = cli("inspect", root, "--json")
        assert r.returncode == 0, r.stderr
        keys = {k["key"]: k for k in json.loads(r.stdout)["keys"]}
        assert (keys["w"]["dtype"], keys["w"]["shape"]) == ("float32", [64, 64]), options
        assert (keys["b"]["dtype"], keys["b"]["shape"]) == ("float32", [10]), options


def test_exit_status_survives_a_reader_that_goes_away(tmp_path):
    """`resilient-ckpt inspect DIR --step N | head -1` on a corrupt checkpoint: the status is
    still 1 (a closed pipe used to turn every command into a success)."""
    root = str(tmp_path / "ck")
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(8), "meta": {str(i): i for i in range(3000)}})
    flip_byte(os.path.join(root, "step_000000001", "shared.safetensors"))
    exe = os.path.join(os.path.dirname(sys.executable), "resilient-ckpt")
    p = subprocess.Popen([exe, "inspect", root, "--step", "1"], stdout=subprocess.PIPE)
    assert p.stdout is not None
    p.stdout.readline()
    p.stdout.close()  # as `head -1` does
    assert p.wait(timeout=120) == 1


def test_export_of_a_plain_checkpoint_writes_its_module(tmp_path, capsys):
    """A plain Checkpointer state: its one module is written by its state-dict names (it was
    "there is no model to export"); several modules, or a nested one, by --key."""
    from safetensors.torch import load_file

    root = str(tmp_path / "ck")
    state = make_run(root, steps=(1,))
    assert main(["export", root, str(tmp_path / "out")]) == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert got.keys() == state["model"].state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in state["model"].state_dict().items())
    assert json.loads((tmp_path / "out" / "export.json").read_text())["key"] == "model"

    two = str(tmp_path / "two")
    model, ema = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    with Checkpointer(two) as ck:
        ck.save(1, {"train": {"model": model, "opt": opt}, "ema": ema})
    capsys.readouterr()
    assert main(["export", two, str(tmp_path / "o2")]) == 1  # the nested model is not chosen
    err = capsys.readouterr().err
    assert "(train.model, ema); name the one to export with --key" in err, err
    assert not (tmp_path / "o2").exists()
    assert main(["export", two, str(tmp_path / "o2"), "--key", "train.model"]) == 0
    assert torch.equal(load_file(tmp_path / "o2" / "model.safetensors")["weight"], model.weight)
    assert main(["export", two, str(tmp_path / "o3"), "--key", "train.nope"]) == 1
    assert "train has no entry 'nope' (model, opt)" in capsys.readouterr().err
    # an optimizer's state is not weights: refused (it was written as model.safetensors)
    assert main(["export", two, str(tmp_path / "o4"), "--key", "train.opt"]) == 1
    err = capsys.readouterr().err
    assert "'train.opt' is not a module's state dict" in err, err
    assert "name a module (train.model, ema)" in err, err
    assert not (tmp_path / "o4").exists()


@pytest.mark.parametrize(
    "args",
    [["gc", "x", "--keep-last", "0"], ["ls", "x", "-o", "endpoint_url=http://h"]],
)
def test_more_usage_errors_exit_2(args):
    assert cli(*args).returncode == 2


@pytest.mark.parametrize(
    "args",
    [["push", "x", "file:///tmp/nowhere", "-o", "badopt"], ["pull", "file:///x", "y", "-o", "=1"]],
)
def test_an_option_that_is_not_key_value_is_a_usage_error(args):
    got = cli(*args)
    assert got.returncode == 2 and "expected KEY=VALUE" in got.stderr


def test_the_stores_own_errors_are_one_line_not_a_traceback(tmp_path, monkeypatch):
    """An error of the store's client that is not an OSError (botocore's
    EndpointConnectionError, an -o option its client rejects) was a traceback."""
    from resilient_callbacks import remote

    root = str(tmp_path / "ck")
    make_run(root, steps=(1,))

    class EndpointConnectionError(Exception):  # botocore's is not an OSError either
        pass

    def scan(self):
        raise EndpointConnectionError('Could not connect to the endpoint URL: "http://h:1/b"')

    monkeypatch.setattr(remote.RemoteStore, "scan", scan)
    got = cli("ls", root, "--remote", f"file://{tmp_path}/r")
    assert got.returncode == 1
    assert "the remote store failed: EndpointConnectionError: Could not connect" in got.stderr
    assert "Traceback" not in got.stderr
    monkeypatch.setenv("RESILIENT_CKPT_TRACEBACK", "1")  # asked for: the traceback
    with pytest.raises(EndpointConnectionError):
        main(["ls", root, "--remote", f"file://{tmp_path}/r"])


def test_a_checkpoint_that_cannot_be_read_is_corrupt_not_incomplete(tmp_path):
    """A manifest that cannot be opened (here a symbolic-link loop; a folder of mode 000 for
    another user) was 'incomplete: no manifest', which gc deletes; a data file that cannot be
    read made ls fail for the whole directory."""
    root = tmp_path / "ck"
    make_run(str(root))
    manifest = root / "step_000000020" / "manifest.json"
    manifest.unlink()
    manifest.symlink_to(manifest.name)
    data = root / "step_000000030" / "rank_00000.safetensors"
    data.unlink()
    data.symlink_to(data.name)
    got = cli("ls", str(root), "--json")
    assert got.returncode == 0, got.stderr
    rows = {r["name"]: r for r in json.loads(got.stdout)}
    for name in ("step_000000020", "step_000000030"):
        assert rows[name]["status"] == "corrupt", rows[name]
        assert "cannot read it" in rows[name]["problem"], rows[name]
    got = cli("gc", str(root), "--dry-run", "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["delete"] == []


def test_gc_remove_corrupt_keeps_a_checkpoint_of_a_newer_format(tmp_path):
    """A manifest of a newer format version is unreadable here, not damaged: ``gc
    --remove-corrupt`` deleted it with the corrupt ones (probe)."""
    root = tmp_path / "ck"
    make_run(str(root))
    newer = root / "step_000000030" / "manifest.json"
    m = json.loads(newer.read_text())
    m["format_version"] = 99
    newer.write_text(json.dumps(m))
    flip_byte(str(root / "step_000000020" / "rank_00000.safetensors"))
    got = cli("gc", str(root), "--remove-corrupt", "--json")
    assert got.returncode == 0, got.stderr
    got = json.loads(got.stdout)
    assert [d["name"] for d in got["delete"]] == ["step_000000020"]
    assert newer.exists()
    (kept,) = [k for k in got["keep"] if k["name"] == "step_000000030"]
    assert kept["kept"] is True and "kept, also by --remove-corrupt" in kept["kept_by"][0]


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch):
    """A Ctrl-C in a command (here in the middle of a pull) printed KeyboardInterrupt's
    traceback."""
    from resilient_callbacks import pulling

    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pulling.RemoteStore, "download", interrupted)
    r = cli("pull", url, str(tmp_path / "dst"))
    assert r.returncode == 130 and r.stderr.strip().endswith("pull: interrupted"), r.stderr


def test_ls_tells_two_checkpoints_of_one_step_apart(tmp_path):
    """A step saved again after resuming from an older one is ``step_N-1``: the table showed
    two rows with the same step and nothing to tell them apart."""
    root = str(tmp_path / "ck")
    state = make_run(root, steps=(10, 20))
    with Checkpointer(root, resume=10) as ck:
        ck.restore(state)
        ck.save(20, state)
    table = cli("ls", root).stdout
    firsts = [line.split()[:2] for line in table.splitlines() if line.split()[:1] == ["20"]]
    assert [f[1] == "(-1)" for f in firsts] == [False, True], table


def _s3_options(options: dict) -> list[str]:
    return [a for k, v in options.items() for a in ("-o", f"{k}={json.dumps(v)}")]


def _unreachable_s3_options() -> list[str]:
    """``-o`` options for an S3 endpoint on a port nothing listens on, tried once."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _s3_options(
        {
            "endpoint_url": f"http://127.0.0.1:{port}",
            "key": "k",
            "secret": "s",
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
        }
    )


def test_verify_reads_a_remote_store_and_push_verify_repairs_a_same_size_rot(tmp_path, s3_remote):
    """On the S3 API server: `verify URL` reads the remote copies where they lie and finds a
    file whose bytes changed at the same size (listing sizes, as ls --remote and push do, cannot);
    `push --verify` uploads it again; the other commands say a URL is not a local directory."""
    import s3fs

    url, options = s3_remote
    o = _s3_options(options)
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    assert cli("push", root, url, *o).returncode == 0
    r = cli("verify", url, "--all", *o)
    assert r.returncode == 0, r.stderr
    assert "2 remote checkpoint(s) verified" in r.stdout
    fs = s3fs.S3FileSystem(**options)
    key = f"{url[len('s3://') :]}/step_000000020/shared.safetensors"
    data = bytearray(fs.cat_file(key))
    data[-3] ^= 0xFF
    fs.pipe_file(key, bytes(data))  # same size, other bytes
    r = cli("verify", url, *o)  # the newest
    assert r.returncode == 1
    assert "step_000000020/shared.safetensors: checksum mismatch" in r.stdout
    assert "push DIR" in r.stderr and "--verify" in r.stderr
    res = json.loads(cli("verify", url, "--all", "--json", *o).stdout)
    assert (res["verified"], res["failed"], res["ok"]) == (2, 1, False)
    assert [c["status"] for c in res["checkpoints"]] == ["valid", "corrupt"]
    by_size = json.loads(cli("push", root, url, "--json", *o).stdout)
    assert by_size["pushed"] == [] and [p["checked"] for p in by_size["present"]] == ["sizes"] * 2
    read = json.loads(cli("push", root, url, "--verify", "--json", *o).stdout)
    assert [p["step"] for p in read["pushed"]] == [20]
    assert "checksum mismatch" in read["pushed"][0]["repaired"]
    assert [p["checked"] for p in read["present"]] == ["checksums"]
    assert cli("verify", url, "--all", *o).returncode == 0
    for command in ("ls", "inspect", "gc"):
        r = cli(command, url)
        assert r.returncode == 2 and "is a remote store's URL" in r.stderr, command
        assert f"resilient-ckpt verify {url}" in r.stderr
    r = cli("verify", root, "-o", "anon=true")
    assert r.returncode == 2 and "DIR is local here" in r.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save, one process
def test_verify_of_a_url_holding_plain_dcp_checkpoints_names_them(tmp_path, s3_remote):
    """On the S3 API server: `verify URL` of checkpoints plain ``dcp.save`` wrote there
    (FsspecWriter), one of them torn (its ``.metadata``, written last, missing), said only "no
    checkpoints in URL"; `verify DIR` names them locally. It names them now, the complete
    ones as plain dcp.save checkpoints (not verified, how to carry them over) and the torn
    one as such, as it does where the URL is one."""
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url, options = s3_remote
    o = _s3_options(options)
    for name in ("step_100", "step_200", "step_300"):
        dcp.save({"w": torch.ones(3)}, storage_writer=FsspecWriter(f"{url}/{name}", **options))
    fs = s3fs.S3FileSystem(**options)
    fs.rm(f"{url[len('s3://') :]}/step_300/.metadata")  # as if the save had stopped there
    r = cli("verify", url, *o)
    assert r.returncode == 3  # none of ours: nothing to act on
    said = " ".join(r.stderr.split())
    assert f"step_100, step_200 in {url} are checkpoints written by plain dcp.save" in said, said
    assert (
        "neither lists nor verifies" in said and "plain_dcp_reader(DIR, allow_pickle=True)" in said
    )
    assert f"step_300 in {url} holds *.distcp files without a .metadata" in said, said
    one = f"{url}/step_100"
    said = " ".join(cli("verify", one, *o).stderr.split())
    assert f"{one} is a checkpoint written by plain dcp.save" in said, said
    fs.rm(f"{one[len('s3://') :]}/.metadata")
    said = " ".join(cli("verify", one, *o).stderr.split())
    assert f"{one} holds *.distcp files without a .metadata" in said, said
    said = " ".join(cli("verify", f"{url}/nothing", *o).stderr.split())
    assert said.endswith(f"no checkpoints in {url}/nothing"), said


def test_push_verify_uploads_a_rotten_shared_blob_again(tmp_path):
    """An incremental checkpoint's blob (shared by checkpoints, named by its content) rotten at
    the same size in the remote store: verify names the blob, push --verify puts its bytes back."""
    root = str(tmp_path / "ck")
    model = torch.nn.Linear(64, 64)  # its weight is large enough to be stored as a blob
    with Checkpointer(root, incremental=True) as ck:
        for s in (10, 20):
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(s, {"model": model})
    url = (tmp_path / "remote").as_uri()
    r = cli("push", root, url)
    # the size said counts the blobs the checkpoint names (it was the manifest's files alone)
    assert r.returncode == 0 and "KB + 1 blob(s), " in r.stdout, r
    blob = sorted((tmp_path / "remote" / "blobs").iterdir())[0]
    flip_byte(str(blob), -3)
    r = cli("verify", url, "--all")
    assert r.returncode == 1 and f"blobs/{blob.name}: checksum mismatch" in r.stdout
    assert cli("push", root, url, "--verify").returncode == 0
    assert cli("verify", url, "--all").returncode == 0


def test_a_copy_of_a_checkpoint_under_a_name_of_ones_own_is_checked_alone(tmp_path):
    """``verify``/``inspect``/``ls`` of ``DIR/best`` (a copy of a step_* folder, which a
    restore loads with resume=<its path>) said "no checkpoints in DIR": the copy is no
    checkpoint of the directory, so it was filtered out of the directory's listing. Each
    checks the copy itself; a damaged copy is reported as such."""
    import shutil

    root = tmp_path / "ck"
    make_run(str(root))
    copy = root / "best"
    shutil.copytree(root / "step_000000020", copy)
    r = cli("verify", str(copy))
    assert r.returncode == 0 and "ok" in r.stdout and "best" in r.stdout, r.stdout + r.stderr
    r = cli("inspect", str(copy))
    assert r.returncode == 0 and "step 20, valid" in r.stdout, r.stdout + r.stderr
    r = cli("ls", str(copy), "--json")
    (row,) = json.loads(r.stdout)
    assert row["name"] == "best" and row["step"] == 20 and row["copy"] is True
    r = cli("ls", str(copy))
    assert "a run never resumes from it or deletes it, nor does gc" in r.stdout, r.stdout
    r = cli("gc", str(copy))  # said "give its parent directory", as for a step_* folder
    assert r.returncode == 2 and "a copy of a checkpoint under a name of your own" in r.stderr
    assert f"give the run's directory {root}" in r.stderr and (copy / "manifest.json").exists()
    assert [row["step"] for row in json.loads(cli("ls", str(root), "--json").stdout)] == [
        10,
        20,
        30,
    ]  # the directory's listing is unchanged: the copy is not one of its checkpoints
    data = copy / "rank_00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    r = cli("verify", str(copy))
    assert r.returncode == 1 and "best" in r.stdout + r.stderr, r.stdout + r.stderr


def test_inspect_names_every_dtype_as_torch_does_and_aligns_its_columns(tmp_path, capsys):
    """A FilePart's tensors (``dcp.Sharded`` here, one process) were listed with safetensors'
    codes (``F32``, ``BF16``) and the checkpoint's own tensors as ``float32``; a long file or
    key name pushed its line's columns out of line. One name for each dtype, columns aligned."""
    from resilient_callbacks.dcp import Sharded

    m = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, {"train": Sharded(m, opt), "plain": torch.zeros(2, dtype=torch.float16)})
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    keys = {k["key"]: k for k in json.loads(capsys.readouterr().out)["keys"]}
    assert keys["train.model/weight"]["dtype"] == "bfloat16"
    assert keys["train.optim/state/weight/step"]["dtype"] == "float32"
    assert keys["plain"]["dtype"] == "float16"
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    lines = capsys.readouterr().out.splitlines()
    files = [x for x in lines if "xxh3_64" in x]
    assert len({x.index(" xxh3_64") for x in files}) == 1, files  # sizes end in one column
    tensors = [x for x in lines if x.rstrip().endswith("]") and "  [" in x]
    assert len(tensors) == 9 and len({x.index("  [") for x in tensors}) == 1, tensors


def test_an_unknown_option_shows_the_commands_usage_and_an_unknown_run_is_named(tmp_path, capsys):
    """``ls --bogus DIR`` printed the usage of the command list (``COMMAND ...``), not of
    ``ls``; ``report --run <id>`` of an id the history lacks said the directory had no history
    at all. The command's own usage; the runs the history has."""
    d = tmp_path / "ck"
    with Checkpointer(d, async_save=False) as ck:
        ck.save(1, {"w": torch.zeros(2)})
    run = json.loads((d / "history.jsonl").read_text().splitlines()[0])["run_id"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["ls", "--bogus", str(d)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: resilient-ckpt ls " in err and "--bogus" in err, err
    assert main(["report", str(d), "--run", "nope", "--json", "-"]) == 3  # (nothing found)
    err = capsys.readouterr().err
    assert f"no run 'nope' in history.jsonl; its runs, newest first: {run}" in err, err


def test_ls_remote_says_why_the_remote_keeps_what_only_it_has(tmp_path, capsys):
    """With a remote, local retention keeps the last checkpoints and the remote the archives:
    ``ls DIR --remote URL`` showed each remote-only row's URL where the other rows say why
    they are kept. It says what the remote retention keeps it for (``gc --dry-run``'s words)."""
    url = (tmp_path / "remote").as_uri()
    ck = tmp_path / "ck"
    w = torch.zeros(4)
    with Checkpointer(ck, keep_last=1, keep_every_n_steps=2, remote=url, async_save=False) as c:
        for step in range(1, 6):
            w += 1
            c.save(step, {"w": w})
    capsys.readouterr()
    assert main(["ls", str(ck), "--remote", url]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:] if ln.strip()}
    assert lines["2"].rstrip().endswith("remote only: archive (every 2 steps)"), lines
    assert lines["4"].rstrip().endswith("remote only: archive (every 2 steps)"), lines
    assert main(["ls", str(ck), "--remote", url, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[2]["remote_kept_by"] == ["archive (every 2 steps)"] and rows[2]["kept"] is None


def test_ls_remote_says_why_the_remote_keeps_a_copy_both_tiers_hold(tmp_path, capsys):
    """A checkpoint on both tiers showed only why the local retention keeps it: the remote's
    best was listed as "last 2". Its row adds the remote retention's reasons where they differ
    (and ``remote_kept_by`` in JSON)."""
    url = (tmp_path / "remote").as_uri()
    ck = tmp_path / "ck"
    kw = {"keep_last": 2, "remote": url, "remote_keep_last": 1, "async_save": False}
    with Checkpointer(ck, keep_best=1, monitor="loss", **kw) as c:
        for step, loss in ((1, 5.0), (2, 1.0), (3, 4.0)):
            c.save(step, {"w": torch.full((4,), float(step))}, metrics={"loss": loss})
    capsys.readouterr()
    assert main(["ls", str(ck), "--remote", url, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[2]["tier"] == "both" and rows[2]["remote_kept_by"], rows[2]
    assert main(["ls", str(ck), "--remote", url]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:] if ln.strip()}
    local, remote = rows[2]["kept_by"], rows[2]["remote_kept_by"]
    assert local != remote, (local, remote)
    assert lines["2"].rstrip().endswith(f"{'; '.join(local)}; remote: {'; '.join(remote)}"), lines


def test_a_missing_or_misplaced_argument_shows_the_commands_own_usage(tmp_path):
    """``report`` with no DIR and ``ls DIR -o K=V`` without --remote printed the usage of the
    whole program (its list of commands) above the error, not the command's options."""
    r = cli("report")
    assert r.returncode == 2 and "usage: resilient-ckpt report" in r.stderr, r.stderr
    assert "required: DIR" in r.stderr
    r = cli("ls", str(tmp_path), "-o", "anon=true")
    assert r.returncode == 2 and "usage: resilient-ckpt ls" in r.stderr, r.stderr
    assert "give --remote URL" in r.stderr


def test_every_remote_command_says_an_unreachable_store_in_one_line(tmp_path):
    """An S3 endpoint that refuses connections (the store is down, or a wrong endpoint_url):
    `ls --remote`, `pull`, `push` printed one line and exited 1, but `verify URL` let botocore's
    EndpointConnectionError (not an OSError) out as a traceback."""
    pytest.importorskip("s3fs")
    o = _unreachable_s3_options()
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = "s3://bucket/run"
    for args in (
        ("ls", root, "--remote", url),
        ("pull", url, str(tmp_path / "pulled")),
        ("push", root, url),
        ("verify", url),
    ):
        got = cli(*args, *o)
        assert got.returncode == 1, args
        assert "Traceback" not in got.stderr, args
        assert "Could not connect to the endpoint URL" in got.stderr, (args, got.stderr)
        assert len(got.stderr.strip().splitlines()) == 1, (args, got.stderr)


def test_report_and_export_say_what_to_give_as_the_other_commands_do(tmp_path):
    """A URL, a missing path, one checkpoint: `report` and `export` said "no such checkpoint
    directory" (found 2026-12-06 by a first-contact walk through the docs) where `ls`,
    `inspect` and `gc` say what DIR must be and how to reach a remote store."""
    for args in (("report", "s3://bucket/run1"), ("export", "s3://bucket/run1", "out")):
        r = cli(*args)
        assert r.returncode == 2 and "is a remote store's URL" in r.stderr, r.stderr
        assert "resilient-ckpt pull s3://bucket/run1 DIR" in r.stderr
    for args in (("report", str(tmp_path / "nope")), ("export", str(tmp_path / "nope"), "out")):
        r = cli(*args)
        assert r.returncode == 2 and "the one passed to Checkpointer(...)" in r.stderr, r.stderr


def test_a_quoted_tilde_in_a_path_is_the_home_folder(tmp_path, monkeypatch):
    """``DIR="~/ckpts"`` in a script, ``--output=~/r.html``: no shell expands the ``~``, and
    every command said "no such directory"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # (a literal ~ folder would be made here)
    with Checkpointer(tmp_path / "run", keep_last=3, async_save=False) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"model": torch.nn.Linear(2, 2)})
    for args in (
        ("ls", "~/run"),
        ("verify", "~/run"),
        ("inspect", "~/run"),
        ("push", "~/run", "~/durable"),
        ("pull", "~/durable", "~/pulled"),
        ("gc", "~/run", "--keep-last", "1"),
        ("export", "~/run", "~/exported"),
    ):
        r = cli(*args)
        assert r.returncode == 0, (args, r.stderr)
    assert not (tmp_path / "~").exists() and os.listdir(tmp_path / "exported")
    assert os.listdir(tmp_path / "pulled") and os.listdir(tmp_path / "durable")


def test_inspect_of_keys_as_users_name_them_prints_them_whole_and_keeps_the_listing_narrow(
    tmp_path, capsys
):
    """Keys with dots, slashes, spaces, %, #, ?, = and unicode, and keys of more than 255
    bytes (no key becomes a file name): they round-trip, inspect names each whole, and one
    600-character key no longer pads every other row of the listing to its width."""
    long_a, long_b = "k" * 300, "ü" * 150  # (300 bytes in UTF-8)
    state = {
        "a.b": {"c/d": torch.ones(4)},
        "sp ace %20 #x ?y=z+1": torch.full((2,), 2.0),
        long_a: {long_b: torch.full((3,), 3.0)},
        "meta": {"é/ü.名": 1},
    }
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, state)
    assert all(len(n.encode()) < 100 for _, ds, fs in os.walk(tmp_path / "ck") for n in ds + fs)
    back = {"a.b": {"c/d": None}, "sp ace %20 #x ?y=z+1": None, long_a: {long_b: None}}
    back["meta"] = {"é/ü.名": None}
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.restore(back) == 1
    assert (
        torch.equal(back[long_a][long_b], torch.full((3,), 3.0)) and back["meta"] == state["meta"]
    )
    assert main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    keys = {k["key"] for k in json.loads(capsys.readouterr().out)["keys"]}
    assert {"a.b.c/d", "sp ace %20 #x ?y=z+1", f"{long_a}.{long_b}", "meta.é/ü.名"} <= keys
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any(r.strip().startswith(f"{long_a}.{long_b}  float32") for r in rows), rows
    short = [r for r in rows if r.lstrip().startswith(("a.b.c/d", "sp ace", "meta."))]
    assert len(short) == 3 and max(len(r) for r in short) < 100, short
