"""The CLI never deletes what is not its own: ``export --force`` replaces only an empty folder
or an earlier export, never the checkpoints it reads (or a folder holding them); ``gc`` removes
a ``step_<n>`` folder without a manifest only in a directory this library wrote."""

from __future__ import annotations

import json
import os

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.cli import main


def _run(root: str, steps=(1, 2, 3)) -> None:
    with Checkpointer(root, every_n_steps=1) as ck:
        for s in steps:
            ck.step(s, {"model": torch.nn.Linear(3, 2)})


def _tree(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), path) for d, _, files in os.walk(path) for n in files
    )


def test_export_force_never_deletes_the_checkpoints_or_a_folder_not_an_export(tmp_path, capsys):
    """OUT == DIR, a folder holding DIR, a checkpoint in DIR, or any non-empty folder that is not
    an earlier export: refused with --force (it was deleted and replaced by the export)."""
    proj = tmp_path / "proj"
    ck = proj / "ck"
    _run(str(ck))
    (proj / "train.py").write_text("print('mine')\n")
    models = tmp_path / "models"
    models.mkdir()
    (models / "other.bin").write_text("w")
    before = _tree(proj)
    cases = [  # (2: an OUT that can never be right; 1: one whose contents refuse it)
        (ck, "is the checkpoint directory", 2),
        (proj, "holds the checkpoint directory", 2),
        (ck / "step_000000002", "lies inside the checkpoint directory", 2),
        (ck / "exported", "lies inside the checkpoint directory", 2),
        (models, "--force would delete what it holds (other.bin)", 1),
    ]
    for out, said, code in cases:
        capsys.readouterr()
        assert main(["export", str(ck), str(out), "--force"]) == code, out
        err = capsys.readouterr().err
        assert said in err, err
    # DIR given as one checkpoint: its siblings and its directory are refused too
    assert main(["export", str(ck / "step_000000003"), str(ck / "step_000000002"), "--force"]) == 2
    assert main(["export", str(ck / "step_000000003"), str(ck), "--force"]) == 2
    assert _tree(proj) == before
    assert _tree(models) == ["other.bin"]

    # an empty folder, and then the export written there, are replaced
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", str(ck), str(out), "--force"]) == 0
    assert json.loads((out / "export.json").read_text())["step"] == 3
    assert main(["export", str(ck), str(out), "--step", "2", "--force"]) == 0
    assert json.loads((out / "export.json").read_text())["step"] == 2
    assert main(["export", str(ck), str(out)]) == 1  # without --force: refused
    assert "pass --force" in capsys.readouterr().err


def test_export_pretrained_overwrite_has_the_same_guard(tmp_path):
    pytest.importorskip("transformers")
    from resilient_callbacks.errors import ConfigError
    from resilient_callbacks.transformers import export_pretrained

    proj = tmp_path / "proj"
    ck = proj / "ck"
    _run(str(ck))
    before = _tree(proj)
    for out in (ck, proj, ck / "step_000000001"):
        with pytest.raises(ConfigError, match="checkpoint directory"):
            export_pretrained(ck, out, overwrite=True)
    assert _tree(proj) == before


def test_a_refused_overwrite_names_the_callers_own_switch(tmp_path, capsys):
    """The CLI said "pass --force (overwrite=True)": the Python argument in a CLI message. The
    CLIs name ``--force``, the Python API ``overwrite=True``, each only its own."""
    pytest.importorskip("transformers")
    from resilient_callbacks.errors import ConfigError
    from resilient_callbacks.transformers import export_pretrained
    from resilient_callbacks.transformers.__main__ import main as hf_main

    ck = tmp_path / "ck"
    _run(str(ck))
    taken, models = tmp_path / "taken", tmp_path / "models"
    taken.mkdir()
    models.mkdir()
    (models / "other.bin").write_text("w")
    for cli in (main, hf_main):
        capsys.readouterr()
        assert cli(["export", str(ck), str(taken)]) == 1
        err = capsys.readouterr().err
        assert "pass --force to replace" in err and "overwrite=True" not in err, err
        assert cli(["export", str(ck), str(models), "--force"]) == 1
        err = capsys.readouterr().err
        assert "--force would delete" in err and "overwrite=True" not in err, err
    with pytest.raises(ConfigError, match="pass overwrite=True to replace") as info:
        export_pretrained(ck, taken)
    assert "--force" not in str(info.value)
    with pytest.raises(ConfigError, match="overwrite=True would delete") as info:
        export_pretrained(ck, models, overwrite=True)
    assert "--force" not in str(info.value)
    assert _tree(models) == ["other.bin"]


