"""A checkpoint committed whose work after the commit (its retention pass, queueing its upload)
then fails does not stop training, in any mode: one ERROR says it once while it persists, the
failure stays visible (``after_commit_error``, the metric ``after_commit_failures_total``), and
``close()`` says it again (after_commit_work.py). The failure is real: the checkpoint directory
made unlistable (``chmod 0o300``; as root too, its permission-bypassing capabilities dropped:
tests/permissions.py). Two ranks: tests/test_rank_agreement.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import permissions
from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.metrics import PREFIX
from resilient_callbacks.retention import RetentionPolicy
from resilient_callbacks.session import CommitSession

AFTER = "work after the commit failed"


def _errors(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and text in r.getMessage()
    ]


@pytest.fixture
def honoured():
    with permissions.honoured() as ok:
        if not ok:
            pytest.skip("this process cannot drop the capabilities that ignore permission bits")
        yield


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_retention_pass_after_a_commit_does_not_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, honoured: None, async_save: bool
):
    """keep_last=1; after step 1 the directory cannot be listed, so the retention pass after
    each commit of steps 2-4 fails. A synchronous save raised CheckpointWriteError (a
    background one at the next save or flush()), and the run stopped over an old checkpoint it
    could not delete. Now every save returns as committed, one ERROR says it (not one per
    save), the failure is kept and counted; once the directory is listable again the next
    save's pass deletes what was kept and clears it; close() says the failure of the newest
    checkpoint's work again."""
    root = tmp_path / "ck"
    state = {"w": torch.zeros(10)}
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(root, keep_last=1, async_save=async_save, preemption=False) as ck:
        ck.save(1, state)
        ck.flush()
        if not permissions.unlistable(root):
            pytest.skip("this process lists a directory it has no read permission on")
        try:
            for step in (2, 3, 4):
                assert ck.save(step, state) is True
                ck.flush()
        finally:
            os.chmod(root, 0o755)
        assert ck.committed_saves == 4
        said = _errors(caplog, AFTER)
        assert len(said) == 1, said  # (the same reason at each save: said once)
        assert said[0].startswith("checkpoint for step 2 was committed ("), said
        assert "it is valid and a restore takes it" in said[0], said
        assert "rank 0's work after the commit failed: PermissionError" in said[0], said
        assert "are kept until the next retention pass" in said[0], said
        assert "Training goes on." in said[0], said
        error = ck.after_commit_error
        assert error is not None and error.startswith("checkpoint for step 4 was committed ("), (
            error
        )
        assert ck.metrics()[PREFIX + "after_commit_failures_total"] == 3
        ck.save(5, state)  # listable again: its pass deletes steps 1 to 4 and clears it
        ck.flush()
        assert ck.after_commit_error is None
        steps = [e.step for e in catalog.committed(catalog.scan(str(root)))]
        assert steps == [5], steps
        assert not _errors(caplog, "close():")
        if not permissions.unlistable(root):  # (it was a moment ago)
            pytest.fail("the directory became listable")
        try:
            ck.save(6, state)  # the run's last checkpoint: its work after the commit fails
            ck.flush()
        finally:
            os.chmod(root, 0o755)
    at_close = _errors(caplog, "close():")
    assert len(at_close) == 1, at_close
    assert "the newest checkpoint (step 6)" in at_close[0], at_close
    assert "checkpoint for step 6 was committed (" in at_close[0], at_close


def test_a_commit_session_of_its_own_says_a_persisting_failure_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, honoured: None
):
    """A CommitSession used without a Checkpointer (a session per save, as a DeepSpeed engine
    or a script of the user's makes them) whose directory cannot be listed: its retention pass
    after each commit failed, and each raised CheckpointWriteError. Now each commit returns,
    with the failure as ``after_error``, said once for the five commits."""
    root = tmp_path / "ck"
    root.mkdir()
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    policy = RetentionPolicy(keep_last=1)
    if not permissions.unlistable(root):
        pytest.skip("this process lists a directory it has no read permission on")
    try:
        for step in range(1, 6):
            session = CommitSession(root, step, run_id="r", seq=step, retention=policy)
            staging = session.begin()
            assert staging is not None
            done = session.commit()
            assert done.step == step and session.after_error is not None
            assert f"checkpoint for step {step} was committed" in session.after_error
    finally:
        os.chmod(root, 0o755)
    said = _errors(caplog, AFTER)
    assert len(said) == 1, said
    assert "PermissionError" in said[0], said
    session = CommitSession(root, 6, run_id="r", seq=6, retention=policy)
    session.begin()
    session.commit()
    assert session.after_error is None  # listable again: its pass deleted the others
    steps = [e.step for e in catalog.committed(catalog.scan(str(root)))]
    assert steps == [6], steps


