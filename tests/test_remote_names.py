"""Remote names that are not free: a remote checkpoint whose manifest cannot be read here
(damaged, written by a newer version of the library, or a GET the store did not answer) is
never replaced by an upload; only ``gc --remote --remove-corrupt`` deletes a damaged one."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings

import pytest
import torch

from resilient_callbacks import Checkpointer, ResumeFallbackWarning
from resilient_callbacks.remote import RemoteStore


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v))}


def _fresh() -> dict:
    return {"w": torch.zeros(64)}


@pytest.mark.parametrize("how", ["garbled", "newer format"])
def test_a_resave_after_a_fallback_never_overwrites_the_unreadable_remote_copy(
    tmp_path, s3_remote, caplog, how
):
    """The newest remote checkpoint's manifest cannot be read on a new node (empty dirpath):
    restore falls back to the one before, the run saves that step again, and its upload took
    the unreadable copy's name: it uncommitted and overwrote it (its manifest may have been
    unreadable only briefly, or only to this older library). Now the re-save is uploaded under
    another name and the unreadable copy stays, byte for byte. A newer format's commit number
    is still read, so the re-save numbers after it; a garbled one's is unknown: said."""
    url, opts = s3_remote
    local = tmp_path / "local"
    kw = {"remote": url, "remote_options": opts, "keep_last": 5, "async_save": False}
    with Checkpointer(local, **kw) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    st = RemoteStore(url, opts)
    where = f"{st.root}/step_000000020/manifest.json"
    good = st.fs.cat_file(where)
    bad = b"{torn" if how == "garbled" else _newer(good)
    st.fs.pipe_file(where, bad)
    shutil.rmtree(local)
    with (
        pytest.warns(ResumeFallbackWarning, match="step_000000020"),
        Checkpointer(local, **kw) as ck,
    ):
        assert ck.restore(_fresh()) == 10
        ck.save(20, _state(-20))  # the run goes on: step 20 again, other values
    st.fs.invalidate_cache()
    assert st.fs.cat_file(where) == bad, "the unreadable copy was replaced"
    st.fs.pipe_file(where, good)  # it was readable after all: the run's step 20 is whole
    found = {e.name: e for e in RemoteStore(url, opts).scan()}
    assert sorted(found) == ["step_000000010", "step_000000020", "step_000000020-r1"]
    assert all(e.problem is None for e in found.values()), found
    old, new = found["step_000000020"].manifest, found["step_000000020-r1"].manifest
    assert (old.step, new.step) == (20, 20)
    if how == "newer format":
        assert new.seq > old.seq  # numbered after it: a restore takes the re-save
    else:
        assert "commit order of step_000000020" in caplog.text


def _newer(raw: bytes) -> bytes:
    return json.dumps({**json.loads(raw), "format_version": 99}).encode()


def _checkpoint(root, v: float) -> tuple[str, object]:
    """A committed local checkpoint of step 10 of a new run in ``root``: (path, manifest)."""
    from resilient_callbacks.manifest import read_manifest

    with Checkpointer(root, async_save=False) as ck:
        ck.save(10, _state(v))
        path = ck.last_save.path
    return path, read_manifest(path)


def test_an_upload_cut_off_by_a_kill_is_uploaded_again_under_its_own_name(tmp_path, s3_remote):
    """A kill cut off the upload of a commit (its files partly there, its mark left, no
    manifest): the restart uploads the same commit again. Its own earlier mark does not make it
    yield (that left the partial folder to the 24 h sweep and put the checkpoint under
    ``-r1``): it goes under its name, whole, and no mark is left."""
    from resilient_callbacks.remote_claims import CLAIM_PREFIX

    url, opts = s3_remote
    path, m = _checkpoint(tmp_path / "a", 1.0)
    st = RemoteStore(url, opts)
    name = "step_000000010"
    st.fs.pipe_file(f"{st.root}/{name}/{CLAIM_PREFIX}{m.run_id}-{m.seq}-0123456789ab", b"")
    first = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]
    st.fs.pipe_file(f"{st.root}/{name}/{first}", b"torn")  # what the killed upload had put
    RemoteStore(url, opts).upload(path, m, name)
    (entry,) = RemoteStore(url, opts).scan()
    assert entry.name == name and entry.manifest == m and entry.problem is None, entry
    assert not [f for f in entry.sizes if f.startswith(CLAIM_PREFIX)], entry.sizes


