"""Where ``resilient-ckpt report`` writes: a local file; a URL given as ``--json``/``--output``
/``--png`` made a local folder named "s3:" and printed "wrote s3://...", as if uploaded."""

from __future__ import annotations

import pytest

from test_cli import cli, make_run


@pytest.mark.parametrize("option", ["--json", "--output"])
def test_a_url_as_the_reports_output_is_refused_not_written_locally(tmp_path, monkeypatch, option):
    root = str(tmp_path / "ck")
    make_run(root)
    monkeypatch.chdir(tmp_path)
    r = cli("report", root, option, "s3://bucket/report.json")
    assert r.returncode == 2, r.stdout + r.stderr  # a usage error
    assert "is a URL: the report is written to a local file" in r.stderr, r.stderr
    assert "wrote" not in r.stdout + r.stderr and not (tmp_path / "s3:").exists()
