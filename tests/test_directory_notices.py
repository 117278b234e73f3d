"""A checkpoint directory that is not as the library left it: what a run there says, and that
the commit order stays right. Each case was found by driving the library as a user would:

- a manifest the library refuses (a newer format) or cannot read: commits made beside it took
  its commit number again, so once it was readable a restore chose it over newer commits;
- ``step_*`` folders without a manifest: a restore started fresh without a word;
- a ``dirpath`` one level above the checkpoints: a fresh start without a word (a read-only
  restore returned 0 and an evaluation ran on an untrained model);
- a ``dirpath`` of checkpoints written by plain ``dcp.save``: a fresh start without a word, or
  its ``step_*`` checkpoints called damaged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings

import pytest
import torch

from resilient_callbacks import Checkpointer, ResumeFallbackWarning, catalog
from resilient_callbacks.catalog import Depth


def _state(v: float = 0.0) -> dict:
    return {"w": torch.full((4,), v), "extra": {"n": 0}}


def _run(root, steps, **kw) -> list[str]:
    names = []
    with Checkpointer(root, async_save=False, **kw) as ck:
        ck.restore(_state())
        for s in steps:
            ck.save(s, _state(float(s)))
            names.append(os.path.basename(ck.last_save.path))
    return names


def _manifest(root, name) -> str:
    return os.path.join(root, name, "manifest.json")


def _restored(root) -> tuple[int, float]:
    state = _state()
    with Checkpointer(root, read_only=True) as ck:
        step = ck.restore(state)
    return step, float(state["w"][0])


def test_commits_beside_a_manifest_of_a_newer_format_are_newer_than_it(tmp_path):
    """An older library skips a checkpoint of a newer format (it cannot load it), resumes from
    the one before, and commits new checkpoints: they must be newer than the skipped one when
    the newer library reads the directory again."""
    root = tmp_path / "run"
    names = _run(root, [40, 50, 60])
    path = _manifest(root, names[-1])
    with open(path) as f:
        saved = json.load(f)
    newer = dict(saved, format_version=99)
    with open(path, "w") as f:
        json.dump(newer, f)
    newer_warns = pytest.warns(ResumeFallbackWarning, match="newer than this library")
    with newer_warns, Checkpointer(root, async_save=False) as ck:
        assert ck.restore(_state()) == 50
        ck.save(55, _state(55.0))
        fresh = os.path.basename(ck.last_save.path)
    seqs = {e.name: e.manifest.seq for e in catalog.scan(str(root), Depth.NONE) if e.manifest}
    assert seqs[fresh] > saved["seq"], (seqs, saved["seq"])
    with open(path, "w") as f:  # the newer library again: 55 was committed last
        json.dump(saved, f)
    assert _restored(root) == (55, 55.0)


def test_a_manifest_that_cannot_be_read_is_named_when_its_order_is_unknown(tmp_path, caplog):
    root = tmp_path / "run"
    names = _run(root, [40, 50])
    os.remove(_manifest(root, names[-1]))
    os.mkdir(_manifest(root, names[-1]))  # there, but no file can be read from it
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumeFallbackWarning)
        _run(root, [45])
    said = [r.getMessage() for r in caplog.records if "commit order" in r.getMessage()]
    assert len(said) == 1 and names[-1] in said[0], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("also_valid", [False, True], ids=["only", "beside-a-checkpoint"])
def test_step_folders_without_a_manifest_are_named_at_restore(tmp_path, also_valid):
    root = tmp_path / "run"
    names = _run(root, [40, 50, 60])
    stripped = names[1:] if also_valid else names
    for name in stripped:
        os.remove(_manifest(root, name))
    with pytest.warns(UserWarning) as got, Checkpointer(root, async_save=False) as ck:
        step = ck.restore(_state())
    assert step == (40 if also_valid else 0)
    (said,) = [w for w in got if "no manifest.json" in str(w.message)]
    assert not isinstance(said.message, ResumeFallbackWarning)  # no checkpoint was skipped
    msg = str(said.message)
    assert all(name in msg for name in stripped), msg
    assert ("not loaded" if also_valid else "starting without a checkpoint") in msg


def test_a_dirpath_above_the_checkpoints_names_the_subdirectory(tmp_path):
    _run(tmp_path / "runs" / "run1", [10, 20])
    said = pytest.warns(UserWarning, match=r"run1 \(2\)")
    with said as got, Checkpointer(tmp_path / "runs", async_save=False) as ck:
        assert ck.restore(_state()) == 0
    assert "starting fresh" in str(got[0].message)
    with pytest.warns(UserWarning, match=r"read_only restore: no checkpoint .*run1 \(2\)"):
        assert _restored(tmp_path / "runs") == (0, 0.0)


def test_a_first_run_in_an_empty_directory_says_nothing(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(tmp_path / "run", [10])
        shutil.rmtree(tmp_path / "run")
        os.mkdir(tmp_path / "empty")
    with pytest.warns(UserWarning, match="read_only restore: no checkpoint"):
        assert _restored(tmp_path / "empty") == (0, 0.0)


def test_a_dirpath_above_a_dataset_is_not_statted_file_by_file(tmp_path, monkeypatch):
    """A fresh start in a project directory that holds a dataset (thousands of files): the
    search for checkpoints in subdirectories, and the scans, asked the filesystem about every
    file (a stat each: minutes on a shared filesystem, with every other rank waiting); they go
    by names and the listing's entry types, and look at a bounded number of entries."""
    images = tmp_path / "proj" / "data" / "images"
    images.mkdir(parents=True)
    n = catalog.HINT_MAX_ENTRIES + 500
    for i in range(n):
        (images / f"{i}.jpg").touch()
    _run(tmp_path / "proj" / "runs" / "run1", [10])
    calls = []
    isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: calls.append(p) or isdir(p))
    said = pytest.warns(UserWarning, match=r"runs/run1 \(1\)")
    with said, Checkpointer(tmp_path / "proj", async_save=False) as ck:
        assert ck.restore(_state()) == 0
    assert len(calls) < 100, len(calls)


