"""``Checkpointer(dirpath, read_only=True)``: a job that only restores (an evaluation beside the
run, a read-only mount) takes no lock and writes nothing, and may load a part of the state.

Where the machine allows it (root with mount rights), the directory is bind-mounted read-only,
so any write fails for real; elsewhere the same tests check that nothing in the directory
changed (names, sizes, modification times).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import spawn_ranks
from resilient_callbacks import Checkpointer, ResumeFallbackWarning
from resilient_callbacks.errors import CheckpointMismatchError, CheckpointNotFoundError, ConfigError
from torch_needs import needs_dcp, needs_transformers


def train(root: Path, steps: int = 3) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt, "extra": {"seen": 0}}
    with Checkpointer(root, keep_last=3) as ck:
        ck.restore(state)
        for step in range(1, steps + 1):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            state["extra"]["seen"] = step
            ck.save(step, state)
    return model, state


def listing(root: Path) -> list[tuple[str, int, int]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            st = os.lstat(os.path.join(dirpath, name))
            out.append(
                (os.path.relpath(os.path.join(dirpath, name), root), st.st_size, st.st_mtime_ns)
            )
    return sorted(out)


@pytest.fixture
def read_only_view(tmp_path):
    """``view(src)``: ``src`` seen through a read-only bind mount where one can be made, else
    ``src`` itself (the tests then compare the listing before and after)."""
    mounts: list[Path] = []

    def view(src: Path) -> tuple[Path, bool]:
        dst = tmp_path / f"ro{len(mounts)}"
        dst.mkdir()
        ok = shutil.which("mount") is not None and os.geteuid() == 0
        if ok:
            done = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True)
            ok = done.returncode == 0
            if ok:
                mounts.append(dst)
                ok = (
                    subprocess.run(
                        ["mount", "-o", "remount,bind,ro", str(dst)], capture_output=True
                    ).returncode
                    == 0
                )
        if ok:
            with pytest.raises(OSError):
                (dst / "probe").write_bytes(b"")
            return dst, True
        return src, False

    yield view
    for m in reversed(mounts):
        subprocess.run(["umount", str(m)], capture_output=True)


def test_a_read_only_checkpointer_restores_a_part_of_the_state_and_writes_nothing(
    tmp_path, read_only_view
):
    model, _ = train(tmp_path / "run")
    root, mounted = read_only_view(tmp_path / "run")
    before = listing(root)

    evaluated = nn.Linear(8, 4)
    with Checkpointer(root, read_only=True) as ck:  # the model alone: no optimizer, no extra
        assert ck.restore({"model": evaluated}) == 3
        assert ck.last_restore is not None and ck.last_restore.step == 3
        with pytest.raises(ConfigError, match="read_only"):
            ck.save(4, {"model": evaluated})
        with pytest.raises(ConfigError, match="read_only"):
            ck.step(4, {"model": evaluated})
    assert torch.equal(evaluated.weight, model.weight) and torch.equal(evaluated.bias, model.bias)
    # (without a read-only mount here, the listing is the check that nothing was written)
    assert listing(root) == before, f"a read-only Checkpointer changed the directory ({mounted=})"


def test_it_restores_while_the_runs_writer_holds_the_directory(tmp_path):
    model, state = train(tmp_path / "run", steps=2)
    with Checkpointer(tmp_path / "run", keep_last=3) as writer:  # the run goes on
        assert writer.restore(state) == 2
        writer.save(3, state)
        writer.flush()
        before = listing(tmp_path / "run")
        evaluated = nn.Linear(8, 4)
        with Checkpointer(tmp_path / "run", read_only=True, resume=2) as reader:
            assert reader.restore({"model": evaluated}) == 2
        assert torch.equal(evaluated.weight, model.weight)
        assert listing(tmp_path / "run") == before
        writer.save(4, state)  # the writer is undisturbed
    steps = [e.step for e in Checkpointer(tmp_path / "run", read_only=True).checkpoints()]
    assert steps == [2, 3, 4]


def test_a_corrupt_newest_checkpoint_falls_back_loudly_and_stays(tmp_path):
    train(tmp_path / "run")
    newest = tmp_path / "run" / "step_000000003"
    victim = next(p for p in sorted(newest.rglob("*.safetensors")) if p.stat().st_size > 64)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    before = listing(tmp_path / "run")
    with (
        pytest.warns(ResumeFallbackWarning, match="step_000000003"),
        Checkpointer(tmp_path / "run", read_only=True) as ck,
    ):
        assert ck.restore({"model": nn.Linear(8, 4)}) == 2
    assert listing(tmp_path / "run") == before  # no retention pass, no history record


def test_a_state_entry_the_checkpoint_lacks_is_still_refused(tmp_path):
    train(tmp_path / "run")
    with (
        Checkpointer(tmp_path / "run", read_only=True) as ck,
        pytest.raises(CheckpointMismatchError, match="head"),
    ):
        ck.restore({"model": nn.Linear(8, 4), "head": nn.Linear(4, 2)})


def test_a_state_dict_saved_as_a_dict_loads_into_a_module(tmp_path):
    """``{"weights": model.state_dict()}`` saved, a module given at restore: its keys and
    shapes are checked, then ``load_state_dict`` (it was refused: "not a module")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with Checkpointer(tmp_path / "run") as ck:
        ck.save(1, {"weights": dict(model.state_dict()), "epoch": {"n": 3}})
    evaluated = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with Checkpointer(tmp_path / "run", read_only=True) as ck:
        assert ck.restore({"weights": evaluated}) == 1
    for a, b in zip(model.state_dict().values(), evaluated.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with (  # a writer says how to load a part of the state
        Checkpointer(tmp_path / "run") as ck,
        pytest.raises(CheckpointMismatchError, match=r"'epoch'\nTo load a part.*read_only=True"),
    ):
        ck.restore({"weights": nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))})
    with (
        Checkpointer(tmp_path / "run", read_only=True) as ck,
        pytest.raises(CheckpointMismatchError, match=r"unexpected keys in checkpoint: '1.bias'"),
    ):
        ck.restore({"weights": nn.Sequential(nn.Linear(4, 4))})


