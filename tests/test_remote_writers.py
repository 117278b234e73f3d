"""Two live processes writing one remote URL: each case with a real second process, ordered
through its stdin and stdout (never by sleeping).

- Two processes upload the same commit key at once (two processes of one run number their
  commits alike): neither tears the other's checkpoint.
- Node-local uploads mark their name as shared-mode uploads do.
- Two live processes of one run: neither's remote retention deletes the other's checkpoints.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer
from resilient_callbacks.manifest import MANIFEST_NAME as MANIFEST
from resilient_callbacks.manifest import read_manifest
from resilient_callbacks.remote import RemoteStore
from resilient_callbacks.remote_claims import CLAIM_PREFIX

NAME = "step_000000020"

# uploads one local checkpoint (argv: its path, the URL, the remote name, "hold"): with "hold",
# it says "marked" once its mark is up and waits for a line on stdin before it puts anything
_UPLOAD = textwrap.dedent(
    """
    import sys
    from resilient_callbacks import remote_blob_put
    from resilient_callbacks.manifest import read_manifest
    from resilient_callbacks.remote import RemoteStore
    from resilient_callbacks.remote_claims import RemoteNameTaken

    path, url, name, hold = sys.argv[1:5]
    real = remote_blob_put.upload

    def put(*a, **kw):  # the first thing an upload puts, after its mark
        if hold == "hold":
            print("marked", flush=True)
            sys.stdin.readline()
        return real(*a, **kw)

    remote_blob_put.upload = put
    try:
        RemoteStore(url).upload(path, read_manifest(path), name)
        print("committed", flush=True)
    except RemoteNameTaken as e:
        print("taken", e.key[0], e.key[1], flush=True)
    """
)


def _child(script: str, *args: str, log: Path | None = None) -> spawn_ranks.Piped:
    """``script`` in a process of its own, forked from the session's zygote (torch imported
    once: spawn_ranks.Piped), its stdin and stdout ours; stderr to ``log``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return spawn_ranks.Piped([sys.executable, "-c", script, *args], env, log)


def _two_copies_of_one_commit(tmp_path, url: str) -> list[str]:
    """Two local checkpoints of one run with one commit number and other contents (two
    processes resumed the run from one checkpoint and each saved step 20): their paths."""
    with Checkpointer(tmp_path / "base", async_save=False) as ck:
        ck.save(10, {"w": torch.zeros(64)})
    paths = []
    for who, v in (("a", 1.0), ("b", 2.0)):
        shutil.copytree(tmp_path / "base", tmp_path / who)
        with Checkpointer(tmp_path / who, async_save=False) as ck:
            state = {"w": torch.zeros(64)}
            assert ck.restore(state) == 10
            ck.save(20, {"w": torch.full((64,), v)})
            paths.append(ck.last_save.path)
    a, b = (read_manifest(p) for p in paths)
    assert (a.run_id, a.seq) == (b.run_id, b.seq) and a.files != b.files
    return paths


def test_two_processes_uploading_one_commit_key_at_once_never_tear_it(tmp_path):
    """Two processes of one run (a job and its restart, or two jobs given one run directory)
    upload their step 20, commit 2 of the run in both, to one name at once. The second took the
    first's live mark for one a kill had left of its own commit (same run id and number),
    removed it, and committed; the first then put its files over the second's committed
    checkpoint and committed its manifest over it: the second's checkpoint was gone (torn while
    the first wrote), though its process had been told it was uploaded. Now a mark says which
    commit it is (its files and blobs), so the second yields (it takes ``-r1``)."""
    url = f"file://{tmp_path}/durable/run"
    a, b = _two_copies_of_one_commit(tmp_path, url)
    first = _child(_UPLOAD, a, url, NAME, "hold")
    assert first.stdout is not None and first.stdin is not None
    assert first.stdout.readline().strip() == "marked"
    second = _child(_UPLOAD, b, url, NAME, "go")
    out_b, _ = second.communicate(timeout=120)
    first.stdin.write("go\n")
    first.stdin.flush()
    out_a, _ = first.communicate(timeout=120)
    assert out_a.split() == ["committed"], out_a
    m = read_manifest(a)
    assert out_b.split() == ["taken", m.run_id, str(m.seq)], out_b  # it had "committed"
    (entry,) = RemoteStore(url).scan()
    assert entry.name == NAME and entry.manifest == m and entry.problem is None, entry
    assert not [f for f in entry.sizes if f.startswith(CLAIM_PREFIX)], entry.sizes


