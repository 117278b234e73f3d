"""``resilient-ckpt export`` of one node's directory of a node-local run (docs/multinode.md):
a node's part lacks the other nodes' rank files, which is no damage; the error says so and how
to get the whole checkpoint (the harness of tests/test_nodelocal_failures.py)."""

from __future__ import annotations

import pytest

from test_cli import cli
from test_nodelocal_failures import _run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.mark.slow  # two ranks
def test_export_of_a_nodes_part_says_it_is_one_nodes_part_and_how_to_get_all_of_it(tmp_path):
    """``export node1 OUT`` said only "the manifest does not list rank_00000.json", which
    reads as a damaged checkpoint of one that ``verify node1`` calls valid."""
    _run(tmp_path, "first", 2, "--steps", "2")
    node1, url = tmp_path / "node1", f"file://{tmp_path}/remote"
    assert cli("verify", str(node1)).returncode == 0
    r = cli("export", str(node1), str(tmp_path / "out"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "is one node's part of a node-local checkpoint (the files of rank(s) 1 of 2)" in (
        r.stderr
    ), r.stderr
    assert "resilient-ckpt pull URL NEW_DIR" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    # what it says works: the whole checkpoint, pulled, exports
    assert cli("pull", url, str(tmp_path / "whole")).returncode == 0
    r = cli("export", str(tmp_path / "whole"), str(tmp_path / "out"))
    assert r.returncode == 0 and (tmp_path / "out" / "model.safetensors").exists(), r.stderr