@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_json_with_nothing_to_delete_prints_json(tmp_path, capsys, dry_run):
    """``gc --json`` of a directory without checkpoints: the usual object, empty lists, the note
    on stderr (it printed the note as plain text on stdout)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["gc", str(empty), "--json"] + (["--dry-run"] if dry_run else [])
    assert main(args) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["dir"] == str(empty) and got["dry_run"] is dry_run and got["run_id"] is None
    assert got["delete"] == got["keep"] == got["failed"] == got["blobs_deleted"] == []
    assert ("blobs_since_newest" in got) is dry_run
    assert "nothing to delete: no checkpoints in" in err
    # the same keys as a gc that found checkpoints
    _run(str(tmp_path / "ck"))
    capsys.readouterr()
    assert main(["gc", str(tmp_path / "ck"), "--json", *args[3:]]) == 0
    assert json.loads(capsys.readouterr().out).keys() == got.keys()


def test_gc_leaves_step_folders_alone_in_a_directory_not_ours(tmp_path, capsys):
    """Another tool's ``step_1000`` (no manifest) in a folder this library never wrote: gc
    deleted it as "incomplete" (and left a .lock there). Now it is left alone, and gc says why;
    in a directory of ours such a folder is still removed."""
    other = tmp_path / "other"
    (other / "step_1000").mkdir(parents=True)
    (other / "step_1000" / "pytorch_model.bin").write_text("w")
    for extra in ([], ["--dry-run"], ["--json"]):
        assert main(["gc", str(other), *extra]) == 0
        out, err = capsys.readouterr()
        assert "not ours to delete" in out + err, (out, err)
        assert "step_1000" in out + err and "would delete" not in out
    assert sorted(os.listdir(other)) == ["step_1000"]  # no .lock either
    assert (other / "step_1000" / "pytorch_model.bin").read_text() == "w"
    assert main(["ls", str(other)]) == 0
    assert "gc leaves it alone" in capsys.readouterr().out

    # ours: a history.jsonl (every checkpoint since deleted), or checkpoints with manifests
    (other / "history.jsonl").write_text("")
    assert main(["gc", str(other)]) == 0
    assert "deleted step_1000" in capsys.readouterr().out
    assert not (other / "step_1000").exists()
    ck = tmp_path / "ck"
    _run(str(ck))
    os.remove(ck / "history.jsonl")
    os.remove(ck / "latest")
    (ck / "step_000000099").mkdir()
    assert main(["gc", str(ck)]) == 0
    assert not (ck / "step_000000099").exists()


def test_verify_fails_on_a_step_folder_that_lost_its_manifest(tmp_path, capsys):
    """The newest ``step_<n>`` lost its manifest.json (``latest`` still names it): verify said
    ok (exit 0), checking the one before; and ``verify DIR/step_N`` said "no checkpoints in"."""
    ck = tmp_path / "ck"
    _run(str(ck))
    os.remove(ck / "step_000000003" / "manifest.json")
    assert (ck / "latest").read_text().strip() == "step_000000003"
    for extra in ([], ["--all"], ["--step", "3"]):
        capsys.readouterr()
        assert main(["verify", str(ck), *extra]) == 1, extra
        out = capsys.readouterr().out
        assert "INCOMPLETE" in out and "step_000000003: no manifest.json" in out, out
    assert main(["verify", str(ck), "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] is False and got["failed"] == 1
    bad = [c for c in got["checkpoints"] if c["status"] != "valid"]
    assert [(c["name"], c["status"]) for c in bad] == [("step_000000003", "incomplete")]
    assert main(["verify", str(ck), "--step", "2"]) == 0  # an older step, asked for, is fine
    capsys.readouterr()
    assert main(["verify", str(ck / "step_000000003")]) == 1
    err = capsys.readouterr().err
    assert "step_000000003 has no manifest.json" in err and "no checkpoints in" not in err, err