def test_a_commit_session_of_its_own_says_a_folder_it_cannot_delete_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """The same session's default retention with one old folder that cannot be deleted (a
    mount point: tests/test_retention_repeats.py): each session's pass logged the same ERROR
    again (a Checkpointer's directory remembers what it said; a session per save did not).
    Now it is said once; the others go as usual."""
    from test_retention_repeats import _undeletable

    root = tmp_path / "ck"
    root.mkdir()
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    policy = RetentionPolicy(keep_last=1)

    def commit(step: int) -> CommitSession:
        session = CommitSession(root, step, run_id="r", seq=step, retention=policy)
        session.begin()
        session.commit()
        return session

    commit(1)
    undo = _undeletable(root / "step_000000001")
    try:
        for step in range(2, 7):
            assert commit(step).after_error is None  # (a folder kept is no failed pass)
    finally:
        undo()
    said = _errors(caplog, "could not delete")
    assert len(said) == 1, said
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert kept == ["step_000000001", "step_000000006"], kept


def test_a_dcp_save_whose_retention_pass_fails_is_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, honoured: None
):
    """The DCP storage writer commits on the coordinator alone (``commit_here``): the
    retention pass after it that failed raised out of ``finish()``, and ``dcp.save`` failed
    over a checkpoint it had committed. Now it returns; the ERROR is said once. (The directory
    is made unlistable right after each commit of steps 2 and 3, as by an operator's chmod
    then: the save's plan lists it before.)"""
    import torch.distributed.checkpoint as dcp

    from resilient_callbacks.dcp import ResilientStorageWriter

    root = tmp_path / "ck"
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with ResilientStorageWriter(root, keep_last=1) as writer:
        for step in (1, 2, 3, 4):
            writer.step = step
            try:
                dcp.save({"w": torch.full((3,), float(step))}, storage_writer=writer)
            finally:
                os.chmod(root, 0o755)
            assert writer.last_committed == str(root / f"step_{step:09d}")
            assert (writer.after_commit_error is not None) == (step in (2, 3)), step
            d = writer._dir
            assert d is not None
            if step == 1:
                if not permissions.unlistable(root):
                    pytest.skip("this process lists a directory it has no read permission on")
                os.chmod(root, 0o755)
                real = d.after_commit

                def denied_then(committed, real=real):  # type: ignore[no-untyped-def]
                    os.chmod(root, 0o300)
                    real(committed)

                d.after_commit = denied_then  # type: ignore[method-assign]
            if step == 3:
                d.after_commit = real  # type: ignore[method-assign]
    said = _errors(caplog, AFTER)
    assert len(said) == 1 and "PermissionError" in said[0], said
    assert said[0].startswith("checkpoint for step 2 was committed ("), said
    steps = [e.step for e in catalog.committed(catalog.scan(str(root)))]
    assert steps == [4], steps


class _RefusingQueue:
    """An uploader whose queue refuses the checkpoint (as one that stopped may): the remote
    store is real, the refusal the only thing made up."""

    def __init__(self, url: str) -> None:
        from resilient_callbacks.remote import RemoteStore

        self.store = RemoteStore(url)

    def enqueue(self, name: str) -> None:
        raise RuntimeError(f"the upload queue refused {name}")

    def pending(self) -> set[str]:
        return set()


