"""Node-local mode when the layout of nodes changes between runs (docs/multinode.md, "Keep
ranks on their nodes"): the same 4 ranks, first on 4 nodes of one rank, then on 2 nodes of two,
each "node" a directory of its own (``<base>/node<N>``), the remote a ``file://`` directory.
The worker is tests/test_nodelocal_failures.py's."""

from __future__ import annotations

import pytest

from resilient_callbacks.remote import RemoteStore
from test_nodelocal_failures import _run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.mark.slow  # 4 ranks, twice
def test_a_checkpoint_of_another_layout_of_nodes_is_not_uploaded_again(tmp_path):
    """Step 8, saved on 4 nodes and not uploaded (every 3rd save is), cannot be restored on 2
    nodes of two ranks (each node's disk holds one rank's files of it): the restore says so and
    resumes from step 6, fetched from the remote, exactly. The restart then uploaded the nodes'
    parts of step 8 again, which hold 2 of its 4 ranks: its remote commit failed 5 times,
    holding the newer commits back, and the re-save of step 8 went to step_000000008-r1. Now
    those parts stay local."""
    _run(tmp_path, "first", 4, "--steps", "8", "--remote-every", "3")  # 4 nodes of one rank
    out = _run(tmp_path, "second", 4, "--steps", "10", per_node=2, RC_CAPTURE_LOG=1)
    assert [rank[0]["restored"] for rank in out] == [6] * 4
    assert [rank[0]["counter_rank"] for rank in out] == [0, 1, 2, 3]
    log = out[0][-1]["log"]
    assert "skipping step 8 (commit 4): node 0 has no copy of its files" in log, log
    assert "remote commit of step_000000008 failed" not in log, log
    assert "saved on another layout of nodes" in log, log
    store = RemoteStore(f"file://{tmp_path}/remote")
    committed = sorted(e.name for e in store.scan() if e.manifest is not None)
    assert committed == ["step_000000006", "step_000000008", "step_000000010"], committed
