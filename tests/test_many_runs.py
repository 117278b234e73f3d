"""A run of many saves, and many runs in one process (a sweep, a notebook): what a run holds
stays bounded by what it keeps, not by how many saves it made."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.manifest import FileEntry


def _live_file_entries() -> int:
    gc.collect()
    return sum(isinstance(o, FileEntry) for o in gc.get_objects())


def _run(dirpath, saves: int, url: str, options) -> tuple[Checkpointer, int]:
    """``saves`` saves uploaded to ``url`` (keep_last=2 there too), closed; the Checkpointer
    (kept alive: a caller's reference) and the FileEntry objects alive then."""
    state = {"w": torch.zeros(64), "b": torch.zeros(8), "extra": {"n": 0}}
    ck = Checkpointer(
        dirpath, every_n_steps=1, keep_last=2, remote=url, remote_options=options, preemption=False
    )
    ck.restore(state)
    for step in range(1, saves + 1):
        state["w"].add_(1.0)
        state["extra"]["n"] = step
        ck.step(step, state)
    ck.close()
    return ck, _live_file_entries()


@pytest.fixture(params=["file", "s3"])
def remote_url(request, tmp_path):
    if request.param == "file":
        return lambda name: (f"file://{tmp_path}/durable/{name}", None)
    url, options = request.getfixturevalue("s3_remote")
    return lambda name: (f"{url}/{name}", options)


def test_a_long_run_keeps_nothing_of_the_uploads_its_retention_deleted(
    tmp_path, remote_url, caplog
):
    """The uploader remembered every upload it began or committed, for the life of the
    process, each with its manifest's file list and blobs (found 2026-12-07: 500 saves to S3
    held ~430 file entries of deleted checkpoints, one list per save; an incremental run's
    blobs too): what the retention deletes is forgotten. A run of 60 saves holds no more than
    one of 5; none of its own deleted checkpoints, still in a listing taken before the delete,
    is taken for another process's."""
    before = _live_file_entries()
    short, after_short = _run(tmp_path / "short", 5, *remote_url("short"))
    long, after_long = _run(tmp_path / "long", 60, *remote_url("long"))
    # both Checkpointers are alive: the long one holds what the short one holds (2 kept
    # checkpoints' worth; a save's manifest lists 3-4 files: the growth was 3-4 per save)
    held_short, held_long = after_short - before, after_long - after_short
    assert held_long <= held_short + 10, (held_short, held_long)
    del short, long
    assert "another live process" not in caplog.text


def _process_state() -> dict:
    """What a run could leave behind in the process, as a count or an identity."""
    import logging
    import os
    import signal
    import sys
    import threading

    gc.collect()
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    return {
        "signals": {
            s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        },
        "threads": sorted(t.name for t in threading.enumerate()),
        "fds": len(os.listdir("/proc/self/fd")),
        "hooks": (sys.excepthook, threading.excepthook, sys.unraisablehook),
        "log handlers": sum(len(lg.handlers) + len(lg.filters) for lg in loggers),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def test_a_sweep_of_runs_in_one_process_leaves_nothing_behind(tmp_path):
    """Runs one after another in one process (a hyper-parameter sweep, a notebook): one that
    ended, one that raised in its ``with`` block, one preempted with
    ``exit_on_preemption=False``, each again on the same dirpath. After each: the handlers,
    threads, file descriptors, hooks and logging handlers of before, the lock free (the next
    run on the dirpath resumes), and the process not taken for one exiting."""
    import os
    import signal

    from resilient_callbacks.preemption import exiting

    def trial(name: str, how: str) -> int:
        state = {"w": torch.zeros(16), "extra": {"n": 0}}
        with Checkpointer(tmp_path / name, every_n_steps=2, exit_on_preemption=False) as ck:
            start = ck.restore(state)
            for step in range(start + 1, start + 6):
                state["w"].add_(1.0)
                if how == "raise" and step == start + 4:
                    raise ValueError("the trial's training failed")
                if how == "preempt" and step == start + 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                ck.step(step, state)
                if ck.preempted:
                    break
        return start

    trial("warm-up", "end")
    before = _process_state()
    for how in ("end", "raise", "preempt"):
        with contextlib.suppress(ValueError):
            trial(how, how)
        assert _process_state() == before, how
        assert exiting.code() is None, how
        assert trial(how, "end") > 0, how  # resumed: the lock was free
        assert _process_state() == before, how


def test_a_sweep_with_a_remote_per_trial_keeps_no_entry_per_trial(tmp_path):
    """The claim of each remote URL (one writer per store in a process) stayed in a module
    table after its writer was gone: one entry per trial of a sweep that gives each trial its
    own remote, for the life of the process."""
    from resilient_callbacks import lock

    for trial in range(4):
        state = {"w": torch.zeros(8)}
        ck = Checkpointer(
            tmp_path / f"t{trial}",
            every_n_steps=1,
            remote=f"file://{tmp_path}/durable/t{trial}",
            preemption=False,
        )
        ck.restore(state)
        ck.step(1, state)
        ck.close()
        del ck
        gc.collect()
    mine = [k for k in lock._remotes if k.startswith(f"file://{tmp_path}/")]
    assert len(mine) <= 1, mine


def _fail_and_drop(trial, before: dict) -> None:
    """Run ``trial(raises=True)``, whose Checkpointer is dropped unclosed as its error
    propagates; collect it, and let the threads told to end as it was collected (those not
    in ``before``) end."""
    with contextlib.suppress(ValueError):
        trial(raises=True)
    gc.collect()
    for t in threading.enumerate():
        if t.name not in before["threads"]:
            t.join(timeout=60)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_a_trial_that_raised_unclosed_leaves_nothing_once_dropped(tmp_path, remote):
    """A sweep's trial whose training raised outside a ``with`` block (its ``close()`` never
    called), the Checkpointer then dropped: its background-save thread kept the last save's
    job, and with it the Checkpointer, for ever; its lock, thread and signal handlers stayed,
    one of each per such trial (found 2026-12-07: the same dirpath was refused as "already
    has a writer open", and the trials' watchers took every SIGTERM). Now it goes with its
    lock, thread and handlers, and the next trial on its dirpath resumes. With ``remote=``,
    the dropped Checkpointer released its lock but left its upload thread (rc-upload) running
    for the life of the process, still uploading from the directory the next trial had opened,
    to the store it had claimed (found the same day); now the thread is told to stop, and the
    next trial uploads what was left."""
    options = {"remote": f"file://{tmp_path}/remote"} if remote else {}

    def trial(raises: bool) -> int:
        state = {"w": torch.zeros(16)}
        ck = Checkpointer(tmp_path / "trial", every_n_steps=1, keep_last=1, **options)
        start = ck.restore(state)
        for step in range(start + 1, start + 3):
            state["w"].add_(1.0)
            ck.step(step, state)
        if raises:
            ck.flush()  # (its saves done: nothing but the thread holds it)
            raise ValueError("the trial's training failed")
        ck.close()
        return start

    trial(raises=False)  # (warm-up: what the first run imports and starts once)
    before = _process_state()
    _fail_and_drop(trial, before)
    assert _process_state() == before
    assert trial(raises=False) == 4
    assert _process_state() == before


def test_a_trial_with_metadata_notices_that_raised_unclosed_leaves_no_poller_once_dropped(
    tmp_path,
):
    """As above, with ``metadata_notices=``: the dropped Checkpointer left its cloud notice
    poller's thread polling for the life of the process, one per such trial, for a watcher
    already uninstalled (found 2026-12-07). Now it is told to stop."""
    notices = {"kind": "aws", "url": "http://127.0.0.1:9/", "timeout_s": 0.1}

    def trial(raises: bool) -> None:
        state = {"w": torch.zeros(16)}
        ck = Checkpointer(tmp_path / "trial", every_n_steps=1, metadata_notices=notices)
        ck.restore(state)
        ck.step(1, state)
        if raises:
            ck.flush()  # (its saves done: nothing but the thread holds it)
            raise ValueError("the trial's training failed")
        ck.close()

    trial(raises=False)  # (warm-up: what the first run imports and starts once)
    before = _process_state()
    _fail_and_drop(trial, before)
    assert _process_state() == before