def test_an_upload_not_queued_says_the_push_that_uploads_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """Queueing the upload after a commit fails: the commit returns (it raised), and the
    ERROR says that the checkpoint is valid, that its upload is not queued, and the
    ``resilient-ckpt push`` that uploads it."""
    root, remote = tmp_path / "ck", tmp_path / "remote"
    root.mkdir()
    remote.mkdir()
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    session = CommitSession(root, 1, run_id="r", seq=1, sync=_RefusingQueue(f"file://{remote}"))
    session.begin()
    assert session.commit().step == 1
    said = _errors(caplog, AFTER)
    assert len(said) == 1 and said[0] == session.after_error, said
    assert "RuntimeError: the upload queue refused step_000000001" in said[0], said
    assert f"Its upload to file://{remote} is not queued: `resilient-ckpt push {root} " in said[0]
    assert f" file://{remote}` uploads it." in said[0], said


def test_a_checkpointer_says_its_own_first_failure_after_another_said_the_same(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, honoured: None
):
    """One process, two Checkpointers on one directory, one after the other (a second
    ``fit()``, a notebook's cell run again), whose retention passes after their first failing
    commit fail for the same reason: what was said was remembered by the process, by
    directory, so the second's failure went unsaid (DEBUG) for as long as it persisted, until
    its close(). Now each Checkpointer says its own first failure when it happens."""
    root = tmp_path / "ck"
    state = {"w": torch.zeros(10)}
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    for n, step in ((1, 2), (2, 3)):
        with Checkpointer(root, keep_last=1, async_save=False, preemption=False) as ck:
            if n == 1:
                ck.save(1, state)
            if not permissions.unlistable(root):
                pytest.skip("this process lists a directory it has no read permission on")
            try:
                ck.save(step, state)  # (the second's first save)
            finally:
                os.chmod(root, 0o755)
            assert ck.after_commit_error is not None
            said = [m for m in _errors(caplog, AFTER) if m.startswith("checkpoint for step")]
            assert len(said) == n, said  # (before close() says it again)
            assert said[-1].startswith(f"checkpoint for step {step} was committed ("), said


def test_an_upload_held_by_remote_every_n_saves_is_not_said_unqueued(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, honoured: None
):
    """``remote_every_n_saves=2``: the checkpoint of step 3 (commit 3) is not due for upload,
    held on purpose; its retention pass fails (the directory cannot be listed). The ERROR said
    "its upload to URL may not be queued (`resilient-ckpt push ...` uploads it)": the session
    could not tell an upload held from one whose queueing failed, and a user pushed for
    nothing. Now the upload is named only where its queueing failed (the test above)."""
    root, remote = tmp_path / "ck", tmp_path / "remote"
    state = {"w": torch.zeros(10)}
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(
        root,
        keep_last=1,
        async_save=False,
        preemption=False,
        remote=f"file://{remote}",
        remote_every_n_saves=2,
    ) as ck:
        ck.save(1, state)
        ck.save(2, state)  # (commit 2: uploaded)
        ck.flush()
        if not permissions.unlistable(root):
            pytest.skip("this process lists a directory it has no read permission on")
        try:
            assert ck.save(3, state) is True  # (commit 3: held, not due)
        finally:
            os.chmod(root, 0o755)
        error = ck.after_commit_error
        assert error is not None and error.startswith("checkpoint for step 3 was committed ("), (
            error
        )
        assert "rank 0's work after the commit failed: PermissionError" in error, error
        assert "its upload" not in error and "resilient-ckpt push" not in error, error
    said = [m for m in _errors(caplog, AFTER) if m.startswith("checkpoint for step 3")]
    assert said and all("resilient-ckpt push" not in m for m in said), said


