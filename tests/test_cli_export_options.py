"""``resilient-ckpt export`` options that do not apply to the checkpoint given are refused, not
dropped: ``--merged`` (a PEFT model's adapters merged into its base) of a plain Checkpointer
state exported its module as it is, exit 0, as if merged."""

from __future__ import annotations

from test_cli import cli, make_run


def test_merged_of_a_plain_checkpointer_state_is_refused(tmp_path):
    root = str(tmp_path / "ck")
    make_run(root)
    out = tmp_path / "out"
    for extra in ((), ("--key", "model")):
        r = cli("export", root, str(out), "--merged", *extra)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "export it without --merged" in r.stderr and not out.exists(), r.stderr
    r = cli("export", root, str(out))
    assert r.returncode == 0 and (out / "model.safetensors").exists(), r.stderr