def test_a_live_mark_of_a_run_whose_id_extends_ours_with_a_dash_is_not_taken_over(tmp_path):
    """Run ids a user set may hold a dash. The mark a killed upload of this commit left
    (``.writer-<run>-<seq>-<random>``) is taken over; a live upload of run ``exp-<seq>`` marks
    ``.writer-exp-<seq>-<its seq>-<random>``, which starts the same as run ``exp``'s own: it
    was removed and both wrote the name. Now the upload yields to it and the mark stays."""
    from resilient_callbacks.remote_claims import CLAIM_PREFIX, RemoteNameTaken, claim

    _, m = _checkpoint(tmp_path / "a", 1.0)
    m = dataclasses.replace(m, run_id="exp")
    st = RemoteStore(f"file://{tmp_path}/remote", None)
    name = "step_000000010"
    live = f"{CLAIM_PREFIX}exp-{m.seq}-7-0123456789ab"  # run "exp-<seq>", its commit 7
    st.fs.makedirs(f"{st.root}/{name}", exist_ok=True)
    st.fs.pipe_file(f"{st.root}/{name}/{live}", b"")
    with pytest.raises(RemoteNameTaken) as e:
        claim(st, name, m, None)
    assert e.value.key == (f"exp-{m.seq}", 7)
    st.fs.invalidate_cache()
    left = [p.rsplit("/", 1)[-1] for p in st.fs.ls(f"{st.root}/{name}", False)]
    assert left == [live], left


@pytest.mark.parametrize("where", ["file", "s3"])
def test_two_writers_uploading_one_name_at_once_never_both_commit(tmp_path, request, where):
    """Two processes upload a checkpoint of the same name to one URL at once (a second run
    started on the same URL by mistake, a `push` from another directory beside a run): both
    found no manifest under the name, both put their files there and both committed, the
    later manifest replacing the first (whose run then deleted its local copy, as uploaded),
    over files that could be either's. Now each marks the name before it puts anything and
    yields to another's mark: one commits, the other is told to take another name."""
    import threading

    from resilient_callbacks import remote_blob_put
    from resilient_callbacks.cli import main
    from resilient_callbacks.remote_claims import RemoteNameTaken

    if where == "s3":
        url, opts = request.getfixturevalue("s3_remote")
    else:
        url, opts = f"file://{tmp_path}/durable/run", None
    first, second = _checkpoint(tmp_path / "a", 1.0), _checkpoint(tmp_path / "b", 2.0)
    real_put = remote_blob_put.upload  # (what an upload puts first)
    first_putting, second_done = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def put(*a, **kw):  # the first writer puts its files once the second is done
        if threading.current_thread().name == "first" and not first_putting.is_set():
            first_putting.set()
            assert second_done.wait(60)
        return real_put(*a, **kw)

    def upload(who: str, ckpt) -> None:
        try:
            RemoteStore(url, opts).upload(ckpt[0], ckpt[1], "step_000000010")
            outcome[who] = "committed"
        except RemoteNameTaken as e:
            outcome[who] = e
        finally:
            if who == "second":
                second_done.set()

    mp = pytest.MonkeyPatch()
    mp.setattr(remote_blob_put, "upload", put)
    try:
        a = threading.Thread(target=upload, args=("first", first), name="first")
        a.start()
        assert first_putting.wait(60)
        b = threading.Thread(target=upload, args=("second", second), name="second")
        b.start()
        b.join(60)
        a.join(60)
    finally:
        mp.undo()
    assert outcome["first"] == "committed", outcome
    taken = outcome["second"]
    assert isinstance(taken, RemoteNameTaken), outcome  # it was "committed", then replaced
    assert taken.key == (first[1].run_id, first[1].seq)
    (entry,) = RemoteStore(url, opts).scan()
    assert entry.manifest == first[1] and entry.problem is None
    assert not [f for f in entry.sizes if f.startswith(".writer-")]  # its mark is gone
    args = ["verify", url, "--all"] + [f"-o{k}={json.dumps(v)}" for k, v in (opts or {}).items()]
    assert main(args) == 0


