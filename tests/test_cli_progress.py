"""``ls``, ``verify``, ``inspect`` and ``gc`` read every checksum: at disk speed, minutes per
checkpoint of hundreds of GB, during which they printed nothing. Before reading a large one
they now say which, on stderr (stdout, and ``--json``, unchanged)."""

from __future__ import annotations

import json

from resilient_callbacks import cli_scan
from test_cli import cli, make_run


def test_a_large_checkpoint_is_named_before_its_checksums_are_read(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    make_run(root)
    quiet = cli("verify", root)
    assert quiet.returncode == 0 and "reading every checksum" not in quiet.stderr  # 1 GiB+ only
    monkeypatch.setattr(cli_scan, "LARGE_BYTES", 1)  # every checkpoint here counts as large
    r = cli("verify", root, "--all")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "reading every checksum of" in line]
    assert [line.split(" of ")[1].split(" ")[0][-14:] for line in said] == [
        "step_000000010",
        "step_000000020",
        "step_000000030",
    ], r.stderr
    r = cli("ls", root, "--json")
    assert len(json.loads(r.stdout)) == 3 and "(--fast checks sizes only)" in r.stderr, r.stderr
    assert "reading every checksum" not in cli("ls", root, "--fast").stderr  # sizes only
    assert "reading every checksum" in cli("gc", root, "--dry-run").stderr
    assert "reading every checksum" in cli("inspect", root).stderr
