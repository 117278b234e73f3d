"""The CLI beside a training run on the same directory: a real process holds the directory as
``resilient-ckpt`` does while it works, and a writer opens meanwhile."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import threading

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer

# runs `resilient-ckpt gc DIR` for real, held (lock taken) until a line comes on stdin
_GC_HELD = """
import sys
from resilient_callbacks import cli, cli_local
real = cli_local._gc
def held(args, root):
    print("held", flush=True)
    sys.stdin.readline()
    return real(args, root)
cli_local._gc = held
sys.exit(cli.main(["gc", sys.argv[1]]))
"""


def _save(root: str, steps) -> None:
    model = torch.nn.Linear(3, 2)
    with Checkpointer(root, keep_last=None) as ck:
        for s in steps:
            ck.save(s, {"model": model})


def test_a_run_started_while_gc_holds_the_directory_waits_for_it(tmp_path):
    """A training run (re)started while an operator's `resilient-ckpt gc` cleaned its directory
    (a Slurm requeue, say) failed at once with CheckpointLockedError, "another process is
    writing checkpoints ... Two runs must not share a checkpoint directory", naming neither
    gc nor what to do. A writer now waits for a command holding the directory (gc, pull,
    push), says so in the log, and opens when it is done."""
    root = str(tmp_path / "ck")
    _save(root, (10, 20))
    # a process of its own, forked from the session's zygote (torch imported once)
    errs = tmp_path / "gc.err"
    gc = spawn_ranks.Piped([sys.executable, "-c", _GC_HELD, root], err=errs)
    assert gc.stdout.readline().strip() == "held", errs.read_text()
    said: list[str] = []
    waiting = threading.Event()

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
            if "resilient-ckpt gc" in said[-1]:
                waiting.set()

    handler = Said()
    logging.getLogger("resilient_callbacks").addHandler(handler)
    result: dict[str, object] = {}

    def run() -> None:
        # the requeued run as a training script is: restore() first (without it, the earlier
        # checkpoints are another run's, and a ForeignCheckpointsWarning says so); in a thread,
        # where no signal handler can be installed: preemption=False (else a RuntimeWarning)
        try:
            model = torch.nn.Linear(3, 2)
            with Checkpointer(root, keep_last=None, preemption=False) as ck:
                assert ck.restore({"model": model}) == 20
                ck.save(30, {"model": model})
        except Exception as e:  # (the old behaviour: CheckpointLockedError at once)
            result["error"] = e

    writer = threading.Thread(target=run)
    try:
        writer.start()
        while not waiting.is_set() and writer.is_alive():
            waiting.wait(0.05)
        gc.stdin.write("\n")
        gc.stdin.close()
        gc.wait(timeout=120)
        writer.join(timeout=120)
    finally:
        logging.getLogger("resilient_callbacks").removeHandler(handler)
        if gc.poll() is None:
            gc.kill()
    assert "error" not in result, result["error"]
    assert gc.returncode == 0, errs.read_text()
    assert any("waiting for it to finish" in m for m in said), said
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == [
        f"step_{s:09d}" for s in (10, 20, 30)
    ]


def test_gc_dry_run_beside_a_live_writer_says_so_and_lists_not_its_save(tmp_path):
    """`gc --dry-run` runs beside a live writer, but said nothing of it: it listed the running
    save's staging folder as "would delete ... incomplete", and the real gc then refused. It
    now says a writer is open (stderr; `"writer_open": true` in --json) and leaves out the
    save in progress."""
    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    _save(str(root), (10, 20))
    with Checkpointer(str(root), keep_last=None):  # the run, live (its lock held)
        (root / ".staging-step_000000030-abc123").mkdir()  # its save in flight
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["gc", str(root), "--dry-run", "--json"])
        assert code == 0, err.getvalue()
        result = json.loads(out.getvalue())
        assert result["delete"] == [] and result["writer_open"] is True
        assert "a writer is open" in err.getvalue()
        assert len(result["keep"]) == 2
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the writer gone: a crash's leftover, deleted
        assert main(["gc", str(root), "--dry-run", "--json"]) == 0
    result = json.loads(out.getvalue())
    assert result["writer_open"] is False
    assert [d["name"] for d in result["delete"]] == [".staging-step_000000030-abc123"]


# `resilient-ckpt gc DIR --dry-run --json` in a process of its own (a notebook's `!resilient-ckpt`)
_DRY_RUN = """
import sys
from resilient_callbacks.cli import main
sys.exit(main(["gc", sys.argv[1], "--dry-run", "--json"]))
"""


def test_gc_dry_run_after_the_writer_closed_in_a_process_still_alive_sees_no_writer(tmp_path):
    """A notebook: train, ``close()`` the Checkpointer, then ``!resilient-ckpt gc --dry-run
    DIR``. It said "a writer is open": the lock file kept the closed writer's pid after it
    released the lock, and that process (the notebook's kernel) was alive. A released lock now
    names no holder; a writer still open is said as before (from another process and this
    one)."""
    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep_last=None, async_save=False)
    ck.save(10, {"model": torch.nn.Linear(3, 2)})
    r = spawn_ranks.run_python([sys.executable, "-c", _DRY_RUN, str(root)])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["writer_open"] is True and "a writer is open" in r.stderr
    ck.close()
    r = spawn_ranks.run_python([sys.executable, "-c", _DRY_RUN, str(root)])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["writer_open"] is False, r.stderr
    assert "a writer is open" not in r.stderr, r.stderr
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["gc", str(root), "--dry-run", "--json"]) == 0  # (in this process too)
    assert json.loads(out.getvalue())["writer_open"] is False, err.getvalue()


def test_gc_dry_run_leaves_out_what_the_writers_retention_deleted_while_it_read(
    tmp_path, monkeypatch
):
    """A checkpoint the live run's retention deleted while `gc --dry-run` verified it was listed
    as "would delete step_... (incomplete (deleted while it was being read))": it is gone, and
    is no longer listed."""
    import shutil

    from resilient_callbacks import cli_local
    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    _save(str(root), (10, 20, 30))
    real = cli_local.check

    def retention_meanwhile(e, *a):
        if e.name == "step_000000010" and os.path.isdir(e.path):
            shutil.rmtree(e.path)
        return real(e, *a)

    monkeypatch.setattr(cli_local, "check", retention_meanwhile)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["gc", str(root), "--dry-run", "--json"]) == 0
    result = json.loads(out.getvalue())
    assert result["delete"] == []
    assert [k["name"] for k in result["keep"]] == ["step_000000020", "step_000000030"]


@pytest.mark.parametrize("extra", [[], ["--all"], ["--step", "99"]])
def test_verify_json_with_nothing_to_check_prints_json(tmp_path, extra):
    """`verify DIR --json` printed nothing on stdout when DIR held no checkpoint (or none of
    step N), unlike `ls --json` (`[]`) and `gc --json`: a monitoring script's `jq .ok` got no
    input. It prints the object, `"ok": false`, the note on stderr, and exits 3 (nothing to act on;
    1 for a step N not there)."""
    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    root.mkdir()
    if extra[:1] == ["--step"]:
        _save(str(root), (10,))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", str(root), "--json", *extra])
    assert code == (1 if extra[:1] == ["--step"] else 3)  # 3: nothing to act on; 1: no step 99
    result = json.loads(out.getvalue())
    assert result["ok"] is False and result["verified"] == 0 and result["checkpoints"] == []
    assert "no checkpoint" in err.getvalue()


def test_push_from_a_read_only_mount(tmp_path, monkeypatch):
    """`push` of a directory on a read-only mount (a snapshot, another user's run) failed with
    "OSError: [Errno 30] Read-only file system: '.../.lock'", though it only reads there. With
    no live writer it now pushes without the lock, and says so."""
    import errno

    from resilient_callbacks.cli import main
    from resilient_callbacks.lock import DirLock

    root = tmp_path / "ck"
    _save(str(root), (10, 20))

    def read_only(self):
        raise OSError(errno.EROFS, "Read-only file system", self.path)

    monkeypatch.setattr(DirLock, "acquire", read_only)
    out, err = io.StringIO(), io.StringIO()
    url = (tmp_path / "remote").as_uri()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["push", str(root), url, "--json"])
    assert code == 0, err.getvalue()
    assert [p["step"] for p in json.loads(out.getvalue())["pushed"]] == [10, 20]
    assert "going on without it" in err.getvalue()


def test_push_cut_short_by_ctrl_c_leaves_no_partial_upload(tmp_path, monkeypatch):
    """Ctrl-C in `push` after a checkpoint's files went up but before its manifest left them
    on the remote: nothing committed, but `ls --remote` showed the checkpoint as "uploading"
    for ever (until `gc --remote`, 24 h later). Now the partial upload is removed on the way
    out (exit 130); what was pushed before stays, and a second push completes."""
    from resilient_callbacks import remote
    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    _save(str(root), (10, 20))
    url = (tmp_path / "remote").as_uri()
    real = remote.ManifestLastCommit.commit

    def interrupted(self, name, *a, **k):
        if name == "step_000000020":
            raise KeyboardInterrupt
        return real(self, name, *a, **k)

    monkeypatch.setattr(remote.ManifestLastCommit, "commit", interrupted)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main(["push", str(root), url]) == 130
    assert sorted(p.name for p in (tmp_path / "remote").iterdir()) == ["step_000000010"]
    monkeypatch.setattr(remote.ManifestLastCommit, "commit", real)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["push", str(root), url, "--json"]) == 0
    assert [p["step"] for p in json.loads(out.getvalue())["pushed"]] == [20]


def test_push_cut_short_by_ctrl_c_never_removes_another_writers_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C in `push` while another writer (a run given the same URL) committed a checkpoint
    of the same name: the cleanup on the way out removed every object under the name unless
    the manifest there was push's own, so it deleted the other run's committed checkpoint. Now
    it removes only an upload that no manifest committed."""
    import shutil

    from resilient_callbacks import remote
    from resilient_callbacks.cli import main

    root, other = tmp_path / "ck", tmp_path / "other"
    _save(str(root), (20,))
    _save(str(other), (20,))  # another run's step 20
    url = (tmp_path / "remote").as_uri()

    def interrupted(self, name, *a, **k):  # the other writer commits first, then Ctrl-C
        shutil.copytree(other / name, tmp_path / "remote" / name, dirs_exist_ok=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(remote.ManifestLastCommit, "commit", interrupted)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["push", str(root), url]) == 130
    monkeypatch.undo()
    theirs = (other / "step_000000020" / "manifest.json").read_bytes()
    assert (tmp_path / "remote" / "step_000000020" / "manifest.json").read_bytes() == theirs


def test_export_of_a_checkpoint_retention_deletes_meanwhile(tmp_path, monkeypatch, capsys):
    """`export DIR OUT` beside a running job: the newest checkpoint, chosen and verified, was
    deleted by the run's retention before export read its tensors, and export failed with
    "FileNotFoundError: ... manifest.json". It now exports the newest valid one left (said on
    stderr); with --step the error says what happened."""
    import shutil

    from resilient_callbacks import consolidate
    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    _save(str(root), (10, 20, 30))
    real = consolidate.entry_tensors

    def retention_meanwhile(path, key):
        if path.endswith("step_000000030"):
            shutil.rmtree(path)
        return real(path, key)

    monkeypatch.setattr(consolidate, "entry_tensors", retention_meanwhile)
    assert main(["export", str(root), str(tmp_path / "out")]) == 0
    said = capsys.readouterr()
    assert "step_000000030 was deleted while it was read" in said.err
    assert json.loads((tmp_path / "out" / "export.json").read_text())["step"] == 20

    def step_20_meanwhile(path, key):
        if path.endswith("step_000000020"):
            shutil.rmtree(path)
        return real(path, key)

    monkeypatch.setattr(consolidate, "entry_tensors", step_20_meanwhile)
    assert main(["export", str(root), str(tmp_path / "out2"), "--step", "20"]) == 1
    err = capsys.readouterr().err
    assert "step_000000020 was deleted while export read it" in err and "Traceback" not in err
    assert not (tmp_path / "out2").exists()


def test_pull_and_push_beside_a_live_run_say_what_to_do(tmp_path, capsys):
    """`pull URL DIR` into the directory of a running job said "another process is writing
    checkpoints to DIR ... Two runs must not share a checkpoint directory: give this run its
    own dirpath": advice for a second training run, not for an operator's pull. It now says a
    training run is open there, that the command changes nothing beside it, and what to do."""
    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    _save(str(root), (10,))
    url = (tmp_path / "remote").as_uri()
    assert main(["push", str(root), url]) == 0
    with Checkpointer(str(root), keep_last=None):  # the live run
        capsys.readouterr()
        for cmd in (["pull", url, str(root)], ["push", str(root), url]):
            assert main(cmd) == 1
            err = capsys.readouterr().err
            assert "Two runs must not share" not in err, err
            assert f"`resilient-ckpt {cmd[0]}` changes nothing beside it" in err, err


def test_a_distributed_writer_waits_less_than_its_ranks_collective_timeout(tmp_path, monkeypatch):
    """Rank 0 opens the directory while the other ranks wait for it in a collective: its wait
    for a command holding the directory (10 min alone) must end before their collective times
    out (a 10-minute NCCL default would otherwise kill the job while rank 0 still waits), and
    its error then names the command."""
    import datetime

    from resilient_callbacks import dist
    from resilient_callbacks.errors import CheckpointLockedError
    from resilient_callbacks.lock import COMMAND_WAIT_S, DirLock

    assert dist.wait_before_collective(COMMAND_WAIT_S) == COMMAND_WAIT_S  # one process
    root = tmp_path / "ck"
    root.mkdir()
    gc = DirLock(str(root), command="gc")  # (its own open file: a lock apart, in one process)
    gc.acquire()
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "world_timeout", lambda: datetime.timedelta(seconds=2))
    assert dist.wait_before_collective(COMMAND_WAIT_S) == 1.0
    try:
        with pytest.raises(CheckpointLockedError, match=r"resilient-ckpt gc.*after 1 s"):
            Checkpointer(str(root))
    finally:
        gc.release()


# a writer that gets SIGTERM while it waits for the held gc (sent once it says it waits)
_WRITER_SIGNALLED = """
import logging, os, signal, sys
import torch
from resilient_callbacks import Checkpointer

class Kill(logging.Handler):
    def emit(self, record):
        if "waiting for it to finish" in record.getMessage():
            os.kill(os.getpid(), signal.SIGTERM)

logging.basicConfig()
logging.getLogger("resilient_callbacks").addHandler(Kill())
with Checkpointer(sys.argv[1], keep_last=None) as ck:
    ck.save(30, {"model": torch.nn.Linear(3, 2)})
"""


def test_a_writer_preempted_while_it_waits_for_a_command_stops_waiting(tmp_path):
    """Since the signal handlers are installed first in Checkpointer(), a SIGTERM while the
    writer waited (up to 10 min) for an operator's `resilient-ckpt gc` to release the directory
    was recorded and the wait went on, past the grace period to the SIGKILL (before, the signal
    ended the process at once). The wait now ends on a preemption request."""
    root = str(tmp_path / "ck")
    _save(root, (10, 20))
    # processes of their own, forked from the session's zygote (torch imported once)
    errs = tmp_path / "gc.err"
    gc = spawn_ranks.Piped([sys.executable, "-c", _GC_HELD, root], err=errs)
    try:
        assert gc.stdout.readline().strip() == "held", errs.read_text()
        writer = spawn_ranks.run_python(
            [sys.executable, "-c", _WRITER_SIGNALLED, root],
            timeout=120,  # (it waits 600 s for the gc if the request does not end the wait)
        )
    finally:
        gc.kill()
        gc.wait(timeout=120)
    assert writer.returncode != 0, writer.stderr
    assert "CheckpointLockedError" in writer.stderr, writer.stderr
    assert "a preemption request" in writer.stderr, writer.stderr
    assert "SIGTERM arrived while Checkpointer() failed" in writer.stderr, writer.stderr
    assert not (tmp_path / "ck" / "step_000000030").exists()
