"""Every resilient-ckpt command that shows a checkpoint's state, run over a copy of a real
checkpoint directory whose newest checkpoint was damaged: none may call it valid.

The directory holds steps 10, 20 and 30 written by the real Checkpointer; step 30 is damaged
one way per test (a byte flipped in a tensor file's data, a truncated file, a missing file, a
manifest with an edited checksum or size, a manifest that no longer parses).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.cli_format import status_text
from resilient_callbacks.manifest import SELF_CHECKSUM, self_checksum
from test_cli import cli

DAMAGED, DAMAGED_STEP = "step_000000030", "30"
VALID_WORD = re.compile(r"\bvalid\b", re.IGNORECASE)
# damages a check of sizes alone (ls --fast, inspect --fast) finds; the others need checksums
SEEN_BY_SIZES = {"truncated", "missing", "manifest-size", "manifest-garbled"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("pristine") / "ck")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    state = {"model": model, "extra": {"epoch": 1, "name": "run"}}
    with Checkpointer(root, keep_last=None) as ck:
        for s in (10, 20, 30):
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(s, state, metrics={"loss": 1.0 / s})
    return root


def _flip_in_data_region(path: str) -> None:
    """Flip one byte of the tensor data, after the safetensors header."""
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        offset = 8 + header_len + 4
        assert offset < os.path.getsize(path)
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _edit_manifest(ckpt: str, edit) -> None:
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    edit(next(e for e in m["files"] if e["path"] == "shared.safetensors"))
    m[SELF_CHECKSUM] = self_checksum(m)  # sealed again: a manifest that lists the wrong file
    with open(path, "w") as f:
        json.dump(m, f)


def _damage(ckpt: str, how: str) -> None:
    tensors = os.path.join(ckpt, "shared.safetensors")
    if how == "flipped":
        _flip_in_data_region(tensors)
    elif how == "truncated":
        os.truncate(tensors, os.path.getsize(tensors) // 2)
    elif how == "missing":
        os.remove(tensors)
    elif how == "manifest-checksum":
        _edit_manifest(ckpt, lambda e: e.update(xxh3_64="0123456789abcdef"))
    elif how == "manifest-size":
        _edit_manifest(ckpt, lambda e: e.update(size=e["size"] + 1))
    elif how == "manifest-garbled":
        with open(os.path.join(ckpt, "manifest.json"), "r+b") as f:
            f.seek(0)
            f.write(b"#")  # no longer JSON
    else:  # pragma: no cover
        raise AssertionError(how)


DAMAGES = [
    "flipped",
    "truncated",
    "missing",
    "manifest-checksum",
    "manifest-size",
    "manifest-garbled",
]


@pytest.fixture(params=DAMAGES)
def damaged(request, pristine, tmp_path) -> tuple[str, str]:
    root = str(tmp_path / "ck")
    shutil.copytree(pristine, root)
    before = cli("verify", root, "--all")
    assert before.returncode == 0, before.stdout + before.stderr  # the copy was good
    _damage(os.path.join(root, DAMAGED), request.param)
    return root, request.param


def _row(table: str, step: str) -> str:
    """The line of an ``ls`` table about ``step``."""
    rows = [line for line in table.splitlines() if line.split()[:1] == [step]]
    assert len(rows) == 1, table
    return rows[0]


def _lines_about(text: str, name: str) -> list[str]:
    lines = [line for line in text.splitlines() if name in line]
    assert lines, text
    return lines


def test_ls(damaged):
    root, _ = damaged
    r = cli("ls", root)
    assert r.returncode == 0, r.stderr
    row = _row(r.stdout, DAMAGED_STEP)
    assert not VALID_WORD.search(row) and "CORRUPT" in row
    assert VALID_WORD.search(_row(r.stdout, "20"))  # the good ones still are
    assert "not verified" not in r.stdout  # every checksum was read

    rows = {x["name"]: x for x in json.loads(cli("ls", root, "--json").stdout)}
    assert rows[DAMAGED]["status"] == "corrupt" and rows[DAMAGED]["problem"]
    assert rows["step_000000020"]["status"] == "valid"


def test_ls_fast_never_says_valid(damaged):
    root, how = damaged
    r = cli("ls", root, "--fast")
    assert r.returncode == 0, r.stderr
    row = _row(r.stdout, DAMAGED_STEP)
    assert not VALID_WORD.search(row)
    expected = "CORRUPT" if how in SEEN_BY_SIZES else "sizes ok, not verified"
    assert expected in row
    for step in ("10", "20"):  # sizes only: nothing is verified, so nothing is valid
        assert "sizes ok, not verified" in _row(r.stdout, step)

    rows = {x["name"]: x for x in json.loads(cli("ls", root, "--fast", "--json").stdout)}
    assert rows[DAMAGED]["status"] == ("corrupt" if how in SEEN_BY_SIZES else "unverified")
    assert all(x["status"] != "valid" for x in rows.values())


def test_verify_fails_on_the_damaged_newest(damaged):
    root, _ = damaged
    r = cli("verify", root)
    assert r.returncode == 1
    line = _lines_about(r.stdout, DAMAGED)
    assert all(x.startswith("CORRUPT") and not VALID_WORD.search(x) for x in line)
    assert "failed verification" in r.stderr

    j = cli("verify", root, "--json")
    assert j.returncode == 1
    res = json.loads(j.stdout)
    assert res["ok"] is False and res["failed"] >= 1
    bad = [c for c in res["checkpoints"] if c["name"] == DAMAGED]
    assert len(bad) == 1 and bad[0]["status"] == "corrupt" and bad[0]["problem"]

    every = cli("verify", root, "--all")
    assert every.returncode == 1
    assert {x.split()[-1] for x in every.stdout.splitlines() if x.startswith("ok ")} == {
        "step_000000010",
        "step_000000020",
    }


def test_inspect_skips_the_damaged_newest_and_says_so(damaged):
    root, _ = damaged
    r = cli("inspect", root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("step_000000020: step 20, valid")
    assert f"skipped {DAMAGED} (step 30): corrupt: " in r.stderr
    assert "showing step_000000020 (step 20), the newest valid checkpoint" in r.stderr

    j = cli("inspect", root, "--json")
    info = json.loads(j.stdout)
    assert j.returncode == 0 and info["name"] == "step_000000020" and info["status"] == "valid"
    assert DAMAGED in j.stderr


def test_inspect_of_the_damaged_checkpoint_says_corrupt(damaged):
    root, _ = damaged
    r = cli("inspect", root, "--step", DAMAGED_STEP)
    assert r.returncode == 1
    assert r.stdout.startswith(f"{DAMAGED}: step 30, CORRUPT: ")
    assert not VALID_WORD.search(r.stdout)

    j = cli("inspect", root, "--step", DAMAGED_STEP, "--json")
    assert j.returncode == 1
    info = json.loads(j.stdout)
    assert info["name"] == DAMAGED and info["status"] == "corrupt" and info["problem"]

    one = cli("inspect", os.path.join(root, DAMAGED))  # DIR may be the checkpoint itself
    assert one.returncode == 1 and not VALID_WORD.search(one.stdout)


def test_inspect_fast_never_says_valid(damaged):
    root, how = damaged
    r = cli("inspect", root, "--step", DAMAGED_STEP, "--fast")
    first = r.stdout.splitlines()[0]
    assert not VALID_WORD.search(first)
    if how in SEEN_BY_SIZES:
        assert r.returncode == 1 and "CORRUPT" in first
    else:
        assert r.returncode == 0 and "sizes ok, not verified" in first


def test_gc_dry_run(damaged):
    root, _ = damaged
    r = cli("gc", root, "--dry-run")
    assert r.returncode == 0, r.stderr
    for line in _lines_about(r.stdout, DAMAGED):
        assert not VALID_WORD.search(line) and "CORRUPT" in line
        # why it is kept, and how to delete it: a garbled manifest too (it said neither)
        assert f"not counted; remove with `resilient-ckpt gc {root} --remove-corrupt`" in line
    j = json.loads(cli("gc", root, "--dry-run", "--json").stdout)
    (row,) = [k for k in j["keep"] if k["name"] == DAMAGED]
    assert row["status"] == "corrupt" and row["kept"] is True, row
    assert row["kept_by"] and "--remove-corrupt" in row["kept_by"][0], row


def test_gc_never_deletes_the_newest_valid_checkpoint(damaged):
    """A damaged newest checkpoint whose sizes still match must not count as the one to keep:
    keep_last=1 keeps step 20, the newest valid one."""
    root, _ = damaged
    j = json.loads(cli("gc", root, "--dry-run", "--keep-last", "1", "--json").stdout)
    assert [d["step"] for d in j["delete"]] == [10]
    assert {k["name"]: k["status"] for k in j["keep"]} == {
        "step_000000020": "valid",
        DAMAGED: "corrupt",
    }
    done = cli("gc", root, "--keep-last", "1")
    assert done.returncode == 0, done.stderr
    assert cli("verify", root, "--step", "20").returncode == 0


@pytest.mark.parametrize(
    "damaged",
    # the entry point is one whatever the damage: each damage's verify is proven in-process
    # by test_verify_fails_on_the_damaged_newest (the same assertions and more); the others
    # as a fresh interpreter each (seconds of suite time) run with -m slow
    [pytest.param(d, marks=[] if d == "flipped" else pytest.mark.slow) for d in DAMAGES],
    indirect=True,
)
def test_the_real_executable(damaged):
    """The same, as a user runs it: a fresh interpreter, the module entry point."""
    root, _ = damaged
    run = [sys.executable, "-m", "resilient_callbacks"]
    v = subprocess.run([*run, "verify", root], capture_output=True, text=True, timeout=120)
    assert v.returncode == 1 and DAMAGED in v.stdout
    assert all(x.startswith("CORRUPT") for x in _lines_about(v.stdout, DAMAGED))


@pytest.mark.parametrize("checked", ["sizes", "manifest"])
def test_a_status_that_is_not_verified_never_reads_valid(checked):
    assert not VALID_WORD.search(status_text("unverified", checked))
    assert not VALID_WORD.search(status_text("valid", checked))  # valid needs checksums
    assert status_text("valid", "checksums") == "valid"


def test_inspect_and_export_name_a_newer_folder_without_its_manifest_they_pass_over(tmp_path):
    """The newest ``step_<n>`` folder lost its manifest.json: ``verify`` fails it and a restore
    warns, but ``inspect`` and ``export`` showed/exported the step before, saying nothing of
    the newer folder they passed over."""
    root = tmp_path / "ck"
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(8, 4)}
    with Checkpointer(str(root)) as ck:
        for s in (10, 20, 30):
            ck.save(s, state)
    os.remove(root / DAMAGED / "manifest.json")
    r = cli("inspect", str(root))
    assert r.returncode == 0 and r.stdout.startswith("step_000000020: step 20, valid"), r.stdout
    assert f"skipped {DAMAGED}: no manifest.json" in r.stderr, r.stderr
    assert "showing step_000000020 (step 20)" in r.stderr, r.stderr
    r = cli("export", str(root), str(tmp_path / "out"))
    assert r.returncode == 0 and "step_000000020" in r.stdout, r.stdout + r.stderr
    assert f"skipping {DAMAGED}: no manifest.json" in r.stderr, r.stderr
    # asked for step 20 by name: nothing passed over, nothing said
    assert cli("inspect", str(root), "--step", "20").stderr == ""


def test_verify_says_how_many_verify_all_checks_counting_folders_without_manifest(tmp_path):
    """The newest ``step_<n>`` folder lost its manifest: ``verify`` said "`verify DIR --all`
    checks all 2", and ``--all`` then checked (and listed) 3."""
    root = tmp_path / "ck"
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(8, 4)}
    with Checkpointer(str(root)) as ck:
        for s in (10, 20, 30):
            ck.save(s, state)
    os.remove(root / DAMAGED / "manifest.json")
    r = cli("verify", str(root))
    assert r.returncode == 1 and "--all` checks all 3" in r.stderr, r.stderr
    out = json.loads(cli("verify", str(root), "--all", "--json").stdout)
    assert len(out["checkpoints"]) == 3, out


