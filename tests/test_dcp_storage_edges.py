"""The drop-in ``ResilientStorageWriter`` / ``ResilientStorageReader`` against DCP options and
arguments that do not fit them: each is refused clearly, before anything is written or read,
never saved somewhere else or half-way.

One process (DCP runs without collectives); the planner is DCP's own.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from resilient_callbacks import catalog
from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter


class _CachingPlanner(DefaultSavePlanner):
    """DCP's plan caching (as Megatron-Core and others turn on), under a cache key of its own:
    DCP keeps the cached plans in class-level dicts keyed by the planner's class name."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def _steps(root) -> list[int]:
    return [e.step for e in catalog.committed(catalog.scan(str(root)))]


def test_a_planner_with_plan_caching_is_refused_at_the_first_save(tmp_path):
    """With ``enable_plan_caching=True`` DCP hands each rank, from the second save on, the plan
    of the save that filled its cache -- with that save's staging directory in it: the ranks
    wrote into the first save's (renamed) staging path, recreated, and the commit failed with
    "files listed in the manifest are not in the staging directory ... dirpath must be on a
    filesystem all ranks share". Refused at the first save, naming the option; nothing is
    committed or left behind, and a save without it goes on."""
    root = tmp_path / "ck"
    with ResilientStorageWriter(root) as w:
        for step in (1, 2):
            with pytest.raises(BaseException, match="enable_plan_caching") as caught:
                sd = {"t": torch.full((4,), float(step)), "epoch": step}
                dcp.save(sd, storage_writer=w, planner=_CachingPlanner(), checkpoint_id=step)
            assert "UnsupportedStateError" in str(caught.value)
        assert _steps(root) == []
        dcp.save({"t": torch.full((4,), 3.0), "epoch": 3}, storage_writer=w, checkpoint_id=3)
    assert _steps(root) == [3]
    assert not [n for n in os.listdir(root) if n.startswith(".staging-")]
    got = {"t": torch.zeros(4), "epoch": 0}
    dcp.load(got, storage_reader=ResilientStorageReader(root))
    assert torch.equal(got["t"], torch.full((4,), 3.0)) and got["epoch"] == 3


@pytest.mark.parametrize("url", ["s3://bucket/run1", "gs://bucket/run1"])
def test_an_object_store_url_as_dirpath_is_refused_not_written_under_the_cwd(
    tmp_path, monkeypatch, url
):
    """``ResilientStorageWriter("s3://bucket/run1")`` made it ``./s3:/bucket/run1`` (abspath)
    and saved there, on the local disk, silently; the reader (and ``dcp.load``'s
    ``checkpoint_id=`` URL) looked there. Refused as ``Checkpointer`` refuses it, pointing at
    ``remote=``; ``file://`` URLs and ``~`` stay local paths."""
    from resilient_callbacks.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"object-store URLs are not supported.*remote="):
        ResilientStorageWriter(url)
    with pytest.raises(ConfigError, match=r"object-store URLs are not supported.*remote="):
        ResilientStorageReader(url)
    with pytest.raises(BaseException, match=r"checkpoint_id=.*object-store URLs"):
        dcp.load(
            {"t": torch.zeros(2)},
            storage_reader=ResilientStorageReader(tmp_path),
            checkpoint_id=url,
        )
    assert os.listdir(tmp_path) == []
    with ResilientStorageWriter(f"file://{tmp_path}/ck") as w:
        dcp.save({"t": torch.ones(2)}, storage_writer=w, checkpoint_id=1)
    assert _steps(tmp_path / "ck") == [1]
    monkeypatch.setenv("HOME", str(tmp_path))
    with ResilientStorageWriter("~/ck") as w:  # DCP's recipe: the directory as checkpoint_id
        dcp.save({"t": torch.full((2,), 2.0)}, storage_writer=w, checkpoint_id="~/ck")
    assert _steps(tmp_path / "ck") == [1, 2]
    got = {"t": torch.zeros(2)}
    dcp.load(got, storage_reader=ResilientStorageReader("~/ck"))
    assert torch.equal(got["t"], torch.full((2,), 2.0))
    assert os.listdir(tmp_path) == ["ck"]  # nothing under ./s3: or ./~


def test_a_file_url_dirpath_passed_again_as_checkpoint_id_is_the_writers_own_directory(tmp_path):
    """DCP's recipe passes the directory as ``checkpoint_id`` beside ``storage_writer=``. The
    writer takes ``file:///x`` as its dirpath ``/x``, but the same URL as ``checkpoint_id``
    was refused as 'another path' (a ConfigError): it names the writer's own directory."""
    url = f"file://{tmp_path}/ck"
    with ResilientStorageWriter(url) as w:
        dcp.save({"t": torch.ones(2)}, storage_writer=w, checkpoint_id=url)
        dcp.save({"t": torch.full((2,), 2.0)}, storage_writer=w, checkpoint_id=url)
    assert _steps(tmp_path / "ck") == [1, 2]


