"""The history's ``upload`` records as :func:`.history.uploads` reads them for gc's "not
uploaded as far as the history shows" and a restore's "uploaded, then deleted there": two
notions of time, the upload's (the record's) and the checkpoint's commit (less ``lag_s``)."""

from __future__ import annotations

import json

from resilient_callbacks import history


def _write(root, *recs):
    with open(root / history.HISTORY_NAME, "a") as f:
        for r in recs:
            f.write(json.dumps({"event": "upload", "step": 1, "world_size": 1, **r}) + "\n")


def test_uploads_gives_each_names_newest_upload_and_commit_time(tmp_path):
    _write(
        tmp_path,
        {"time": 100.0, "run_id": "r", "name": "a", "lag_s": 30.0},
        {"time": 90.0, "run_id": "r", "name": "a", "lag_s": 5.0},  # (out of order)
        {"time": 200.0, "run_id": "r", "name": "b"},  # a foreign line: no lag_s
        {"time": 300.0, "run_id": "r", "name": "c", "lag_s": "soon"},  # not a number
        {"time": 400.0, "run_id": "other", "name": "d", "lag_s": 1.0},
        {"time": 500.0, "run_id": "r", "name": 7, "lag_s": 1.0},  # no name: skipped
    )
    got = history.uploads(str(tmp_path), "r")
    assert got == {
        "a": history.Upload(time=100.0, committed=85.0),
        "b": history.Upload(time=200.0, committed=None),
        "c": history.Upload(time=300.0, committed=None),
    }
    assert set(history.uploads(str(tmp_path), "other")) == {"d"}
    assert history.uploads(str(tmp_path / "nowhere"), "r") == {}


def test_uploads_gives_each_names_commit_numbers_a_node_local_restart_reads(tmp_path):
    """A node-local coordinator records the commit number of each remote commit (``seq``); a
    restart uploads none of those again (node_recovery.committed_seqs, which reads them here):
    a name committed twice (a later checkpoint under a deleted one's name) gives both."""
    from types import SimpleNamespace

    from resilient_callbacks import node_recovery

    _write(
        tmp_path,
        {"time": 100.0, "run_id": "r", "name": "step_2", "seq": 1},
        {"time": 110.0, "run_id": "r", "name": "step_4", "seq": 2},
        {"time": 120.0, "run_id": "r", "name": "step_2", "seq": 5},
        {"time": 130.0, "run_id": "r", "name": "step_6"},  # (the uploader's: no seq)
        {"time": 140.0, "run_id": "other", "name": "step_8", "seq": 3},
    )
    got = history.uploads(str(tmp_path), "r")
    assert {n: u.seqs for n, u in got.items()} == {
        "step_2": {1, 5},
        "step_4": {2},
        "step_6": frozenset(),
    }
    d = SimpleNamespace(dirpath=str(tmp_path), run_id="r")
    assert node_recovery.committed_seqs(d) == [1, 2, 5]  # type: ignore[arg-type]