def test_a_checkpointers_upload_not_queued_says_the_push_that_uploads_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A Checkpointer's uploader refuses the checkpoint of step 2 (the store real, the refusal
    made up): the save returns as committed, and the ERROR says that its upload is not queued
    and the push that uploads it (the uploader raised: Directory.after_commit knows it)."""
    root, remote = tmp_path / "ck", tmp_path / "remote"
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(root, async_save=False, preemption=False, remote=f"file://{remote}") as ck:
        ck.save(1, {"w": torch.zeros(3)})
        sync = ck._dir.sync
        assert sync is not None
        real_enqueue = sync.enqueue

        def refusing(name: str) -> None:
            if name == "step_000000002":
                raise RuntimeError(f"the upload queue refused {name}")
            real_enqueue(name)

        sync.enqueue = refusing  # type: ignore[method-assign]
        assert ck.save(2, {"w": torch.ones(3)}) is True
        error = ck.after_commit_error
        assert error is not None, error
        assert "RuntimeError: the upload queue refused step_000000002" in error, error
        assert f"Its upload to file://{remote} is not queued: `resilient-ckpt push" in error
    said = [m for m in _errors(caplog, AFTER) if m.startswith("checkpoint for step 2")]
    assert said, said


def test_a_nodes_queueing_and_retention_failing_after_one_commit_are_both_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """Node-local mode: a node's leader runs the retention pass after its upload queue refused
    the part (node_session._after_local_commit). When the pass failed too, the ERROR, the
    message kept (``after_commit_error``, the metric's event) named the queueing alone: an
    I/O error of the disk went unsaid. Both are named now, with what each leaves undone; the
    same pair at the next save is said once."""
    from resilient_callbacks import after_commit_work
    from resilient_callbacks.remote import RemoteStore
    from resilient_callbacks.repeats import Repeats

    class _Uploader:  # (what failed() reads of a node's uploader: its store)
        store = RemoteStore(f"file://{tmp_path / 'remote'}")

    queued = after_commit_work.UploadNotQueued("step_000000002")
    queued.__cause__ = RuntimeError("the upload queue refused step_000000002")
    disk = OSError(5, "Input/output error")
    said = Repeats()
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    args = ("k", queued, 2, f"{tmp_path}/step_000000002, on every node", "node 1", _Uploader)
    msg = after_commit_work.failed(*args, said=said, also=disk)
    assert "node 1's work after the commit failed: RuntimeError: the upload queue refused " in msg
    assert "; its retention pass failed too: OSError: [Errno 5] Input/output error." in msg, msg
    assert "are kept until the next retention pass." in msg, msg
    assert "Node 1's part of it is not queued for upload to file://" in msg, msg
    assert _errors(caplog, AFTER) == [msg]
    after_commit_work.failed(*args, said=said, also=disk)  # the next save: the same pair
    assert _errors(caplog, AFTER) == [msg]


def test_a_final_upload_held_that_cannot_be_queued_is_said_at_close_with_its_push(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """``remote_every_n_saves=3``: step 2 (commit 2) is held; the final ``save(final=True)``
    of step 2 (the DeepSpeed launcher's end) queues it, and the uploader refuses it. The
    RuntimeError left the final save (the launcher's job failed, on that rank alone), nothing
    said the run's last state was on this disk only. Now the final save returns, an ERROR
    names the checkpoint and the push that uploads it, the failure is kept and counted, and
    close() says it again as an ERROR without raising; that push uploads it."""
    from resilient_callbacks.cli import main
    from resilient_callbacks.remote import RemoteStore

    root, remote = tmp_path / "ck", tmp_path / "remote"
    url = f"file://{remote}"
    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(
        root, async_save=False, preemption=False, remote=url, remote_every_n_saves=3
    ) as ck:
        ck.save(1, {"w": torch.zeros(3)})
        ck.save(2, {"w": torch.ones(3)})
        sync = ck._dir.sync
        assert sync is not None

        def refusing(name: str) -> None:
            raise RuntimeError(f"the upload queue refused {name}")

        sync.enqueue = refusing  # type: ignore[method-assign]
        assert ck.save(2, {"w": torch.ones(3)}, final=True) is False
        error = ck.after_commit_error
        assert error is not None and error.startswith("the run's last checkpoint, of step 2 (")
        assert "RuntimeError: the upload queue refused step_000000002" in error, error
        push = f"`resilient-ckpt push {root} {url}` uploads it."
        assert error.endswith(push), error
        assert ck.metrics()[f"{PREFIX}after_commit_failures_total"] == 1
    said = _errors(caplog, "the run's last checkpoint, of step 2")
    assert len(said) == 2 and said[1].startswith("close(): the work after the commit"), said
    assert not RemoteStore(url).scan()
    assert main(["push", str(root), url]) == 0
    assert 2 in [e.manifest.step for e in RemoteStore(url).scan() if e.manifest]
