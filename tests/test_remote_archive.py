"""``keep_every_n_steps`` with ``remote_every_n_saves`` > 1: the archive points reach the remote
tier as they are saved (docs/remote.md, docs/multinode.md "Intervals per tier"). An archive
point was uploaded only when it was also an Nth save: otherwise it lay on the local disks only
(in node-local mode: lost with a node), "kept remotely forever" by a remote retention that was
never given it. Node-local tests: two gloo ranks, one node each, through the worker of
tests/test_nodelocal_failures.py (a save every 2 steps: step 4 is commit 2, step 8 commit 4)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from resilient_callbacks import Checkpointer, remote_best
from resilient_callbacks.retention import RetentionPolicy
from test_nodelocal_failures import _run
from test_remote_best import _committed


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_node_local_an_archive_point_is_uploaded_though_not_an_nth_save(tmp_path):
    """remote_every_n_saves=3 uploads commit 3 (step 6) alone: the archive points of steps 4
    and 8 (commits 2 and 4) stayed on the nodes' disks. They are now committed remotely as
    they are saved (rank 0 decides for every node), and the remote retention keeps them; a
    restart finds nothing to upload again."""
    common = ("--steps", "8", "--remote-every", "3")
    _run(tmp_path, "first", 2, *common, RC_KEEP_EVERY=4)
    want = ["step_000000004", "step_000000006", "step_000000008"]
    assert _committed(tmp_path / "remote") == want
    out = _run(tmp_path, "second", 2, *common, RC_KEEP_EVERY=4, RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [8, 8], out
    for rank in out:
        assert "uploading its part" not in rank[-1]["log"], rank[-1]["log"]
    assert _committed(tmp_path / "remote") == want


def _shared_run(local: str, url: str, last: int, **kw) -> int:
    """Saves of every step to ``last``, every 3rd uploaded; archive points every 4 steps."""
    state = {"w": torch.zeros(4)}
    opts = {"every_n_steps": 1, "keep_last": 1, "keep_every_n_steps": 4, "async_save": False}
    opts |= {"remote": url, "remote_every_n_saves": 3, **kw}
    with Checkpointer(local, **opts) as ck:
        start = ck.restore(state)
        for step in range(start + 1, last + 1):
            state["w"] += 1
            ck.step(step, state)
    return start


def test_shared_an_archive_point_is_uploaded_once_though_not_an_nth_save(tmp_path, caplog):
    """One writer on a shared filesystem: commits 3 and 6 were uploaded, the archive points
    (steps 4 and 8) were not, and the remote retention (keep_last=1) kept step 6 alone. Now
    they are uploaded as they are saved; a restart finds nothing to upload again."""
    local, remote = str(tmp_path / "local"), tmp_path / "durable"
    url = f"file://{remote}"
    _shared_run(local, url, 8)
    assert _committed(remote) == ["step_000000004", "step_000000008"]
    kept = sorted(n for n in os.listdir(local) if n.startswith("step_"))
    assert kept == ["step_000000004", "step_000000008"]  # (archive points, keep_last)
    caplog.set_level(logging.INFO, "resilient_callbacks")
    assert _shared_run(local, url, 8) == 8
    assert "uploading them now" not in caplog.text, caplog.text
    assert _committed(remote) == ["step_000000004", "step_000000008"]


def test_the_archive_point_that_is_due_is_the_remote_retentions():
    """What makes a save due whatever the interval is what the remote retention keeps beyond
    its keep_last: an archive point of its policy, or one recorded when it was written, then
    one of the best; the interval first (ranking reads the directory: not asked then)."""
    policy = RetentionPolicy(keep_last=1, keep_every_n_steps=4)

    def never() -> bool:
        raise AssertionError("ranked though due without it")

    assert remote_best.why_due(True, 4, policy, never) == remote_best.INTERVAL
    assert remote_best.why_due(False, 8, policy, never) == remote_best.ARCHIVE
    recorded = remote_best.why_due(False, 6, RetentionPolicy(), never, archived=True)
    assert recorded == remote_best.ARCHIVE
    assert remote_best.why_due(False, 6, policy, lambda: True) == remote_best.BEST
    assert remote_best.why_due(False, 6, policy, lambda: False) is None


def test_a_schedule_whose_every_save_is_an_archive_point_warns_that_each_is_uploaded(tmp_path):
    """keep_every_n_steps dividing every_n_steps makes every save an archive point, uploaded as
    it is saved whatever remote_every_n_saves says: a run set up to upload every 5th save
    uploaded (and kept forever remotely) every one, without a word. The writer warns at its
    construction; a keep_every_n_steps that does not divide the interval does not."""
    url = (tmp_path / "durable").as_uri()
    opts = {"remote": url, "remote_every_n_saves": 5, "every_n_steps": 10, "async_save": False}
    with pytest.warns(UserWarning, match="keep_every_n_steps=10 divides every_n_steps=10") as w:
        Checkpointer(str(tmp_path / "a"), keep_every_n_steps=10, **opts).close()
    said = str(w[0].message)
    assert "remote_every_n_saves=5 uploads nothing less than every save" in said, said
    assert "make keep_every_n_steps a multiple of 50" in said, said
    with pytest.warns(UserWarning, match="keep_every_n_steps=5 divides every_n_steps=10"):
        Checkpointer(str(tmp_path / "b"), keep_every_n_steps=5, **opts).close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (none: every 5th save an archive point, as uploaded)
        Checkpointer(str(tmp_path / "c"), keep_every_n_steps=50, **opts).close()
