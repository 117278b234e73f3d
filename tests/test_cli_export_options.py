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


def test_the_transformers_modules_export_is_resilient_ckpt_export(tmp_path, capsys):
    """``python -m resilient_callbacks.transformers export`` (docs/transformers.md: "the
    same" as ``resilient-ckpt export``) shows export's options but ran the Transformers
    exporter alone: ``--key`` was dropped, and a plain Checkpointer state was refused as "not
    written by ResilientCheckpoint", exit 1."""
    import pytest

    pytest.importorskip("transformers")
    from resilient_callbacks.transformers.__main__ import main as hf_main

    root = str(tmp_path / "ck")
    state = make_run(root)
    for extra in ((), ("--key", "model")):
        out = tmp_path / f"out{len(extra)}"
        assert hf_main(["export", root, str(out), *extra]) == 0, capsys.readouterr().err
        assert (out / "model.safetensors").exists() and (out / "export.json").exists()
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out2" / "model.safetensors"))
    want = state["model"].state_dict()
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert hf_main(["export", root, str(tmp_path / "out3"), "--key", "extra"]) == 1
    assert "the entry 'extra' holds no tensors" in capsys.readouterr().err  # as resilient-ckpt's