def test_a_torn_manifest_is_called_damaged_not_unreadable(tmp_path, caplog):
    """A torn manifest was reported as one to "fix its permissions" that could "be read again";
    it is damaged, and said so."""
    root = tmp_path / "run"
    names = _run(root, [10, 20])
    with open(_manifest(root, names[-1]), "w") as f:
        f.write('{"format_version": 1, "ste')
    caplog.set_level(logging.WARNING, "resilient_callbacks")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumeFallbackWarning)
        _run(root, [30])
    said = [r.getMessage() for r in caplog.records if names[-1] in r.getMessage()]
    assert any("is damaged: not JSON" in m for m in said), said
    assert not any("permissions" in m for m in said), said


def _plain_dcp(path) -> None:
    """The files plain ``dcp.save`` (FileSystemWriter) leaves: a pickled .metadata, *.distcp."""
    os.makedirs(path)
    for name in (".metadata", "__0_0.distcp"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"\x80\x04.")


@pytest.mark.parametrize("layout", ["itself", "step_100", "checkpoint-100"])
def test_plain_dcp_checkpoints_are_named_as_such_with_how_to_read_them(tmp_path, layout, capsys):
    from resilient_callbacks.cli import main

    root = tmp_path / "old"
    where = root if layout == "itself" else root / layout
    _plain_dcp(where)
    with pytest.warns(UserWarning) as got, Checkpointer(root, async_save=False) as ck:
        assert ck.restore(_state()) == 0
    (said,) = [str(w.message) for w in got]
    assert "written by plain dcp.save" in said and "starting fresh" in said, said
    assert f"plain_dcp_reader({str(where)!r}, allow_pickle=True)" in said, said
    assert "no manifest.json" not in said  # not called damaged
    assert main(["verify", str(root)]) != 0
    err = capsys.readouterr().err
    assert "written by plain dcp.save" in err and "plain_dcp_reader(" in err, err


def test_a_plain_dcp_checkpoint_beside_ours_is_neither_verified_nor_collected(tmp_path, capsys):
    """A run moved to this library in its old directory: `gc` deleted the old plain dcp.save
    ``step_100`` (the user's last checkpoint of the old run) as a torn checkpoint of ours."""
    from resilient_callbacks.cli import main

    root = tmp_path / "old"
    _plain_dcp(root / "step_100")
    with pytest.warns(UserWarning, match=r"plain dcp\.save"):
        _run(root, [200])
    assert main(["verify", str(root)]) == 0
    assert main(["gc", str(root)]) == 0
    assert os.path.isfile(root / "step_100" / ".metadata")


