"""``resilient-ckpt gc`` (and ``ls``) in one node's directory of a node-local run
(docs/multinode.md, docs/cli.md): a node's part of a checkpoint that the remote store does not
hold committed may be the only copy of that node's ranks' files, so gc never deletes it by
retention. Two ranks on this machine, each "node" with its own directory, the remote a
``file://`` directory (the harness of tests/test_nodelocal_failures.py)."""

from __future__ import annotations

import json
import os

import pytest

from test_nodelocal_failures import _run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _steps(node_dir) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(node_dir) if n.startswith("step_"))


def test_gc_keeps_a_nodes_parts_the_remote_does_not_hold(tmp_path, capsys):
    """Node 1 is killed in its local commit of step 8 (node 0 committed its part, never
    recorded as committed on every node); only every 10th save is uploaded, so the remote holds
    none. `gc node0 --keep-last 1` deleted node 0's parts of steps 4 and 6 and kept its part of
    step 8, which the restore must remove (node 1 has none): the next run found nothing every
    node holds and refused to start (NoValidCheckpointError). gc keeps them now."""
    from resilient_callbacks.cli import main

    _run(tmp_path, "first", 2, "--steps", "8", "--remote-every", "10", expect=None,
         RC_DIE_IN_COMMIT_AT=8)  # fmt: skip
    node0, url = tmp_path / "node0", f"file://{tmp_path}/remote"
    before = _steps(node0)
    assert before[-2:] == [6, 8] and _steps(tmp_path / "node1")[-1] == 6, before
    for extra in ([], ["--remote", url]):
        assert main(["gc", str(node0), "--keep-last", "1", "--json", *extra]) == 0
        done = json.loads(capsys.readouterr().out)
        assert done["delete"] == [], done
        why = {k["step"]: k["kept_by"] for k in done["keep"]}
        assert any("committed remotely" in w for w in why[6]), why
    assert _steps(node0) == before
    out = _run(tmp_path, "second", 2, "--steps", "10", "--remote-every", "10")
    assert [rank[0]["restored"] for rank in out] == [6, 6]


@pytest.mark.slow  # suite time budget: the counterpart of the test above
def test_gc_with_the_remote_deletes_the_parts_it_holds_committed(tmp_path, capsys):
    """Once the remote holds a checkpoint committed, a node's part of it is a cache: gc --remote
    deletes it by retention, as the run's own retention does; without --remote gc cannot tell
    and keeps it, saying how to let it delete."""
    from resilient_callbacks.cli import main
    from resilient_callbacks.remote import RemoteStore

    _run(tmp_path, "first", 2, "--steps", "6")  # closed: every checkpoint committed remotely
    node1, url = tmp_path / "node1", f"file://{tmp_path}/remote"
    assert main(["gc", str(node1), "--keep-last", "1"]) == 0
    said = capsys.readouterr().out
    assert "--remote URL" in said and _steps(node1) == [2, 4, 6], said
    RemoteStore(url).delete("step_000000002")  # as the remote retention does
    assert main(["gc", str(node1), "--keep-last", "1", "--remote", url]) == 0
    assert _steps(node1) == [6], capsys.readouterr().out  # step 2: older than a remote one


@pytest.mark.slow  # two ranks
def test_gc_with_the_nodes_own_directory_as_the_remote_deletes_nothing(tmp_path, capsys):
    """``gc node0 --remote node0`` (a slip for the run's remote URL) listed node 0's own parts
    as the remote's committed copies and deleted the parts retention does not keep, which no
    remote holds: the next run could not resume. Refused now, exit 1."""
    from resilient_callbacks.cli import main

    _run(tmp_path, "first", 2, "--steps", "8", "--remote-every", "10", expect=None,
         RC_DIE_IN_COMMIT_AT=8)  # fmt: skip
    node0 = tmp_path / "node0"
    before = _steps(node0)
    assert main(["gc", str(node0), "--keep-last", "1", "--remote", str(node0)]) == 2  # usage
    assert "no second copy" in capsys.readouterr().err
    assert _steps(node0) == before
