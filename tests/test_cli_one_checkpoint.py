"""``resilient-ckpt`` given one checkpoint (``DIR/step_<n>``, ``URL/step_<n>``) rather than
the run's directory or store: what it checks is that checkpoint, and options that name another
one are not silently dropped (a script reads the exit code)."""

from __future__ import annotations

import json
import os

from test_cli import cli, make_run


def test_verify_of_one_checkpoint_with_another_step_fails_instead_of_checking_this_one(tmp_path):
    """``verify DIR/step_000000020 --step 30`` verified step 20, printed "ok" and exited 0: a
    script asking whether step 30 is good was told yes about another checkpoint."""
    root = str(tmp_path / "ck")
    make_run(root)
    one = os.path.join(root, "step_000000020")
    r = cli("verify", one, "--step", "30")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ok" not in r.stdout and "step 20" in r.stderr and "--step 30" in r.stderr, r.stderr
    assert root in r.stderr, r.stderr  # where to point it instead
    r = cli("verify", one, "--step", "30", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["ok"] is False and out["checkpoints"] == [], out
    r = cli("verify", one, "--step", "20", "--json")  # the step it is: checked as before
    out = json.loads(r.stdout)
    assert r.returncode == 0 and [c["step"] for c in out["checkpoints"]] == [20], out