def test_an_upload_never_takes_a_name_another_process_is_deleting(tmp_path):
    """One run's remote retention deletes its step_000000010 (manifest first, then everything
    under the name) while a second run on the same URL, behind it, uploads its own step 10:
    the upload found no manifest there, took the name and committed, and the deletion's
    removal of the folder then took the new checkpoint with it. Now a deletion marks the
    name first, and the upload takes another name."""
    from resilient_callbacks.remote_claims import RemoteNameTaken

    url = f"file://{tmp_path}/durable/run"
    first, second = _checkpoint(tmp_path / "a", 1.0), _checkpoint(tmp_path / "b", 2.0)
    RemoteStore(url).upload(*first, "step_000000010")
    st = RemoteStore(url)
    fs_class = type(st.fs)
    real_rm = fs_class.rm
    outcome: list[object] = []

    def rm(fs, path, *a, **kw):  # between the manifest's removal and the folder's
        if not outcome:
            try:
                RemoteStore(url).upload(*second, "step_000000010")
                outcome.append("committed")
            except RemoteNameTaken as e:
                outcome.append(e)
        return real_rm(fs, path, *a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(fs_class, "rm", rm)
    try:
        st.delete("step_000000010")
    finally:
        mp.undo()
    if outcome == ["committed"]:  # then it must still be there, whole
        found = RemoteStore(url).scan()
        assert [(e.name, e.manifest, e.problem) for e in found] == [
            ("step_000000010", second[1], None)
        ], "the second run's committed checkpoint was deleted"
    else:
        assert isinstance(outcome[0], RemoteNameTaken), outcome
        assert RemoteStore(url).scan() == []


def test_a_commit_of_this_runs_key_written_by_another_process_is_not_taken_for_ours(tmp_path):
    """A second process resumed this run from the same URL (started by mistake on another
    machine, its dirpath empty): it numbers its commits as this one does, so the remote holds
    its step_000000002 with the key (run id, 2) of this process's next commit. This process
    took its own step 2 for uploaded (the key was listed), never uploaded it, and its local
    retention was free to delete the only copy. Now a key counts as uploaded only with the
    same files; the upload goes beside the other's, which it leaves alone, with a warning."""
    from resilient_callbacks.filewrite import encode_json
    from resilient_callbacks.manifest import read_manifest

    url = f"file://{tmp_path}/durable/run"
    with Checkpointer(tmp_path / "a", remote=url, keep_last=5, async_save=False) as ck:
        ck.save(1, _state(1.0))
        assert ck._dir.sync.wait(60)
        other, _ = _checkpoint(tmp_path / "b", -2.0)  # the other process's step 2 ...
        m = dataclasses.replace(read_manifest(other), run_id=ck._dir.run_id, seq=2, step=2)
        with open(os.path.join(other, "manifest.json"), "wb") as fh:  # ... this run's commit 2
            fh.write(encode_json(m.to_json()))
        theirs = read_manifest(other)
        RemoteStore(url).upload(other, theirs, "step_000000002")
        ck._dir.sync.refresh()  # (as the retention after an upload lists the store)
        ck.save(2, _state(2.0))
        mine = read_manifest(ck.last_save.path)
        assert (mine.run_id, mine.seq) == (theirs.run_id, theirs.seq)
    found = {e.name: e.manifest for e in RemoteStore(url).scan()}
    assert found["step_000000002"] == theirs  # left alone
    assert mine in found.values(), "this process's step 2 was never uploaded"


def _deleting(url: str, *names: str) -> None:
    """What a deletion cut off by a kill leaves under each of ``names``: its mark, alone."""
    from resilient_callbacks.remote_claims import CLAIM_PREFIX

    st = RemoteStore(url)
    for name in names:
        st.fs.makedirs(f"{st.root}/{name}", exist_ok=True)
        st.fs.pipe_file(f"{st.root}/{name}/{CLAIM_PREFIX}deleting-{'ab' * 16}", b"")


def test_an_upload_blocked_by_two_deletion_marks_takes_a_third_name(tmp_path, monkeypatch):
    """Deletions cut off by a kill left their marks under step_000000010 and its -r1. The
    run's uploader recorded each refusal under one key for both (a deletion's mark names no
    commit), the second replacing the first: it tried the two names in turn forever, three
    requests and a warning each time, and never uploaded. Now each refused name stays taken."""
    from resilient_callbacks import remote, remote_claims

    url = f"file://{tmp_path}/durable/run"
    _deleting(url, "step_000000010", "step_000000010-r1")
    tried: list[str] = []

    def claim(store, name, *a):
        tried.append(name)
        if len(tried) == 10:  # going round the names: the marks go, to end the test
            shutil.rmtree(tmp_path / "durable" / "run")
        return remote_claims.claim(store, name, *a)

    monkeypatch.setattr(remote, "claim", claim)
    with Checkpointer(tmp_path / "a", remote=url, async_save=False) as ck:
        ck.save(10, _state(1.0))
        assert ck._dir.sync.wait(60)
    assert tried == ["step_000000010", "step_000000010-r1", "step_000000010-r2"]
    found = [e.name for e in RemoteStore(url).scan() if e.manifest is not None]
    assert found == ["step_000000010-r2"]


def test_push_takes_the_next_name_when_a_deletion_marked_its_own(tmp_path, capsys):
    """A deletion cut off by a kill left its mark under step_000000010 (no manifest, so the
    scan lists no commit there): `push` gave up with an error until `gc` removed the folder
    a day later. Now it pushes the checkpoint under the next free name."""
    from resilient_callbacks.cli import main

    url = f"file://{tmp_path}/durable/run"
    _checkpoint(tmp_path / "a", 1.0)
    _deleting(url, "step_000000010")
    assert main(["push", str(tmp_path / "a"), url]) == 0
    assert "as step_000000010-r1" in capsys.readouterr().out
    found = [e.name for e in RemoteStore(url).scan() if e.manifest is not None]
    assert found == ["step_000000010-r1"]


@pytest.mark.parametrize("by", ["uploader", "gc"])
def test_a_cut_off_upload_under_an_rn_name_is_swept_a_day_later(tmp_path, monkeypatch, by):
    """A kill cut off an upload (or a deletion) under a name ``free_name`` gave
    (``step_000000010-r1``, taken when another writer's mark or checkpoint held the plain
    name): its folder, files and mark, was never deleted, neither by the uploader's sweep of
    cut-off uploads nor by `gc --remote` ("not a checkpoint's name: left alone"), so the
    store's space and the name were held for good. Both delete it once untouched for a day."""
    from resilient_callbacks import cli_remote_gc, sync
    from resilient_callbacks.cli import main

    url = f"file://{tmp_path}/durable/run"
    _deleting(url, "step_000000010-r1")
    st = RemoteStore(url)
    st.fs.pipe_file(f"{st.root}/step_000000010-r1/shared.safetensors", b"cut off")
    # as if a day had passed
    monkeypatch.setattr(sync if by == "uploader" else cli_remote_gc, "STALE_UPLOAD_S", -1.0)
    with Checkpointer(tmp_path / "a", remote=url, keep_last=2, async_save=False) as ck:
        ck.save(1, _state(1.0))
        assert ck._dir.sync.wait(60)
    if by == "gc":
        assert main(["gc", str(tmp_path / "a"), "--remote", url, "--keep-last", "2"]) == 0
    assert [e.name for e in RemoteStore(url).scan()] == ["step_000000001"]


@pytest.mark.parametrize("by", ["uploader", "gc"])
def test_a_plain_dcp_checkpoint_at_the_url_is_never_swept(tmp_path, monkeypatch, capsys, by):
    """A checkpoint plain ``dcp.save`` (FsspecWriter) wrote at the URL (``step_100``: a
    pickled ``.metadata``, ``*.distcp``) was listed as an upload without a manifest, and the
    uploader's sweep and `gc --remote` deleted it once untouched for a day: the user's last
    checkpoint of the run before it moved to this library. It is not ours: never listed,
    never deleted (as in a local directory)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from resilient_callbacks import cli_remote_gc, sync
    from resilient_callbacks.cli import main

    url = f"file://{tmp_path}/durable/run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (DCP: "assuming ... a single process")
        dcp.save({"w": torch.ones(3)}, storage_writer=FsspecWriter(f"{url}/step_100"))
    # as if a day had passed
    monkeypatch.setattr(sync if by == "uploader" else cli_remote_gc, "STALE_UPLOAD_S", -1.0)
    with Checkpointer(tmp_path / "a", remote=url, keep_last=2, async_save=False) as ck:
        ck.save(1, _state(1.0))
        assert ck._dir.sync.wait(60)
    if by == "gc":
        assert main(["gc", str(tmp_path / "a"), "--remote", url, "--keep-last", "2"]) == 0
    assert (tmp_path / "durable" / "run" / "step_100" / ".metadata").is_file()
    assert [e.name for e in RemoteStore(url).scan()] == ["step_000000001"]
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "a"), "--remote", url]) == 0
    assert "step_100" not in capsys.readouterr().out


def test_a_name_held_by_this_runs_own_other_commit_is_not_blamed_on_another_run(tmp_path, caplog):
    """A cut-off upload of this run's commit 7 left its mark under step_000000010; the run,
    resumed from the remote, saves step 10 again as another commit. The upload goes beside it
    as before, but the warning told the user that another run wrote to the URL and to give
    each run a URL of its own: it names this run's commit now."""
    from resilient_callbacks.remote_claims import CLAIM_PREFIX

    url = f"file://{tmp_path}/durable/run"
    with Checkpointer(tmp_path / "a", remote=url, async_save=False) as ck:
        ck.save(5, _state(5.0))
        assert ck._dir.sync.wait(60)
        run = ck.run_id
    st = RemoteStore(url)
    st.fs.makedirs(f"{st.root}/step_000000010", exist_ok=True)
    st.fs.pipe_file(f"{st.root}/step_000000010/{CLAIM_PREFIX}{run}-7-0123456789ab", b"")
    shutil.rmtree(tmp_path / "a")  # (the local disk lost: resumed from the remote)
    caplog.set_level("WARNING", logger="resilient_callbacks")
    with Checkpointer(tmp_path / "a", remote=url, async_save=False) as ck:
        assert ck.restore(_fresh()) == 5
        ck.save(10, _state(10.0))
        assert ck._dir.sync.wait(60)
    assert "step_000000010 holds commit 7 of this run" in caplog.text
    assert "another run" not in caplog.text


def test_a_store_that_refuses_deletes_keeps_one_deletion_mark_per_name(tmp_path, monkeypatch):
    """A store that lets a run put objects but not delete them (a bucket policy without
    DeleteObject): remote retention fails at each pass, after the deletion had put its mark
    under the name, each attempt under a name of its own. One more empty object per save,
    for the life of the run, every later listing of the name longer. Every attempt puts the
    same one now."""
    from resilient_callbacks.remote_claims import CLAIM_PREFIX

    url = f"file://{tmp_path}/durable/run"

    def deny(*a, **kw):
        raise PermissionError("AccessDenied: DeleteObject")

    fs_class = type(RemoteStore(url).fs)
    for method in ("rm_file", "rm", "_rm"):
        monkeypatch.setattr(fs_class, method, deny)
    with Checkpointer(tmp_path / "a", remote=url, keep_last=1, async_save=False) as ck:
        for step in range(1, 6):
            ck.save(step, _state(float(step)))
            assert ck._dir.sync.wait(60)
    root = tmp_path / "durable" / "run"
    marks = {
        os.path.basename(d): [f for f in files if f.startswith(CLAIM_PREFIX)]
        for d, _, files in os.walk(root)
    }
    deleting = {d: [f for f in fs if "deleting" in f] for d, fs in marks.items()}
    # the retention goes on past a checkpoint whose manifest the store refused (each older
    # name tried once a pass): one mark per name, whatever the number of attempts
    assert {d: len(fs) for d, fs in deleting.items() if fs} == {
        f"step_{s:09d}": 1 for s in range(1, 5)
    }, marks
