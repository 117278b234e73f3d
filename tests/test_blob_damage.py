"""A damaged blob that checkpoints share (``incremental=True``): the commands name it with the
checkpoints it makes corrupt and its repair; ``gc --remove-corrupt`` does not delete those
checkpoints (the blob can be repaired) unless ``--remove-blob-corrupt`` says so; ``pull``
repairs it; a commit never replaces a stored blob that verifies (``promote_staged``)."""

from __future__ import annotations

import json

import torch

from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.catalog import Depth, Status
from resilient_callbacks.manifest import read_manifest
from test_incremental import _cli, _model, _state, _train_step


def _run(root, url: str | None = None) -> str:
    """Three incremental saves; the name of a blob all three name (the frozen trunk's)."""
    state = _state(_model())
    with Checkpointer(root, incremental=True, async_save=False, remote=url) as ck:
        for step in (1, 2, 3):
            _train_step(state, step)
            ck.save(step, state)
    names = [{b.path for b in read_manifest(e.path).blobs} for e in catalog.scan(str(root))]
    return sorted(set.intersection(*names))[0]


def _damage(path) -> None:
    data = bytearray(path.read_bytes())
    data[-4] ^= 0xFF
    path.write_bytes(bytes(data))


def _statuses(root) -> list[Status]:
    return [e.status for e in catalog.scan(str(root), Depth.FULL)]


def test_gc_remove_corrupt_names_a_damaged_shared_blob_and_keeps_what_it_alone_corrupts(
    tmp_path, capsys
):
    """One damaged blob of the frozen trunk made ``gc --remove-corrupt`` delete every
    checkpoint of the run, then the blob, saying only 'corrupt' for each: a repairable blob
    cost the whole run. gc now names the blob, the checkpoints it corrupts and the repair, and
    keeps them; ``--remove-blob-corrupt`` (an explicit choice) deletes them."""
    root = tmp_path / "run"
    blob = _run(root)
    _damage(root / "blobs" / blob)
    rc, out = _cli(capsys, "gc", str(root), "--remove-corrupt")
    assert rc == 0
    assert f"blob {blob} is damaged or missing" in out, out
    assert "step_000000001, step_000000002, step_000000003" in out and "pull" in out, out
    assert "deleted step_" not in out and "--remove-blob-corrupt" in out, out
    assert (root / "blobs" / blob).exists() and _statuses(root) == [Status.CORRUPT] * 3
    export = ["export", str(root), str(tmp_path / "out")]
    for cmd in (["ls", str(root)], ["verify", str(root), "--all"], export):  # the same note
        from resilient_callbacks.cli import main

        capsys.readouterr()
        main(cmd)
        said = "".join(capsys.readouterr())
        assert f"blob {blob} is damaged" in said and "step_000000002" in said, (cmd, said)
    rc, out = _cli(capsys, "gc", str(root), "--remove-corrupt", "--json")
    said = json.loads(out)
    assert [d["name"] for d in said["damaged_blobs"]] == [blob] and not said["delete"]
    assert all(k["damaged_blobs"] == [blob] for k in said["keep"])
    rc, out = _cli(capsys, "gc", str(root), "--remove-blob-corrupt")
    assert rc == 0 and out.index(f"blob {blob}") < out.index("deleted step_"), out
    assert catalog.scan(str(root)) == []


def test_pull_repairs_a_damaged_shared_blob_in_the_local_store(tmp_path, capsys):
    """``pull URL DIR`` put the remote's copy of a damaged local blob into the pulled
    checkpoint's own folder and left the store's damaged: every older checkpoint naming it
    stayed corrupt. A local blob no local manifest records with its bytes is replaced by the
    verified copy, which repairs them all."""
    root = tmp_path / "run"
    url = f"file://{tmp_path}/durable"
    blob = _run(root, url)
    _damage(root / "blobs" / blob)
    assert _cli(capsys, "pull", url, str(root))[0] == 0
    assert _statuses(root) == [Status.VALID] * 3
    assert not (root / "step_000000003" / "blobs").exists()


def test_a_commit_never_replaces_a_stored_blob_that_verifies_with_other_bytes(
    tmp_path, monkeypatch
):
    """A blob's name hashes the tensor, the manifest's checksum the stored bytes: a compressed
    part blob of the same tensor can have other bytes (another zstd version between runs). A
    new run in the same directory (no restore) staged the frozen tensor again and
    ``promote_staged`` replaced the stored copy: the older checkpoint naming it failed
    verification. The stored copy is kept and the new manifest names its bytes."""
    import pytest

    pytest.importorskip("zstandard")
    from resilient_callbacks import compression
    from test_part_blobs import FrozenAndTrained, _train

    root = tmp_path / "ck"
    part = FrozenAndTrained()
    with Checkpointer(root, incremental=True, compression="zstd", preemption=False) as ck:
        _train(part, 1)
        ck.save(1, {"engine": part})
    real = compression.compressor
    monkeypatch.setattr(compression, "compressor", lambda level: real(level + 5))  # "upgrade"
    with Checkpointer(root, incremental=True, compression="zstd", preemption=False) as ck:
        for step in (2, 3):  # no restore: the frozen tensor is staged again
            _train(part, step)
            ck.save(step, {"engine": part})
    assert _statuses(root) == [Status.VALID] * 3
    fresh = FrozenAndTrained()
    fresh.frozen.zero_()
    with Checkpointer(root, resume=str(root / "step_000000001"), preemption=False) as ck:
        assert ck.restore({"engine": fresh}) == 1
    assert torch.equal(fresh.frozen, part.frozen)


