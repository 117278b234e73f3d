"""Remote prefixes and local paths as users write them: spaces, ``+``, ``%``, ``#``, unicode,
and the characters fsspec reads as a glob pattern (``?``, ``[``, ``*``) when a path is given
to ``get``, ``rm`` or ``cat`` as a plain string. On a real S3 API server (moto) through s3fs,
and on ``file://``: every path is taken literally, so a checkpoint round-trips and retention
deletes its own checkpoints, never those of a run whose prefix the pattern also matches."""

from __future__ import annotations

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.remote import RemoteStore


def _state(v: float) -> dict:
    return {"w": torch.full((8192,), float(v)), "meta": {"v": v}}


def _fresh() -> dict:
    return {"w": torch.zeros(8192), "meta": {"v": None}}


@pytest.fixture(params=["s3", "file"])
def base(request, tmp_path):
    """A folder URL holding several runs' prefixes (``<base>/<prefix>``) and its options."""
    if request.param == "file":
        (tmp_path / "durable").mkdir()
        yield f"file://{tmp_path}/durable", None
    else:
        server = request.getfixturevalue("s3_server")
        server.start()
        yield f"s3://{server.create_bucket()}", server.options


@pytest.mark.parametrize("prefix", ["my run+1 %20 #x=y ü", "exp?1", "exp[1]", "exp*1"])
def test_an_incremental_run_under_an_odd_prefix_round_trips(base, prefix, tmp_path):
    root, opts = base
    url = f"{root}/{prefix}/"
    with Checkpointer(
        tmp_path / "local", incremental=True, remote=url, remote_options=opts, async_save=False
    ) as ck:
        ck.save(1, _state(1.0))
        ck.save(2, _state(2.0))
    names = sorted(e.name for e in RemoteStore(url, opts).scan() if e.committed)
    assert names == ["step_000000001", "step_000000002"]
    state = _fresh()
    with Checkpointer(tmp_path / "elsewhere", remote=url, remote_options=opts) as ck:
        assert ck.restore(state) == 2  # its blob downloaded from under that prefix
    assert torch.equal(state["w"], _state(2.0)["w"]) and state["meta"] == {"v": 2.0}


@pytest.mark.parametrize(("prefix", "other"), [("exp?1", "expA1"), ("exp[1]", "exp1")])
def test_retention_under_a_glob_like_prefix_never_deletes_another_runs_checkpoint(
    base, prefix, other, tmp_path
):
    """``exp?1/step_000000001`` as a pattern also names ``expA1/step_000000001``, and
    ``exp[1]/...`` names ``exp1/...`` (and not itself)."""
    root, opts = base
    theirs = f"{root}/{other}"
    with Checkpointer(tmp_path / "theirs", remote=theirs, remote_options=opts) as ck:
        ck.save(1, _state(9.0))
    ours = f"{root}/{prefix}"
    with Checkpointer(
        tmp_path / "ours", remote=ours, remote_options=opts, keep_last=1, async_save=False
    ) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(float(step)))
    mine = sorted(e.name for e in RemoteStore(ours, opts).scan() if e.committed)
    assert mine == ["step_000000003"]  # its own retention did delete its own
    left = [e.name for e in RemoteStore(theirs, opts).scan() if e.committed]
    assert left == ["step_000000001"]


def test_verify_url_names_plain_dcp_checkpoints_under_a_glob_like_prefix(tmp_path):
    """The note on what plain ``dcp.save`` left at the URL looks for ``<url>/*/.metadata``:
    the prefix in that pattern is taken literally (``exp[1]`` is not ``exp1``)."""
    from test_cli import cli

    for where in ("exp[1]", "exp1"):  # (exp1: torn, what exp[1] as a pattern would find)
        folder = tmp_path / where / "step_100"
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "exp[1]" / "step_100" / ".metadata").write_bytes(b"x")
    url = f"file://{tmp_path}/exp[1]"
    said = " ".join(cli("verify", url).stderr.split())
    assert f"step_100 in {url} is a checkpoint written by plain dcp.save" in said, said
    assert "without a .metadata" not in said, said


def test_the_literal_path_helpers_touch_only_the_objects_named(s3_server):
    """What the node-local commit's mark removal (``remote_paths.rm``), the deletion of a
    checkpoint (``rm_tree``) and the manifest reads (``cat``) do on S3 with a ``?`` prefix."""
    import s3fs

    from resilient_callbacks import remote_paths

    s3_server.start()
    bucket = s3_server.create_bucket()
    fs = s3fs.S3FileSystem(**s3_server.options)
    for run in ("r?1", "rA1"):
        for name in ("ck/a", "ck/sub/b", "mark"):
            fs.pipe_file(f"{bucket}/{run}/{name}", run.encode())
    got = remote_paths.cat(fs, [f"{bucket}/r?1/mark", f"{bucket}/r?1/none"])
    assert got[f"{bucket}/r?1/mark"] == b"r?1" and len(got) == 2
    assert isinstance(got[f"{bucket}/r?1/none"], FileNotFoundError)
    remote_paths.rm(fs, [f"{bucket}/r?1/mark"])
    remote_paths.rm_tree(fs, f"{bucket}/r?1/ck")
    fs.invalidate_cache()
    assert fs.find(f"{bucket}/r?1") == []
    assert sorted(fs.find(f"{bucket}/rA1")) == [
        f"{bucket}/rA1/{n}" for n in ("ck/a", "ck/sub/b", "mark")
    ]
    with pytest.raises(FileNotFoundError):
        remote_paths.rm_tree(fs, f"{bucket}/r?1/ck")
