"""Two writers and one remote URL: a mistake (a model's and an EMA's Checkpointer given the same
``remote=``) must be refused in one process, and an upload must never replace a committed remote
checkpoint of another run that happens to have the same name (two processes)."""

from __future__ import annotations

import shutil
import sys
import textwrap

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer, ForeignCheckpointsWarning
from resilient_callbacks.errors import CheckpointLockedError
from resilient_callbacks.remote import RemoteStore


def _committed(url: str) -> dict[str, tuple[str, int]]:
    """remote name -> (run id, step) of every committed remote checkpoint; none torn."""
    out = {}
    for e in RemoteStore(url).scan():
        assert e.problem is None, e
        if e.manifest is not None:
            out[e.name] = (e.manifest.run_id, e.manifest.step)
    return out


def test_a_second_open_checkpointer_with_the_same_remote_url_is_refused(tmp_path):
    url = f"file://{tmp_path}/durable/run"
    model, ema = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    with Checkpointer(tmp_path / "model", remote=url, every_n_steps=1) as ck:
        # the same store, spelled another way (a trailing slash, a path for file://)
        for same in (url + "/", f"{tmp_path}/durable/run"):
            with pytest.raises(CheckpointLockedError, match="remote URL of its own") as e:
                Checkpointer(tmp_path / "ema", remote=same, every_n_steps=1)
            assert str(tmp_path / "model") in str(e.value)  # names the writer that has it
        ck.restore(model)
        ck.step(1, model)
        # another URL is fine: two Checkpointers, two directories, two remotes
        with Checkpointer(tmp_path / "ema", remote=url + "-ema", every_n_steps=1) as ck2:
            ck2.restore(ema)
            ck2.step(1, ema)
    # closed: a sweep's next trial may use the URL again
    with Checkpointer(tmp_path / "model", remote=url) as ck:
        assert ck.restore(model) == 1
    assert [step for _, step in _committed(url).values()] == [1]


@pytest.mark.distributed
def test_a_second_node_local_writer_with_the_same_remote_url_is_refused(tmp_path):
    """Node-local mode (two ranks, each "node" its own directory): a second Checkpointer of the
    process with the first one's remote (a model's and an EMA's) was opened, and the two
    uploaded checkpoints of the same names to one prefix, each one's retention deleting the
    other's. Refused now on every rank as in shared mode, CheckpointLockedError naming the
    first writer's directory; the first one closes normally."""
    from test_nodelocal_failures import _run

    out = _run(tmp_path, "two", 2, RC_SECOND_WRITER=1)
    for node, rank in enumerate(out):
        assert rank[0]["second"] == "CheckpointLockedError", rank
        assert "remote URL of its own" in rank[0]["said"], rank
        assert str(tmp_path / f"node{node}") in rank[0]["said"], rank


_OTHER = """
import sys, torch
from resilient_callbacks import Checkpointer
with Checkpointer(sys.argv[1], remote=sys.argv[2], every_n_steps=1, async_save=False) as ck:
    state = {"w": torch.full((4,), 7.0)}
    ck.restore(state)
    for s in (1, 2):
        ck.step(s, state)
"""


def test_an_upload_never_replaces_another_runs_remote_checkpoint_of_the_same_name(tmp_path):
    """Two processes upload to one URL (a mistake): this one listed the store before the
    other uploaded its step_000000001 and step_000000002; its own uploads of those steps must
    take other names, not uncommit and overwrite the other run's."""
    url = f"file://{tmp_path}/durable/run"
    mine = {"w": torch.zeros(4)}
    with Checkpointer(tmp_path / "mine", remote=url, every_n_steps=1, async_save=False) as ck:
        ck.restore(mine)
        # another process, forked from the session's zygote (torch imported once)
        argv = [sys.executable, "-c", textwrap.dedent(_OTHER), str(tmp_path / "other"), url]
        p = spawn_ranks.run_python(argv, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        other = _committed(url)
        assert sorted(other) == ["step_000000001", "step_000000002"]
        for s in (1, 2):
            mine["w"].fill_(s)
            ck.step(s, mine)
        my_run = ck.run_id
    after = _committed(url)
    for name, key in other.items():
        assert after[name] == key  # the other run's checkpoints are still there, committed
    assert sorted(v for v in after.values() if v[0] == my_run) == [(my_run, 1), (my_run, 2)]


def test_push_never_replaces_another_runs_remote_checkpoint_of_the_same_name(tmp_path):
    from resilient_callbacks.cli import main

    url = f"file://{tmp_path}/durable/run"
    with Checkpointer(tmp_path / "a", remote=url, async_save=False) as ck:
        ck.save(1, {"w": torch.full((4,), 1.0)})
    before = _committed(url)
    with Checkpointer(tmp_path / "b", async_save=False) as ck:  # another run, no remote
        ck.save(1, {"w": torch.full((4,), 2.0)})
        mine = ck.run_id
    assert main(["push", str(tmp_path / "b"), url]) == 0
    after = _committed(url)
    assert after["step_000000001"] == before["step_000000001"]
    assert after["step_000000001-r1"] == (mine, 1)


def test_a_run_that_saves_without_restore_numbers_its_commits_after_the_remotes(tmp_path):
    """A sweep's trials: each a new run (``resume="never"``, so no ``restore()`` call) in its own
    directory, one remote URL. A trial's commits must number after the remote's (as a new run
    in a local directory numbers after the directory's): a restore takes the highest number, so
    after its local directory is lost a trial resumed from an earlier trial's checkpoint."""
    url = f"file://{tmp_path}/durable/sweep"
    with Checkpointer(tmp_path / "t0", remote=url, resume="never", async_save=False) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.full((4,), 1.0)})
    # (one URL for the sweep: each trial is told of the others' checkpoints there, as it is)
    other_runs = pytest.warns(ForeignCheckpointsWarning, match="checkpoint.s. of 1 other run")
    with Checkpointer(tmp_path / "t1", remote=url, resume="never", async_save=False) as ck:
        with other_runs:
            ck.save(1, {"w": torch.full((4,), 2.0)})
        trial1 = ck.run_id
    shutil.rmtree(tmp_path / "t1")  # its node is gone: the trial resumes from the remote
    state = {"w": torch.zeros(4)}
    with Checkpointer(tmp_path / "t1", remote=url) as ck:
        with pytest.warns(ForeignCheckpointsWarning, match="3 checkpoint.s. of 1 other run"):
            assert ck.restore(state) == 1
        assert ck.run_id == trial1
    assert torch.equal(state["w"], torch.full((4,), 2.0))


def test_a_new_run_beside_another_runs_remote_checkpoints_is_told(tmp_path):
    """As for a local directory holding another run's checkpoints: a new run whose remote URL
    holds another run's is warned once, naming the URL and how to clean it."""
    url = f"file://{tmp_path}/durable/sweep"
    with Checkpointer(tmp_path / "t0", remote=url, resume="never", async_save=False) as ck:
        ck.save(1, {"w": torch.ones(2)})
    with (
        Checkpointer(tmp_path / "t1", remote=url, resume="never", async_save=False) as ck,
        pytest.warns(ForeignCheckpointsWarning, match="remote") as got,
    ):
        ck.save(1, {"w": torch.ones(2)})
    said = " ".join(str(w.message) for w in got)
    assert url in said and "--other-runs" in said and "1 other run" in said