def test_ls_lists_a_checkpoint_with_an_unreadable_manifest_by_its_step(pristine, tmp_path):
    """A manifest that no longer parses has no commit number: ``ls`` listed that checkpoint
    first, before older ones, though its rows are oldest first."""
    root = str(tmp_path / "ck")
    shutil.copytree(pristine, root)
    _damage(os.path.join(root, "step_000000020"), "manifest-garbled")
    os.makedirs(os.path.join(root, "step_000000040"))  # no manifest: still last
    rows = json.loads(cli("ls", root, "--json", "--fast").stdout)
    assert [(r["step"], r["seq"]) for r in rows][:2] == [(10, 1), (20, None)], rows
    assert [r["step"] for r in rows] == [10, 20, 30, 40], rows
    table = cli("ls", root, "--fast").stdout.splitlines()
    steps = [line.split()[0] for line in table[1:] if line.split()[:1] != []]
    assert steps[:4] == ["10", "20", "30", "40"], table


def test_ls_and_verify_name_a_step_folder_that_is_a_symbolic_link(pristine, tmp_path):
    """A ``step_<n>`` folder that is a symbolic link is never one of ours (no save makes one):
    ``ls`` and ``verify`` left it out without a word; they still do not follow it, and say so."""
    root = str(tmp_path / "ck")
    shutil.copytree(pristine, root)
    shutil.copytree(os.path.join(root, "step_000000030"), str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), os.path.join(root, "step_000000040"))
    link = os.path.join(root, "step_000000040")
    note = f"{link} is a symbolic link: not listed or checked; checkpoints are never links"
    r = cli("ls", root, "--json", "--fast")
    assert [row["step"] for row in json.loads(r.stdout)] == [10, 20, 30], r.stdout
    assert r.stderr.splitlines() == [f"resilient-ckpt ls: note: {note}"], r.stderr
    r = cli("verify", root, "--all")
    assert r.returncode == 0 and "step_000000040" not in r.stdout, r.stdout
    assert r.stderr.splitlines() == [f"resilient-ckpt verify: note: {note}"], r.stderr
    os.remove(link)
    assert cli("ls", root, "--fast").stderr == cli("verify", root).stderr == ""