def test_what_a_read_only_checkpointer_cannot_do_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="not a directory"):
        Checkpointer(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ConfigError, match="keep_last, remote"):
        Checkpointer(tmp_path, read_only=True, keep_last=2, remote="s3://bucket/run")
    with pytest.raises(ConfigError, match="resume='never'"):
        Checkpointer(tmp_path, read_only=True, resume="never")


def test_an_adapter_refuses_read_only(tmp_path):
    from resilient_callbacks.adapter import check_options
    from resilient_callbacks.deepspeed.section import validate

    with pytest.raises(ConfigError, match="saves as it trains"):
        check_options("ResilientCheckpoint (Lightning)", ["read_only"], ["dirpath"])
    with pytest.raises(ConfigError, match="read_only"):
        validate({"dirpath": str(tmp_path), "read_only": True})


@pytest.mark.distributed
@pytest.mark.timeout(300)
@needs_dcp
def test_a_sharded_model_is_restored_alone_from_a_training_checkpoint(tmp_path):
    """``Sharded(model)`` without its optimizer, out of a checkpoint of ``Sharded(model, opt)``
    (FSDP2 on a gloo rank): read-only, the optimizer state is left out; a writer refuses it (a
    resume that would drop the optimizer state in silence)."""
    from safetensors.torch import load_file

    from resilient_callbacks.cli import main

    root = tmp_path / "ck"
    argv = [sys.executable, __file__, str(root)]
    spawn_ranks.run(argv, 1, tmp_path, "sharded", zygote=spawn_ranks.shared_zygote())
    res = json.loads((tmp_path / "sharded.json").read_text())
    ema, writer = res.pop("ema"), res.pop("writer")
    assert res == {"step": 2, "same": True}, res
    assert writer.startswith("CheckpointMismatchError") and "but this Sharded has none" in writer, (
        writer
    )
    # two Sharded parts: export names one (it took the first, in silence)
    assert main(["export", str(root), str(tmp_path / "all")]) == 1
    assert main(["export", str(root), str(tmp_path / "ema"), "--key", "ema"]) == 0
    got = load_file(tmp_path / "ema" / "model.safetensors")
    assert {k: v.tolist() for k, v in got.items()} == ema


