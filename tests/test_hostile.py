"""Checkpoints tampered with or damaged, and run directories with links planted in them: the
library refuses or falls back, loudly, and never reads, writes or deletes outside the run
directory. (Path names, checksums, torn files, pickle: tests/test_checkpointer.py,
tests/test_cli_corrupt.py, tests/test_dcp_storage.py.)"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from resilient_callbacks import Checkpointer, CheckpointError, ResumeFallbackWarning
from resilient_callbacks.cli import main
from resilient_callbacks.manifest import SELF_CHECKSUM, self_checksum
from torch_needs import needs_dcp


def _run(root, steps=(10, 20, 30), **kw) -> None:
    with Checkpointer(root, **kw) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((64,), float(s))})


def _edit_manifest(ckpt, **changes) -> None:
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    for k, v in changes.items():
        if k == "first_path":
            m["files"][0]["path"] = v
        else:
            m[k] = v
    m[SELF_CHECKSUM] = self_checksum(m)  # sealed again: a tampering that knows the format
    with open(path, "w") as f:
        f.write(json.dumps(m) if "nested" not in changes else "[" * 100000 + "]" * 100000)


@pytest.mark.parametrize(
    "change",
    [
        {"first_path": 7},
        {"step": float("inf")},
        {"format_version": "v2"},
        {"created": 1e308 * 10},
        {"nested": True},
    ],
    ids=["path-number", "step-inf", "version-string", "created-inf", "deeply-nested"],
)
def test_one_malformed_manifest_is_a_corrupt_checkpoint_not_a_broken_directory(
    tmp_path, change, capsys
):
    root = str(tmp_path / "ck")
    _run(root)
    _edit_manifest(os.path.join(root, "step_000000030"), **change)
    state = {"w": torch.zeros(64)}
    with pytest.warns(ResumeFallbackWarning), Checkpointer(root) as ck:
        assert ck.restore(state) == 20
    with Checkpointer(root, resume="never") as ck:  # a fresh run can start there too
        assert ck.restore({"w": torch.zeros(64)}) == 0
    for cmd in (["ls", root], ["verify", root], ["inspect", root], ["gc", root, "--dry-run"]):
        assert main(cmd) in (0, 1), cmd
        assert "Traceback" not in capsys.readouterr().err


def _rewrite_checked(ckpt, name, edit) -> None:
    """Edit the JSON file ``name`` of checkpoint ``ckpt`` and recompute its size and checksum
    in the manifest, as a tool that rewrites checkpoints would (the damage is in the content)."""
    from resilient_callbacks.filewrite import digest_file

    path = os.path.join(ckpt, name)
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    mpath = os.path.join(ckpt, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    entry = next(e for e in m["files"] if e["path"] == name)
    d = digest_file(path, entry["xxh3_64"])
    entry["size"], entry["xxh3_64"] = d.size, d.xxh3_64
    with open(mpath, "w") as f:
        json.dump(m, f)


def _extra(node):
    return node["structure"]["extra"]


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        (
            "shared.json",
            lambda d: _extra(d).__setitem__("epoch", {"__rc__": "float", "value": "abc"}),
        ),
        (
            "shared.json",
            lambda d: _extra(d).__setitem__("epoch", {"__rc__": "device", "name": "x:3"}),
        ),
        (
            "shared.json",
            lambda d: _extra(d).__setitem__("epoch", {"__rc__": "np", "dtype": "foo", "value": 1}),
        ),
        (
            "shared.json",
            lambda d: d["structure"]["model"]["state"]["weight"].__setitem__("key", "nope"),
        ),
        (
            "rank_00000.json",
            lambda d: d.__setitem__("rng", {"python": {"version": 3, "state": "x"}}),
        ),
    ],
    ids=["float", "device", "np", "tensor-key", "rng"],
)
def test_a_structure_that_does_not_decode_is_corrupt_and_nothing_is_loaded(tmp_path, name, edit):
    """Files that verify but whose content does not decode (found 2026-11-25: a raw
    ValueError/KeyError/RuntimeError after the model had been overwritten): the checkpoint is
    corrupt, the restore falls back, and what it loads is the older checkpoint, whole."""
    root = str(tmp_path / "ck")
    with Checkpointer(root) as ck:
        for s in (10, 20):
            m = torch.nn.Linear(4, 2)
            torch.nn.init.constant_(m.weight, float(s))
            ck.save(s, {"model": m, "extra": {"epoch": s}})
    _rewrite_checked(os.path.join(root, "step_000000020"), name, edit)
    state = {"model": torch.nn.Linear(4, 2), "extra": {"epoch": 0}}
    with pytest.warns(ResumeFallbackWarning, match="step 20"), Checkpointer(root) as ck:
        assert ck.restore(state) == 10
    assert torch.equal(state["model"].weight, torch.full((2, 4), 10.0))
    assert state["extra"] == {"epoch": 10}


def test_links_planted_in_the_run_directory_are_not_followed(tmp_path, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("keep me")
    root = tmp_path / "ck"
    root.mkdir()
    os.symlink(victim, root / ".lock")
    with pytest.raises(CheckpointError, match="symbolic link"):
        Checkpointer(root)
    assert victim.read_text() == "keep me"

    os.remove(root / ".lock")
    blob_name = "0" * 32 + ".safetensors"
    (outside / blob_name).write_bytes(b"another run's blob")
    os.symlink(outside, root / "blobs")
    os.symlink(victim, root / "history.jsonl")
    _run(root, steps=(1, 2), incremental=True, keep_last=1)
    assert (outside / blob_name).exists() and victim.read_text() == "keep me"
    assert "is a symbolic link" in caplog.text


def test_gc_remote_deletes_only_its_own_leftovers(tmp_path, monkeypatch):
    from resilient_callbacks import cli_remote_gc

    remote = tmp_path / "remote"
    _run(tmp_path / "ck", steps=(10,), remote=f"file://{remote}")
    (remote / "final_model").mkdir()
    (remote / "final_model" / "model.safetensors").write_bytes(b"x" * 10)
    (remote / "step_000000099").mkdir()  # an upload a crash cut off
    (remote / "step_000000099" / "shared.safetensors").write_bytes(b"x")
    old = time.time() - 3 * 24 * 3600
    for p in (
        remote / "final_model" / "model.safetensors",
        remote / "step_000000099" / "shared.safetensors",
    ):
        os.utime(p, (old, old))
    monkeypatch.setattr(cli_remote_gc, "STALE_UPLOAD_S", 3600.0)
    assert main(["gc", str(tmp_path / "nowhere"), "--remote", f"file://{remote}"]) == 0
    assert (remote / "final_model" / "model.safetensors").exists()
    assert not (remote / "step_000000099").exists()


@needs_dcp
def test_the_dcp_reader_reads_only_files_the_manifest_lists(tmp_path):
    """A dcp_metadata.json tampered (its checksum recomputed) to name a file outside the
    checkpoint: that checkpoint is refused and the reader falls back; nothing outside is read."""
    import torch.distributed.checkpoint as dcp

    from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter
    from resilient_callbacks.filewrite import digest_file

    root = tmp_path / "ck"
    with ResilientStorageWriter(root) as w:
        for step in (1, 2):
            dcp.save({"w": torch.full((4,), float(step))}, storage_writer=w, checkpoint_id=step)
    ckpt = root / "step_000000002"
    meta_path = ckpt / "dcp_metadata.json"
    text = meta_path.read_text()
    name = "dcp/rank_00000.safetensors"
    assert f'"{name}"' in text
    meta_path.write_text(text.replace(f'"{name}"', '"../../outside/evil.safetensors"'))
    m = json.loads((ckpt / "manifest.json").read_text())
    entry = next(f for f in m["files"] if f["path"] == "dcp_metadata.json")
    d = digest_file(str(meta_path), entry["xxh3_64"])
    entry["size"], entry["xxh3_64"] = d.size, d.xxh3_64
    m[SELF_CHECKSUM] = self_checksum(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))
    sd = {"w": torch.zeros(4)}
    with pytest.warns(ResumeFallbackWarning, match="outside its checkpoint directory"):
        dcp.load(sd, storage_reader=ResilientStorageReader(root))
    assert torch.equal(sd["w"], torch.full((4,), 1.0))