def test_gc_remote_remove_corrupt_keeps_remote_checkpoints_a_torn_shared_blob_corrupts(
    tmp_path, capsys
):
    """A torn remote blob shared by every remote checkpoint made ``gc DIR --remote URL
    --remove-corrupt`` delete every remote checkpoint (perhaps the only durable copies), though
    ``push DIR URL`` repairs the blob from the whole local copy. They are kept, the note names
    push; ``--remove-blob-corrupt`` deletes them."""
    root = tmp_path / "run"
    url = f"file://{tmp_path}/durable"
    blob = _run(root, url)
    remote_blob = tmp_path / "durable" / "blobs" / blob
    remote_blob.write_bytes(remote_blob.read_bytes()[:1000])
    args = ["gc", str(root), "--remote", url, "--keep-last", "5"]
    out = _cli(capsys, *args, "--remove-corrupt", "--json")[1]
    remote = json.loads(out)["remote"]
    assert not remote["delete"] and len(remote["keep"]) == 3, remote
    assert all("push" in k["why"] and blob in k["why"] for k in remote["keep"]), remote
    out = _cli(capsys, *args, "--remove-blob-corrupt", "--dry-run", "--json")[1]
    assert len(json.loads(out)["remote"]["delete"]) == 3
    assert _cli(capsys, "push", str(root), url)[0] == 0  # the repair
    assert _cli(capsys, "verify", url, "--all")[0] == 0


def test_restore_with_every_checkpoint_corrupt_through_a_blob_points_at_verify_all(tmp_path):
    """Every checkpoint corrupt through one damaged blob: restore refused (loudly) and advised
    only `verify`/`gc --remove-corrupt`; it now names `verify DIR --all`, which names the blob
    and its repair, and `gc --remove-blob-corrupt` (`--remove-corrupt` keeps them)."""
    import pytest

    from resilient_callbacks.errors import NoValidCheckpointError

    root = tmp_path / "run"
    _damage(root / "blobs" / _run(root))
    # (and `gc DIR --remove-blob-corrupt`: `--remove-corrupt`, which it named, keeps them)
    said = r"verify .* --all` names what is damaged .*gc .* --remove-blob-corrupt` deletes them"
    with (
        pytest.raises(NoValidCheckpointError, match=said),
        Checkpointer(root, incremental=True, async_save=False) as ck,
    ):
        ck.restore(_state(_model()))


def test_restore_from_remote_copies_corrupt_through_a_blob_points_at_verify_of_the_url(
    tmp_path, capsys
):
    """The local directory lost (a new machine), every remote checkpoint corrupt through one
    torn remote blob: the restore advised `resilient-ckpt verify DIR --all` of the empty
    directory, which finds nothing to check. It now names the remote form, `verify URL
    --all`, which names the blob, and not the local one (nothing there was tried)."""
    import shutil

    import pytest

    from resilient_callbacks.errors import NoValidCheckpointError

    root, url = tmp_path / "run", f"file://{tmp_path}/durable"
    blob = tmp_path / "durable" / "blobs" / _run(root, url)
    shutil.copytree(root, tmp_path / "old")  # (the run's directory on the machine that wrote it)
    shutil.rmtree(root)
    blob.write_bytes(blob.read_bytes()[:1000])
    with (
        pytest.raises(NoValidCheckpointError) as got,
        Checkpointer(root, incremental=True, async_save=False, remote=url) as ck,
    ):
        ck.restore(_state(_model()))
    said = str(got.value)
    assert f"`resilient-ckpt verify {url} --all` names what is damaged" in said, said
    assert f"verify {root} " not in said, said
    # each skipped copy is named where it lies (it read "step_000000002 (step 2): the blob
    # blobs/... is missing or torn", which a new machine's user took for the local directory)
    assert f"(step 2): remote copy {url}/step_000000002: the blob blobs/{blob.name}" in said
    # the repair: it named `gc DIR --remote URL --remove-corrupt`, which keeps a checkpoint
    # corrupt only through a blob (and gc then named push): push --verify from a whole copy
    # (plain push compares sizes only), and without one the gc option that does delete them
    assert f"`resilient-ckpt push DIR {url} --verify`" in said, said
    assert f"`resilient-ckpt gc {root} --remote {url} --remove-blob-corrupt`" in said, said
    assert f"--remote {url} --remove-corrupt`" not in said, said
    rc, out = _cli(capsys, "verify", url, "--all")  # the command it names does name the blob
    assert rc == 1 and blob.name in out, out
    rc, out = _cli(capsys, "push", str(tmp_path / "old"), url, "--verify")
    assert rc == 0 and _cli(capsys, "verify", url, "--all")[0] == 0, out  # (repaired)


def test_the_repair_hint_names_each_tier_tried_and_the_remote_options():
    """Both tiers tried: both `verify` forms; a remote with options: the CLI needs them as
    ``-o``; a URL's credentials are not shown."""
    from resilient_callbacks.candidates import repair_hint

    said = repair_hint("/ck", "s3://u:pw@b/run/", {"endpoint_url": "x"}, {"/ck/a", "remote:a"})
    assert said.startswith("`resilient-ckpt verify /ck --all` names what is damaged in the"), said
    # (shell-quoted: unquoted, a shell would expand the stars of the hidden credentials)
    assert "`resilient-ckpt verify 's3://***@b/run' --all`" in said and "pw" not in said, said
    assert said.endswith("(each with `-o KEY=VALUE` for the remote_options)"), said
    assert "not /ck, whose copies are damaged too" in said, said  # (push from another one)
    only_local = repair_hint("/ck", "s3://b/run", None, {"/ck/a"})
    # (`gc --remove-corrupt` keeps a checkpoint corrupt only through a blob)
    assert "s3://" not in only_local and "`resilient-ckpt gc /ck --remove-blob-corrupt`" in (
        only_local
    ), only_local