def test_a_damaged_newest_remote_checkpoint_is_a_fallback_warning_and_listed_as_skipped(
    tmp_path,
):
    """The local directory is gone and the newest remote checkpoint rotted in place: the reader
    fetches the next newest. That fallback was only a log line, and ``reader.skipped`` (the
    newer checkpoints that could not be used, and why) stayed empty: a ``ResumeFallbackWarning``
    as for a damaged local checkpoint, and ``skipped`` names it."""
    import json
    import shutil

    from resilient_callbacks.errors import ResumeFallbackWarning

    url, root = f"file://{tmp_path}/remote", tmp_path / "ck"
    with ResilientStorageWriter(root, remote=url) as writer:
        for v in (1, 2):
            dcp.save({"w": torch.full((64,), float(v))}, storage_writer=writer, checkpoint_id=v)
    shutil.rmtree(root)
    newest = tmp_path / "remote" / "step_000000002"
    m = json.loads((newest / "manifest.json").read_text())
    path = newest / max(m["files"], key=lambda f: f["size"])["path"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))

    sd = {"w": torch.zeros(64)}
    reader = ResilientStorageReader(root, remote=url)
    with pytest.warns(ResumeFallbackWarning, match=r"step_000000002 \(remote\)"):
        dcp.load(sd, storage_reader=reader)
    assert reader.loaded_step == 1 and torch.equal(sd["w"], torch.ones(64))
    assert len(reader.skipped) == 1 and "step_000000002 (remote)" in reader.skipped[0]


def test_objects_load_with_a_load_planner_that_does_not_flatten(tmp_path):
    """``DefaultLoadPlanner(flatten_state_dict=False)``: the planner's ``state_dict`` is a copy
    of yours (it still flattens ShardedTensors), and DCP's own ``load_bytes`` sets the objects
    into the copy: ``epoch`` came back as the value passed in (0), with no error. They are set
    into the state dict you passed."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    root = tmp_path / "ck"
    with ResilientStorageWriter(root) as writer:
        dcp.save({"w": torch.arange(4.0), "epoch": 3, "tag": "b"}, storage_writer=writer)
    back = {"w": torch.zeros(4), "epoch": 0, "tag": None}
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    dcp.load(back, storage_reader=ResilientStorageReader(root), planner=planner)
    assert back["epoch"] == 3 and back["tag"] == "b"
    assert torch.equal(back["w"], torch.arange(4.0))


def test_a_directory_made_again_in_the_process_numbers_its_saves_afresh(tmp_path):
    """A ``dcp.load`` is remembered per directory path: the next unnumbered save continues its
    step. A directory deleted and made again in the same process (a notebook starting over) began
    its commits at seq 1 again, so the old directory's load (step 2, seq 2) still counted: the new
    directory's second save was step 3 (found when pytest gave a test the path of a deleted one).
    The record counts only while the checkpoint it loaded is still committed there."""
    import shutil

    root = tmp_path / "ck"
    with ResilientStorageWriter(root) as w:
        for step in (1, 2):
            dcp.save({"t": torch.full((2,), float(step))}, storage_writer=w, checkpoint_id=step)
    got = {"t": torch.zeros(2)}
    dcp.load(got, storage_reader=ResilientStorageReader(root))
    assert torch.equal(got["t"], torch.full((2,), 2.0))
    shutil.rmtree(root)
    with ResilientStorageWriter(root) as w:
        dcp.save({"t": torch.ones(2)}, storage_writer=w)
        assert _steps(root) == [1]
        dcp.save({"t": torch.ones(2)}, storage_writer=w)
    assert _steps(root) == [1, 2]


def test_a_save_in_a_process_launched_as_one_of_several_without_a_group_is_refused(
    tmp_path, monkeypatch
):
    """Under torchrun (``WORLD_SIZE=2``) a script that never called ``init_process_group``:
    DCP warns "assuming the intent is to save in a single process" and each rank committed a
    checkpoint of its own into the shared ``dirpath``, as if alone, in silence (two processes
    left one lineage's steps and the other's ``step_000000001-1``). Refused at the save, naming
    the rank, WORLD_SIZE and ``init_process_group``; nothing is written; with WORLD_SIZE=1 the
    same save goes on."""
    root = tmp_path / "ck"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with ResilientStorageWriter(root) as w:
        with pytest.raises(BaseException, match="init_process_group") as caught:
            dcp.save({"t": torch.ones(4)}, storage_writer=w, checkpoint_id=1)
        said = str(caught.value)
        assert "ConfigError" in said and "rank 1 of WORLD_SIZE=2" in said
        assert not root.exists() or os.listdir(root) == []
        monkeypatch.setenv("WORLD_SIZE", "1")
        dcp.save({"t": torch.ones(4)}, storage_writer=w, checkpoint_id=1)
    assert _steps(root) == [1]


def test_one_rank_of_a_job_saving_alone_with_no_dist_is_not_refused(tmp_path, monkeypatch):
    """``dcp.save(..., no_dist=True)`` by one process of a job of two with no process group
    (rank 0 saving a consolidated state dict alone, after ``destroy_process_group``) was refused
    as a forgotten ``init_process_group``. DCP does not pass ``no_dist`` on to the writer (it
    makes every save without a group a ``no_dist`` one): a writer made with ``no_dist=True``
    saves, and the checkpoint loads; one without it is still refused, its error naming the
    option."""
    root = tmp_path / "ck"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with ResilientStorageWriter(root) as w:
        with pytest.raises(BaseException, match="init_process_group") as caught:
            dcp.save({"t": torch.ones(4)}, storage_writer=w, no_dist=True)
        assert "ResilientStorageWriter(..., no_dist=True)" in str(caught.value)
    assert not root.exists() or os.listdir(root) == []
    with ResilientStorageWriter(root, no_dist=True) as w:
        dcp.save({"t": torch.arange(4.0)}, storage_writer=w, no_dist=True, checkpoint_id=1)
    assert _steps(root) == [1]
    got = {"t": torch.zeros(4)}
    dcp.load(got, storage_reader=ResilientStorageReader(root, no_dist=True), no_dist=True)
    assert got["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