def sharded_worker(root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")

    def model() -> nn.Module:
        m = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 2))
        fully_shard(m)
        return m

    torch.manual_seed(0)
    trained = model()
    opt = torch.optim.AdamW(trained.parameters(), lr=0.1)
    ema = model()  # a second sharded model, never trained
    with Checkpointer(root, every_n_steps=1) as ck:
        for step in (1, 2):
            trained(torch.randn(4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
            ck.step(step, {"train": Sharded(trained, opt), "ema": Sharded(ema)})
    res: dict = {"ema": {k: v.full_tensor().tolist() for k, v in ema.state_dict().items()}}
    evaluated = model()
    with Checkpointer(root, read_only=True) as ck:
        res["step"] = ck.restore({"train": Sharded(evaluated)})
    pairs = zip(trained.parameters(), evaluated.parameters(), strict=True)
    res["same"] = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)
    try:
        with Checkpointer(root) as ck:
            ck.restore({"train": Sharded(model()), "ema": Sharded(model())})
    except Exception as e:
        res["writer"] = f"{type(e).__name__}: {e}"
    (Path(root).parent / "sharded.json").write_text(json.dumps(res))
    spawn_ranks.leave_group()


if __name__ == "__main__":
    sharded_worker(sys.argv[1])


@needs_transformers
def test_an_evaluation_loads_a_trainer_runs_model_alone(tmp_path):
    """The Transformers callback keeps the model under "model": an evaluation loads it alone
    (transformers.md)."""
    pytest.importorskip("transformers")
    from transformers import Trainer

    from resilient_callbacks.transformers import ResilientCheckpoint
    from upstream.transformers.trainer_test_utils import (
        RegressionDataset,
        RegressionModelConfig,
        RegressionRandomPreTrainedModel,
        RegressionTrainingArguments,
    )

    torch.manual_seed(0)
    model = RegressionRandomPreTrainedModel(RegressionModelConfig(a=0, b=2))
    args = RegressionTrainingArguments(
        str(tmp_path / "out"), max_steps=4, save_steps=2, per_device_train_batch_size=8,
        report_to=[], disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    callback = ResilientCheckpoint(log_save_metrics=False)
    Trainer(model, args, train_dataset=RegressionDataset(length=64), callbacks=[callback]).train()
    evaluated = RegressionRandomPreTrainedModel(RegressionModelConfig(a=5, b=7))
    with Checkpointer(tmp_path / "out" / "_resilient_checkpoints", read_only=True) as ck:
        assert ck.restore({"model": evaluated}) == 4
    assert torch.equal(evaluated.a, model.a) and torch.equal(evaluated.b, model.b)


def test_a_checkpoint_deleted_while_it_is_read_is_skipped_loudly(tmp_path, monkeypatch):
    """Beside a running writer, retention may delete the checkpoint a reader has chosen: as
    the reader opens it (here: deleted right before its part is read), it is skipped with the
    warning and the next older one is loaded (guide.md says so)."""
    from resilient_callbacks import restore_load

    train(tmp_path / "run")
    read_part = restore_load.layout.read_part
    deleted: list[str] = []

    def deleted_first(path, *args, **kwargs):
        if not deleted:
            deleted.append(path)
            shutil.rmtree(path)  # what the writer's retention does
        return read_part(path, *args, **kwargs)

    monkeypatch.setattr(restore_load.layout, "read_part", deleted_first)
    with (
        pytest.warns(ResumeFallbackWarning, match="step_000000003"),
        Checkpointer(tmp_path / "run", read_only=True) as ck,
    ):
        assert ck.restore({"model": nn.Linear(8, 4)}) == 2
    assert deleted and deleted[0].endswith("step_000000003")


@pytest.mark.parametrize("incremental", [False, True], ids=["plain", "incremental"])
def test_an_evaluator_beside_a_keep_last_1_writer_reads_the_newer_checkpoint(
    tmp_path, monkeypatch, incremental
):
    """A read-only evaluator beside a writer with ``keep_last=1``: the writer commits a newer
    checkpoint and its retention deletes the one the reader chose, as the reader reads it.
    There was no older one to fall back to, and the reader raised NoValidCheckpointError
    telling the user to repair "bad" checkpoints; it lists the directory again and loads the
    newer one."""
    from resilient_callbacks import restore_load

    root = tmp_path / "run"
    model = nn.Linear(8, 4)
    with Checkpointer(root, keep_last=1, async_save=False, incremental=incremental) as writer:
        writer.save(1, {"model": model})
        read_part = restore_load.layout.read_part
        chosen: list[str] = []

        def newer_committed_first(path, *args, **kwargs):
            if not chosen:
                chosen.append(path)
                with torch.no_grad():
                    model.weight.add_(1.0)
                writer.save(2, {"model": model})  # commits step 2, deletes step 1
                writer.flush()
            return read_part(path, *args, **kwargs)

        monkeypatch.setattr(restore_load.layout, "read_part", newer_committed_first)
        evaluated = nn.Linear(8, 4)
        with (
            pytest.warns(ResumeFallbackWarning, match="deleted while being read"),
            Checkpointer(root, read_only=True) as reader,
        ):
            assert reader.restore({"model": evaluated}) == 2
            assert reader.last_restore is not None
        assert chosen and chosen[0].endswith("step_000000001")
        assert torch.equal(evaluated.weight, model.weight)
        assert not os.path.exists(chosen[0])  # it was gone, not damaged


def test_an_evaluator_whose_listing_missed_every_checkpoint_lists_again(tmp_path, monkeypatch):
    """The listing races the writer: it names step 1 only (step 2 is not yet renamed into
    place), then, before step 1's manifest is read, the writer commits step 2 and its
    retention (keep_last=1) moves step 1 away. That listing holds no checkpoint; the reader
    said "nothing was restored" and left the model untrained (a monitoring probe: 2 of 1101
    evaluations beside a writer saving every step). It lists again and loads step 2."""
    from resilient_callbacks import catalog

    root = tmp_path / "run"
    model = nn.Linear(8, 4)
    with Checkpointer(root, keep_last=1, async_save=False) as writer:
        writer.save(1, {"model": model})
        read_manifest = catalog.read_manifest
        raced: list[str] = []

        def the_writer_moves_on(path, *args, **kwargs):
            if not raced:
                raced.append(path)
                with torch.no_grad():
                    model.weight.add_(1.0)
                writer.save(2, {"model": model})  # commits step 2, moves step 1 away
                writer.flush()
            return read_manifest(path, *args, **kwargs)

        monkeypatch.setattr(catalog, "read_manifest", the_writer_moves_on)
        evaluated = nn.Linear(8, 4)
        with Checkpointer(root, read_only=True) as reader:
            assert reader.restore({"model": evaluated}) == 2
        assert raced and raced[0].endswith("step_000000001")
        assert not os.path.exists(raced[0])
        assert torch.equal(evaluated.weight, model.weight)


def test_an_evaluator_that_never_catches_up_says_why(tmp_path, monkeypatch):
    """Every checkpoint the reader chooses is deleted as it reads it (a writer saving faster
    than the reader verifies): after 3 listings more, an error that names each checkpoint
    tried, says they were deleted while read, and does not ask to repair anything."""
    from resilient_callbacks import restore_load
    from resilient_callbacks.errors import NoValidCheckpointError

    root = tmp_path / "run"
    model = nn.Linear(8, 4)
    with Checkpointer(root, keep_last=1, async_save=False) as writer:
        writer.save(1, {"model": model})
        read_part = restore_load.layout.read_part
        saved = [1]

        def always_a_newer_one(path, *args, **kwargs):
            saved.append(saved[-1] + 1)
            writer.save(saved[-1], {"model": model})  # commits, deletes the one being read
            writer.flush()
            return read_part(path, *args, **kwargs)

        monkeypatch.setattr(restore_load.layout, "read_part", always_a_newer_one)
        with (
            pytest.warns(ResumeFallbackWarning),
            pytest.raises(NoValidCheckpointError) as info,
            Checkpointer(root, read_only=True) as reader,
        ):
            reader.restore({"model": nn.Linear(8, 4)})
    msg = str(info.value)
    assert "none of the 4 checkpoint(s)" in msg and "listed 4 times" in msg, msg
    assert "deleted while it was read" in msg and "Repair" not in msg, msg


def test_a_step_only_the_remote_tier_keeps_is_named_with_how_to_get_it(tmp_path):
    """With a remote tier the local directory keeps only ``keep_last``: archive and best
    checkpoints live remotely. A read-only restore of such a step (an evaluation of an archive
    beside the run) is not found locally, and the error says where it is and how to get it."""
    model = nn.Linear(8, 4)
    url = f"file://{tmp_path}/durable"
    with Checkpointer(
        tmp_path / "run", remote=url, keep_last=1, keep_every_n_steps=2, async_save=False
    ) as ck:
        ck.restore({"model": model})
        for step in (1, 2, 3):
            ck.save(step, {"model": model})
    with (
        Checkpointer(tmp_path / "run", read_only=True, resume=2) as ck,
        pytest.raises(CheckpointNotFoundError, match="remote tier") as e,
    ):
        ck.restore({"model": model})
    assert "resilient-ckpt pull URL OTHER_DIR --step 2" in str(e.value)
    assert "remote=" in str(e.value)
    # without a remote tier the message stays as it was
    with Checkpointer(tmp_path / "plain", keep_last=1, async_save=False) as ck:
        ck.restore({"model": model})
        ck.save(1, {"model": model})
    with (
        Checkpointer(tmp_path / "plain", read_only=True, resume=2) as ck,
        pytest.raises(CheckpointNotFoundError) as e,
    ):
        ck.restore({"model": model})
    assert "remote tier" not in str(e.value)