def test_a_relative_dirpath_is_resolved_once_and_a_fresh_start_names_where_it_looked(
    tmp_path, monkeypatch, caplog
):
    """A script that changes its working directory after making the Checkpointer keeps
    saving where it began; a restart from another working directory finds nothing there,
    and the log line says the absolute directory it looked in, and against what it was
    resolved (it said nothing at all)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with Checkpointer("ckpts/run1", async_save=False) as ck:
        ck.save(1, _state(1.0))
        os.chdir(tmp_path / "b")
        ck.save(2, _state(2.0))
    steps = [e.manifest.step for e in catalog.scan(str(tmp_path / "a" / "ckpts" / "run1"))]
    assert sorted(steps) == [1, 2]
    assert not os.listdir(tmp_path / "b")
    caplog.set_level(logging.INFO, "resilient_callbacks")
    with Checkpointer("ckpts/run1", async_save=False) as ck:
        assert ck.restore(_state()) == 0
    said = [r.getMessage() for r in caplog.records]
    where = f"no checkpoint in {tmp_path / 'b' / 'ckpts' / 'run1'} (dirpath='ckpts/run1', "
    assert any(m.startswith(where) and f"directory {tmp_path / 'b'} when" in m for m in said)


def test_a_relative_resume_path_is_resolved_when_the_checkpointer_is_made_as_dirpath(
    tmp_path, monkeypatch
):
    """``resume=<relative path>`` and a relative ``dirpath``, then a change of the working
    directory before restore() (Hydra's job folder, a script's os.chdir): both are resolved
    against the directory the Checkpointer was made in. The path was resolved at restore():
    'no checkpoint at <the new directory>/ckpts/run1/step_1'."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with Checkpointer("ckpts/run1", async_save=False) as ck:
        ck.save(1, _state(1.0))
        ck.save(2, _state(2.0))
    with Checkpointer("ckpts/run1", resume="ckpts/run1/step_000000001", async_save=False) as ck:
        os.chdir(tmp_path / "b")
        state = _state()
        assert ck.restore(state) == 1 and float(state["w"][0]) == 1.0
        assert ck.dirpath == str(tmp_path / "a" / "ckpts" / "run1")
    assert ck.restored_from == str(tmp_path / "a" / "ckpts" / "run1" / "step_000000001")


def _hydra_job(job, started_in, mode: str = "RUN") -> None:
    """The .hydra/ folder Hydra 1.3 writes in a job's output folder (hydra.yaml, trimmed)."""
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "hydra.yaml").write_text(
        f"hydra:\n  mode: {mode}\n  run:\n    dir: outputs/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}\n  job:\n"
        f"    chdir: true\n  runtime:\n    version: 1.3.2\n    version_base: '1.3'\n"
        f"    cwd: {started_in}\n    output_dir: {job}\n"
    )
    (job / ".hydra" / "config.yaml").write_text("lr: 0.1\n")


def test_a_relative_dirpath_in_a_hydra_job_folder_warns_and_names_the_earlier_run(
    tmp_path, monkeypatch
):
    """Hydra runs each job in a new working directory (outputs/<date>/<time>, holding
    .hydra/): a relative dirpath never finds the previous run's checkpoints. Each run says
    so at its fresh start, a restart naming the folder that holds them."""
    earlier = tmp_path / "outputs" / "2026-12-06" / "23-59-01"
    later = tmp_path / "outputs" / "2026-12-07" / "00-10-42"
    for job in (earlier, later):
        _hydra_job(job, started_in=tmp_path)
    monkeypatch.chdir(earlier)
    said = pytest.warns(UserWarning, match="a folder Hydra made")
    with said as got, Checkpointer("ckpts", async_save=False) as ck:
        assert ck.restore(_state()) == 0  # the first run already: before any work is lost
        ck.save(5, _state(5.0))
    assert "holds an earlier run's" not in str(got[0].message)
    monkeypatch.chdir(later)
    said = pytest.warns(UserWarning, match="a folder Hydra made")
    with said as got, Checkpointer("ckpts", async_save=False) as ck:
        assert ck.restore(_state()) == 0
    said = " ".join(str(got[0].message).split())
    assert f"{earlier / 'ckpts'} holds an earlier run's" in said, said
    assert "hydra.utils.get_original_cwd()" in said and "hydra.job.chdir=False" in said