@pytest.mark.slow  # (the control of the test above: passes on the old src too)
def test_two_processes_uploading_the_very_same_commit_at_once_both_succeed(tmp_path):
    """The same bytes from two processes (a ``push`` beside the run that uploads the same
    checkpoint): neither yields, and the one checkpoint is whole."""
    url = f"file://{tmp_path}/durable/run"
    a, _ = _two_copies_of_one_commit(tmp_path, url)
    shutil.copytree(a, tmp_path / "again")
    first = _child(_UPLOAD, a, url, NAME, "hold")
    assert first.stdout is not None and first.stdin is not None
    assert first.stdout.readline().strip() == "marked"
    second = _child(_UPLOAD, str(tmp_path / "again"), url, NAME, "go")
    out_b, _ = second.communicate(timeout=120)
    first.stdin.write("go\n")
    first.stdin.flush()
    out_a, _ = first.communicate(timeout=120)
    assert (out_a.split(), out_b.split()) == (["committed"], ["committed"])
    (entry,) = RemoteStore(url).scan()
    assert entry.manifest == read_manifest(a) and entry.problem is None, entry
    assert not [f for f in entry.sizes if f.startswith(CLAIM_PREFIX)], entry.sizes


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_node_local_checkpoint_never_shares_its_name_with_another_writers_upload(tmp_path):
    """Another run's upload of ``step_000000002`` to the URL is under way (its mark is there,
    its files not yet) when a two-node node-local run saves step 2. The nodes put their parts
    there without a mark and without a look, the coordinator committed, and the other upload
    then put its files and its manifest over them: the node-local step 2 was gone, its name
    holding a mix of two runs' files. Now each node marks the name first and, finding the other
    writer's mark, puts nothing: the coordinator moves the checkpoint to ``-r1``, where every
    node uploads its part, and the other run's upload commits a folder of its own files only."""
    from test_nodelocal_failures import _run

    url = f"file://{tmp_path}/remote"
    with Checkpointer(tmp_path / "other", async_save=False) as ck:
        ck.save(2, {"w": torch.ones(64)})
        other = ck.last_save.path
    writer = _child(_UPLOAD, other, url, "step_000000002", "hold")
    assert writer.stdout is not None and writer.stdin is not None
    assert writer.stdout.readline().strip() == "marked"
    out = _run(tmp_path, "nodes", 2, "--steps", "4")
    for rank in out:
        assert rank[-1]["event"] == "closed", rank
    writer.stdin.write("go\n")
    writer.stdin.flush()
    said, _ = writer.communicate(timeout=120)
    assert said.split() == ["committed"], said  # (it yields to no one: the nodes yielded)
    found = {e.name: e for e in RemoteStore(url).scan()}
    assert sorted(found) == ["step_000000002", "step_000000002-r1", "step_000000004"], found
    theirs = found["step_000000002"]
    assert theirs.manifest == read_manifest(other) and theirs.problem is None, theirs
    assert sorted(theirs.sizes) == sorted([f.path for f in theirs.manifest.files] + [MANIFEST])
    for name in ("step_000000002-r1", "step_000000004"):
        e = found[name]
        assert e.problem is None and e.manifest.step == int(name[5:14]), e
        assert e.manifest.run_id != theirs.manifest.run_id
        assert not [f for f in e.sizes if f.startswith(CLAIM_PREFIX)], e.sizes  # committed
    for e in found.values():  # every byte is what its manifest says
        for f in e.manifest.files:
            data = (tmp_path / "remote" / e.name / f.path).read_bytes()
            assert len(data) == f.size, (e.name, f.path)
    from resilient_callbacks.cli import main

    assert main(["verify", url, "--all"]) == 0


# one process of a run, driven by lines on stdin: "save N" saves step N, waits for its upload
# and answers "saved N"; "close" closes and exits (argv: dirpath, URL, its name in its log)
_RUN = textwrap.dedent(
    """
    import logging, sys, torch
    from resilient_callbacks import Checkpointer

    logging.basicConfig(level=logging.INFO, format=sys.argv[3] + " %(message)s")
    ck = Checkpointer(sys.argv[1], remote=sys.argv[2], keep_last=2, async_save=False)
    state = {"w": torch.zeros(64)}
    print("restored", ck.restore(state), flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "close":
            break
        step = int(arg[0])
        ck.save(step, {"w": torch.full((64,), step + (sys.argv[3] == "old") / 2)})
        assert ck._dir.sync.wait(120)
        print("saved", step, flush=True)
    ck.close()
    """
)