def _reseal_structure(ckpt: str, content: bytes) -> None:
    """``shared.json`` replaced by ``content`` and its manifest entry (size, checksum) and the
    manifest's own checksum made to match: a checkpoint every checksum passes whose structure
    file is no structure (a writer's bug, or a tool's edit)."""
    import xxhash

    with open(os.path.join(ckpt, "shared.json"), "wb") as f:
        f.write(content)
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    entry = next(e for e in m["files"] if e["path"] == "shared.json")
    entry.update(size=len(content), xxh3_64=xxhash.xxh3_64_hexdigest(content))
    m[SELF_CHECKSUM] = self_checksum(m)
    with open(path, "w") as f:
        json.dump(m, f)


@pytest.mark.parametrize(
    "content, said",
    [
        (b"[1, 2]", "shared.json: not a structure file (a JSON list, not an object)"),
        (b'"text"', "shared.json: not a structure file (a JSON str, not an object)"),
        (b"{}", "shared.json names no structure"),
    ],
)
def test_a_structure_file_that_is_no_object_is_said_corrupt_not_a_traceback(
    pristine, tmp_path, content, said
):
    """A sealed ``shared.json`` holding a JSON list: ``export`` ended in a traceback of
    ``AttributeError: 'list' object has no attribute 'get'`` (a restore said it as "unreadable
    checkpoint (AttributeError ...)"); ``{}``, in ``KeyError``."""
    root = str(tmp_path / "ck")
    shutil.copytree(pristine, root)
    _reseal_structure(os.path.join(root, DAMAGED), content)
    r = cli("export", os.path.join(root, DAMAGED), str(tmp_path / "out"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert said in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize(
    "content, said",
    [
        (b"{}", "shared.json names no structure"),
        (b'{"structure": {}, "blobs": [1]}', "malformed blob references"),
    ],
)
def test_a_structure_file_naming_no_structure_is_said_before_the_tensors_are_read(
    pristine, tmp_path, content, said
):
    """That ``shared.json`` names a structure (and blob references a JSON object) was checked
    only after every tensor file and blob had been read and hashed: a restore read a large
    corrupt checkpoint in full before this cheap error. Here the tensor file also has a byte
    flipped, which only reading it finds: the structure's error is the one said (the tensor
    file unread), and the restore falls back to step 20 as before."""

    root = str(tmp_path / "ck")
    shutil.copytree(pristine, root)
    ckpt = os.path.join(root, DAMAGED)
    _reseal_structure(ckpt, content)
    _flip_in_data_region(os.path.join(ckpt, "shared.safetensors"))
    text = _restored_past_the_damaged(root)
    assert said in text and "checksum mismatch" not in text, text


@pytest.mark.parametrize("fast", [False, True])
def test_inspect_calls_a_structure_file_that_is_no_structure_corrupt(pristine, tmp_path, fast):
    """A sealed ``shared.json`` holding a JSON list (every checksum matching): ``inspect``
    said "valid", exit code 0, with "cannot read the keys (TypeError ...)" underneath, while
    a restore refuses it. Now it is corrupt, as a checkpoint with a bad checksum is (exit 1;
    in a directory, skipped for the newest valid one). The real executable, as a user runs it."""
    root = str(tmp_path / "ck")
    shutil.copytree(pristine, root)
    _reseal_structure(os.path.join(root, DAMAGED), b"[1, 2]")
    said = "shared.json: not a structure file (a JSON list, not an object)"
    flags = ["--fast"] if fast else []
    run = [sys.executable, "-m", "resilient_callbacks", "inspect"]
    r = subprocess.run(
        [*run, os.path.join(root, DAMAGED), *flags], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    first = r.stdout.splitlines()[0]
    assert first.startswith(f"{DAMAGED}: step 30, CORRUPT: ") and said in first, r.stdout
    assert not VALID_WORD.search(r.stdout) and "TypeError" not in r.stdout, r.stdout
    assert "keys:      cannot read the keys: shared.json is corrupt" in r.stdout, r.stdout
    shown = json.loads(cli("inspect", os.path.join(root, DAMAGED), "--json", *flags).stdout)
    assert shown["status"] == "corrupt" and shown["keys"] is None, shown
    r = subprocess.run([*run, root, *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("step_000000020: step 20, "), r.stdout
    assert f"skipped {DAMAGED} (step 30): corrupt: " in r.stderr and said in r.stderr, r.stderr


@pytest.mark.parametrize(
    "content, said",
    [
        (b"[1, 2]", "shared.json: not a structure file (a JSON list, not an object)"),
        (b"{}", "shared.json names no structure"),
    ],
)
def test_verify_and_ls_call_a_structure_file_that_is_no_structure_corrupt(
    pristine, tmp_path, content, said
):
    """A sealed ``shared.json`` that is no structure (every checksum matching): ``verify``
    printed "ok" (exit 0) and ``ls`` "valid" for a checkpoint that a restore refuses. Now both
    say corrupt, with ``--fast`` too (the structure file is read, no tensor), and a restore
    falls back to step 20 saying why. The real executable, as a user runs it."""

    root = str(tmp_path / "ck")
    shutil.copytree(pristine, root)
    _reseal_structure(os.path.join(root, DAMAGED), content)
    run = [sys.executable, "-m", "resilient_callbacks"]
    r = subprocess.run([*run, "verify", root], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = _lines_about(r.stdout, DAMAGED)
    assert all(x.startswith("CORRUPT") and said in x for x in line), r.stdout
    for flags in ([], ["--fast"]):
        r = subprocess.run([*run, "ls", root, *flags], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        row = _row(r.stdout, DAMAGED_STEP)
        assert "CORRUPT" in row and not VALID_WORD.search(row), r.stdout
        rows = {x["name"]: x for x in json.loads(cli("ls", root, "--json", *flags).stdout)}
        assert rows[DAMAGED]["status"] == "corrupt" and said in rows[DAMAGED]["problem"]
    text = _restored_past_the_damaged(root)
    assert DAMAGED in text and said in text, text


def _restored_past_the_damaged(root: str) -> str:
    """Restore ``root`` read-only: it falls back to step 20; the fallback warnings' text."""
    from resilient_callbacks import ResumeFallbackWarning

    state = {"model": torch.nn.Linear(8, 4), "extra": {"epoch": 0, "name": ""}}
    with (
        pytest.warns(ResumeFallbackWarning) as said_then,
        Checkpointer(root, keep_last=None, read_only=True) as ck,
    ):
        assert ck.restore(state) == 20
    return " ".join(str(w.message) for w in said_then)