@pytest.mark.parametrize("how", ["run-in-place", "no-record"])
def test_a_hydra_folder_of_a_job_that_stays_in_its_folder_warns_nothing(
    tmp_path, monkeypatch, caplog, how
):
    """``hydra.run.dir=.`` runs every job in the project folder, which then holds .hydra/:
    a relative dirpath is the same folder at each run, and the warning that it is a new one
    (with the advice to make it absolute) was false at every fresh start. A .hydra/ without
    Hydra's record (a user's own folder of that name) is no job folder either."""
    proj = tmp_path / "proj"
    if how == "run-in-place":
        _hydra_job(proj, started_in=proj)
    else:
        (proj / ".hydra").mkdir(parents=True)
    monkeypatch.chdir(proj)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpointer("ckpts", async_save=False) as ck:
            assert ck.restore(_state()) == 0
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"no checkpoint in {proj / 'ckpts'} ") for m in said), said


def test_a_job_of_a_hydra_sweep_is_not_told_to_share_one_folder(tmp_path, monkeypatch):
    """A multirun's jobs run in multirun/<date>/<time>/<n>, each with its own config: the
    warning named a sibling job's checkpoints as "an earlier run's" and advised one absolute
    folder (or hydra.job.chdir=False) for all, which would mix the jobs' checkpoints."""
    sweep = tmp_path / "multirun" / "2026-12-07" / "00-10-42"
    for n in ("0", "1"):
        _hydra_job(sweep / n, started_in=tmp_path, mode="MULTIRUN")
    _run(sweep / "0" / "ckpts", [5])
    monkeypatch.chdir(sweep / "1")
    with pytest.warns(UserWarning, match="sweep") as got, Checkpointer("ckpts") as ck:
        assert ck.restore(_state()) == 0
    said = " ".join(str(got[0].message).split())
    assert "holds an earlier run's" not in said and str(sweep / "0") not in said, said
    assert "override_dirname" in said and "hydra.job.chdir=False" not in said, said


def test_an_outputs_folder_of_many_runs_is_searched_newest_first_and_bounded(tmp_path, monkeypatch):
    """The search for an earlier run's checkpoints read every run folder under outputs/ (an
    outputs folder that holds thousands of runs, read at each fresh start): it looks in the
    newest run folders first, at most ``EARLIER_RUNS_LOOKED`` of them, names the newest that
    holds checkpoints, and where none of those does, says how far it looked."""
    from resilient_callbacks import notices

    monkeypatch.setattr(notices, "EARLIER_RUNS_LOOKED", 20)
    outputs = tmp_path / "outputs"
    runs = [outputs / f"2026-12-0{d}" / f"{h:02d}-00-00" for d in range(1, 6) for h in range(12)]
    for job in runs:  # 60 earlier runs, each with an empty checkpoint folder
        (job / "ckpts").mkdir(parents=True)
    _run(runs[0] / "ckpts", [3])  # the oldest holds checkpoints: past the bound
    now = outputs / "2026-12-09" / "10-00-00"
    _hydra_job(now, started_in=tmp_path)
    looked: list[str] = []
    real = notices._holds
    monkeypatch.setattr(notices, "_holds", lambda p: (looked.append(p), real(p))[1])
    monkeypatch.chdir(now)
    with pytest.warns(UserWarning, match="a folder Hydra made") as got, Checkpointer("ckpts") as ck:
        assert ck.restore(_state()) == 0
    said = " ".join(str(got[0].message).split())
    assert len(looked) == 20 and looked[0] == str(runs[-1] / "ckpts"), looked
    assert f"none of the newest 20 earlier run folders in {outputs}" in said, said
    _run(runs[-5] / "ckpts", [4])  # the fifth newest: found, and the search stops there
    looked.clear()
    with pytest.warns(UserWarning, match="a folder Hydra made") as got, Checkpointer("ckpts") as ck:
        assert ck.restore(_state()) == 0
    said = " ".join(str(got[0].message).split())
    assert f"{runs[-5] / 'ckpts'} holds an earlier run's" in said and len(looked) == 5, said