def _say(p: spawn_ranks.Piped, line: str) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def test_two_live_processes_of_one_run_never_delete_each_others_checkpoints(tmp_path):
    """A run saved steps 10 and 20 to the URL; a second process of the same run starts on
    another machine (the scheduler restarted the job while the old one still runs, or two jobs
    were given the same run directory) and resumes from the remote. Both go on saving with
    ``keep_last=2``: each counted the other's new checkpoints as the run's own and deleted them
    (and its own) by the shared policy. Now each process's remote retention counts only what
    the store held when it opened and what it committed itself: both keep their two newest,
    and each says, once a name, which checkpoints another process writes."""
    url = f"file://{tmp_path}/durable/run"
    with Checkpointer(tmp_path / "old", remote=url, keep_last=2, async_save=False) as ck:
        for s in (10, 20):
            ck.save(s, {"w": torch.full((64,), float(s))})
    old = _child(_RUN, str(tmp_path / "old"), url, "old", log=tmp_path / "old.log")
    assert old.stdout is not None and old.stdout.readline().split() == ["restored", "20"]
    new = _child(_RUN, str(tmp_path / "new"), url, "new", log=tmp_path / "new.log")
    assert new.stdout is not None and new.stdout.readline().split() == ["restored", "20"]
    assert _say(new, "save 30") == "saved 30"
    assert _say(old, "save 30") == "saved 30"  # (its commit number is new's: step_30-r1)
    assert _say(new, "save 40") == "saved 40"
    assert _say(old, "save 40") == "saved 40"
    for p in (old, new):
        p.communicate("close\n", timeout=120)
    found = {e.name: e.manifest for e in RemoteStore(url).scan() if e.manifest is not None}
    by_step = sorted((m.step, m.run_id) for m in found.values())
    assert len({run for _, run in by_step}) == 1  # one run, two processes
    assert sorted(found) == [
        "step_000000030",
        "step_000000030-r1",
        "step_000000040",
        "step_000000040-r1",
    ], found
    said = {who: (tmp_path / f"{who}.log").read_text() for who in ("old", "new")}
    live = "that another live process committed while this one writes it"
    assert f"step_000000030 is a checkpoint of this run ({by_step[0][1]}) {live}" in said["old"]
    assert f"step_000000030-r1 is a checkpoint of this run ({by_step[0][1]}) {live}" in said["new"]


def test_a_store_unlisted_at_open_still_retires_the_runs_history(tmp_path, monkeypatch, caplog):
    """A job restarted while the store failed its listing (the restore's loud fallback to the
    local tier) saves on and uploads once the store answers. Its remote retention took the
    first upload for the open and counted only this process's commits as the run's: the run's
    history on the URL (steps 10 and 20) was never deleted again by that job, and a warning
    named it as another live process's. The first listing that succeeds is the open's now.
    Its restore said the local checkpoints "were not uploaded before the last run stopped":
    it could not tell; it says so now."""
    import logging

    caplog.set_level(logging.WARNING, "resilient_callbacks")
    from resilient_callbacks import ResumeFallbackWarning
    from resilient_callbacks.errors import RemoteUnavailableError

    url = f"file://{tmp_path}/durable/run"
    kw = {"remote": url, "keep_last": 2, "async_save": False}
    with Checkpointer(tmp_path / "l", **kw) as ck:
        for s in (10, 20):
            ck.save(s, {"w": torch.full((64,), float(s))})
    real = RemoteStore.scan
    down = [True]

    def scan(self, *a, **k):
        if down[0]:
            raise ConnectionError("the store is down")
        return real(self, *a, **k)

    def preflight(self, timeout=30.0):
        raise RemoteUnavailableError(f"remote {self.url}: no answer within {timeout:g} s")

    real_upload = RemoteStore.upload

    def upload(self, *a, **k):
        if down[0]:
            raise ConnectionError("the store is down")
        return real_upload(self, *a, **k)

    monkeypatch.setattr(RemoteStore, "scan", scan)
    monkeypatch.setattr(RemoteStore, "upload", upload)
    monkeypatch.setattr(RemoteStore, "preflight", preflight)
    with Checkpointer(tmp_path / "l", **kw) as ck:
        with pytest.warns(ResumeFallbackWarning, match="could not list the remote"):
            assert ck.restore({"w": torch.zeros(64)}) == 20
        down[0] = False
        for s in (30, 40):
            ck.save(s, {"w": torch.full((64,), float(s))})
            assert ck._dir.sync.wait(120)
    found = sorted(e.name for e in real(RemoteStore(url)) if e.manifest is not None)
    assert found == ["step_000000030", "step_000000040"], found
    said = [r.getMessage() for r in caplog.records]
    assert not any("before the last run stopped" in m for m in said), said  # (unknown)
    assert any("may not be on" in m and "could not be listed to tell" in m for m in said), said
