"""Adding ``ResilientCheckpoint`` to a Trainer changes nothing in the run, and what a user sees
around a resume: the final metrics, the resume message, early refusals, the Hub upload.

The Trainer is tests/hf_train.py's: a 2-layer GPT-2 with dropout, a shuffled training set (13
batches per epoch, gradient accumulation 3), evaluation every 4 steps, Python and NumPy noise
in the loss.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from huggingface_hub.utils import filter_repo_objects

import hf_train
import spawn_ranks
from resilient_callbacks import ConfigError, catalog
from resilient_callbacks.transformers import ResilientCheckpoint, checks

SCRIPT = Path(__file__).with_name("hf_train.py")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


def _train(outdir: Path, cb: ResilientCheckpoint | None, max_steps: int, **overrides):
    trainer = hf_train.build_trainer(str(outdir), max_steps, **overrides)
    if cb is not None:
        trainer.add_callback(cb)
    result = trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return trainer, result, weights


def _steps(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "loss" in e or "eval_loss" in e]


def _assert_same(a, b) -> None:
    """Same per-step logs (loss, grad norm, learning rate, epoch, evaluations), weights and
    train() metrics, bit for bit (timings aside)."""
    assert hf_train.clean_history(_steps(a[0])) == hf_train.clean_history(_steps(b[0]))
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        assert torch.equal(a[2][k], b[2][k]), k
    assert hf_train.without_timings(a[1].metrics) == hf_train.without_timings(b[1].metrics)


@pytest.mark.parametrize(
    "loader",
    [
        {},  # the default: accelerate's SeedableRandomSampler, base seeds from the global RNG
        {"accelerator_config": {"use_seedable_sampler": False}},  # RandomSampler: global RNG
        {"dataloader_num_workers": 2},
    ],
    ids=["seedable", "global-sampler", "workers"],
)
def test_adding_the_callback_changes_nothing(tmp_path, loader):
    """14 steps, 3 epochs, dropout on: with the callback saving every 2 steps, the run is the
    run without it."""
    without = _train(tmp_path / "a", None, 14, **loader)
    cb = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    with_cb = _train(tmp_path / "b", cb, 14, **loader)
    assert [e.step for e in catalog.committed(catalog.scan(str(tmp_path / "ck")))] == [
        2,
        4,
        6,
        8,
        10,
        12,
        14,
    ]
    _assert_same(without, with_cb)


@pytest.mark.parametrize("stop", [4, 5], ids=["mid-epoch", "epoch-end"])
def test_resumed_run_equals_the_run_without_the_callback(tmp_path, stop):
    """Resumed from step 4 (mid-epoch) or 5 (an epoch end), the run still ends where the run
    without the callback ends: per step, in weights, and in train()'s metrics, train_loss
    included. (The interrupted run is a full run with a checkpoint every step.)"""
    loader = {"accelerator_config": {"use_seedable_sampler": False}}  # order from the global RNG
    ref = _train(tmp_path / "ref", None, 10, **loader)
    ck = tmp_path / "ck"
    _train(tmp_path / "a", ResilientCheckpoint(ck, every_n_steps=1), 10, **loader)
    cb = ResilientCheckpoint(ck, resume=stop, every_n_steps=100, save_on_train_end=False)
    got = _train(tmp_path / "b", cb, 10, **loader)
    assert cb.restored_step == stop
    _assert_same(ref, got)


def test_a_finished_run_rerun_trains_nothing_and_returns_its_results(tmp_path):
    ck = tmp_path / "ck"
    first = _train(tmp_path / "a", ResilientCheckpoint(ck, every_n_steps=2), 6)
    cb = ResilientCheckpoint(ck, every_n_steps=2)
    again = _train(tmp_path / "b", cb, 6)
    assert cb.restored_step == 6
    assert again[1].global_step == 6
    assert again[1].training_loss == first[1].training_loss != 0.0
    _assert_same(first, again)
    assert [e.step for e in catalog.committed(catalog.scan(str(ck)))][-1] == 6  # nothing new


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"max_steps": 6}, {"max_steps": 10}),
        ({"max_steps": -1, "num_train_epochs": 1}, {"max_steps": -1, "num_train_epochs": 2}),
    ],
    ids=["max_steps", "num_train_epochs"],
)
def test_a_finished_run_given_more_steps_goes_on_as_the_trainers_own_resume(
    tmp_path, before, after
):
    """A finished run re-run with ``max_steps`` (or ``num_train_epochs``) raised trains the steps
    added, as ``train(resume_from_checkpoint=...)`` from the Trainer's own checkpoint of the
    finished run does: the same logs (the new schedule from the saved step) and weights."""
    ms, more = before.pop("max_steps"), after.pop("max_steps")
    own = hf_train.build_trainer(str(tmp_path / "own"), ms, **before)
    own.train()
    own._save_checkpoint(own.model, trial=None)
    (saved,) = (tmp_path / "own").glob("checkpoint-*")
    theirs = hf_train.build_trainer(str(tmp_path / "own"), more, **after)
    theirs.train(resume_from_checkpoint=str(saved))
    ck = tmp_path / "ck"
    _train(tmp_path / "ours", ResilientCheckpoint(ck, every_n_steps=2), ms, **before)
    cb = ResilientCheckpoint(ck, every_n_steps=2)
    ours = _train(tmp_path / "ours", cb, more, **after)
    assert cb.restored_step == own.state.global_step > 0
    assert ours[0].state.global_step == theirs.state.global_step > cb.restored_step
    assert hf_train.clean_history(_steps(ours[0])) == hf_train.clean_history(_steps(theirs))
    weights = theirs.model.state_dict()
    assert [k for k in weights if not torch.equal(weights[k], ours[2][k])] == []


def test_another_way_of_drawing_the_data_order_is_refused_inside_an_epoch(tmp_path):
    """Found 2026-12-07: resumed inside an epoch with use_seedable_sampler=False (or another
    data_seed), the rest of the epoch was drawn in another order than its first steps were,
    silently (some samples trained twice, others never), as the Trainer's own resume does.
    Refused inside an epoch, naming what changed; at an epoch's end (step 5 here) the next
    epochs are drawn the new way, with a warning."""
    from resilient_callbacks import CheckpointMismatchError

    ck = tmp_path / "ck"
    _train(tmp_path / "a", ResilientCheckpoint(ck, every_n_steps=1), 6)
    unseeded = {"accelerator_config": {"use_seedable_sampler": False}}
    for change, said in [
        (unseeded, r"sampler: SeedableRandomSampler in the checkpoint, RandomSampler here"),
        ({"data_seed": 3}, r"seed: 7 in the checkpoint, 3 here"),
    ]:
        cb = ResilientCheckpoint(ck, every_n_steps=100, resume=2)
        with pytest.raises(CheckpointMismatchError, match=said + r".*2 optimizer step\(s\) into"):
            _train(tmp_path / "b", cb, 6, **change)
    cb = ResilientCheckpoint(ck, every_n_steps=100, resume=5, save_on_train_end=False)
    with pytest.warns(UserWarning, match=r"RandomSampler here.*next epoch and the later ones"):
        got = _train(tmp_path / "b", cb, 6, **unseeded)
    assert cb.restored_step == 5 and got[0].state.global_step == 6
    assert [e.step for e in catalog.committed(catalog.scan(str(ck)))][-1] == 6  # the first run's


def test_an_unseeded_checkpoint_resumed_seeded_gets_only_the_order_warning(tmp_path):
    """Found 2026-12-07: a checkpoint of a run with use_seedable_sampler=False (its recorded
    order has no seed) resumed with the default seedable sampler also warned that
    ``state['trainer']['order']['seed']`` was not in the checkpoint and "removed", telling the
    user to fix code they never wrote. Only the warning about the order is given."""
    ck = tmp_path / "ck"
    unseeded = {"accelerator_config": {"use_seedable_sampler": False}}
    _train(tmp_path / "a", ResilientCheckpoint(ck, every_n_steps=1), 6, **unseeded)
    cb = ResilientCheckpoint(ck, every_n_steps=100, resume=5, save_on_train_end=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = _train(tmp_path / "b", cb, 6)
    ours = [str(w.message) for w in said if "order" in str(w.message)]
    assert len(ours) == 1, ours
    assert "RandomSampler in the checkpoint, SeedableRandomSampler here" in ours[0]
    assert "next epoch and the later ones" in ours[0]
    assert cb.restored_step == 5 and got[0].state.global_step == 6


def test_a_checkpoint_written_before_the_order_was_recorded_resumes_without_a_word(
    tmp_path, monkeypatch
):
    """Found 2026-12-07: a checkpoint of a version that did not record the data order yet
    (before 3f7512b) resumed with a warning that ``state['trainer']['order']`` was not in it
    and "removed", telling the user to fix code they never wrote. It resumes as before,
    unchecked and silent."""
    from resilient_callbacks.transformers import trainer_state

    refresh = trainer_state.SavedState.refresh

    def older_writer(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        refresh(self, *args, **kwargs)
        self.values.pop("order", None)

    ck = tmp_path / "ck"
    with monkeypatch.context() as m:
        m.setattr(trainer_state.SavedState, "refresh", older_writer)
        _train(tmp_path / "a", ResilientCheckpoint(ck, every_n_steps=1), 6)
    cb = ResilientCheckpoint(ck, every_n_steps=100, resume=2, save_on_train_end=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = _train(tmp_path / "b", cb, 6)
    assert [str(w.message) for w in said if "order" in str(w.message)] == []
    assert cb.restored_step == 2 and got[0].state.global_step == 6


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1")
    env.pop("TRANSFORMERS_VERBOSITY", None)
    return env


def test_the_resume_is_announced_in_the_default_output(tmp_path):
    """A script that configures no logging shows the resume: the checkpoint, its step, its tier
    and the newer checkpoint that was skipped, and why."""
    out = tmp_path / "out"
    ck = out / "ckpt"
    _train(out, ResilientCheckpoint(ck, every_n_steps=2), 4)
    newest = Path(catalog.committed(catalog.scan(str(ck)))[-1].path)
    data = bytearray((newest / "shared.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "shared.safetensors").write_bytes(bytes(data))
    cmd = [sys.executable, str(SCRIPT), str(out), "--max-steps", "5", "--default-logging"]
    cmd += ["--out-jsonl", str(tmp_path / "s.jsonl"), "--out-final", str(tmp_path / "f")]
    if "TRANSFORMERS_VERBOSITY" in os.environ:  # (read at import: the zygote's would differ)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    else:  # forked from the zygote that imported Transformers (test_transformers.py's)
        hf = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        zygote = spawn_ranks.shared_zygote("hf_train", **hf)
        p = spawn_ranks.run_python(cmd, _env(), timeout=240, zygote=zygote)
    assert p.returncode == 0, p.stderr[-4000:]
    text = p.stdout + p.stderr
    line = next((x for x in text.splitlines() if "ResilientCheckpoint: resumed" in x), None)
    assert line is not None, text[-4000:]
    assert "resumed at step 2 (epoch 0, 2 optimizer step(s) into it)" in line
    assert "step_000000002" in line and "(local copy)" in line
    assert "skipped newer checkpoint(s)" in line and str(newest) in line


class Stream(torch.utils.data.IterableDataset):
    iterated = False

    def __iter__(self):
        Stream.iterated = True
        data = hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1)
        return iter(data[i] for i in range(hf_train.NUM_SAMPLES))


def test_an_iterable_dataset_is_refused_before_training_starts(tmp_path):
    Stream.iterated = False
    # Trainer(callbacks=[...]): at construction.
    with pytest.raises(ConfigError, match=r"map-style.*streaming=True"):
        hf_train.build_trainer(
            str(tmp_path),
            2,
            callbacks=[ResilientCheckpoint(tmp_path / "ck")],
            train_dataset=Stream(),
        )
    # add_callback: at the start of train(), before any batch or optimizer step.
    trainer = hf_train.build_trainer(str(tmp_path), 2, train_dataset=Stream())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.add_callback(ResilientCheckpoint(tmp_path / "ck"))
    with pytest.raises(ConfigError, match="Nothing was trained or saved"):
        trainer.train()
    assert not Stream.iterated
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())
    assert trainer.state.global_step == 0
    assert not (tmp_path / "ck").exists()


def test_checkpoints_stay_out_of_the_hub_upload(tmp_path):
    out = tmp_path / "out"
    _train(out, ResilientCheckpoint(every_n_steps=2), 2)
    files = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
    assert any(f.startswith("_resilient_checkpoints/") for f in files)
    uploaded = list(filter_repo_objects(files, ignore_patterns=list(checks.HUB_IGNORED)))
    assert not [f for f in uploaded if "resilient" in f]
    import transformers

    source = Path(transformers.trainer.__file__).read_text()
    assert 'ignore_patterns=["_*", f"{PREFIX_CHECKPOINT_DIR}-*"]' in source  # what it skips

    args = types.SimpleNamespace(output_dir=str(out), push_to_hub=True)
    with pytest.warns(UserWarning, match="would be uploaded"):
        checks.checkpoint_dir(str(out / "ckpts"), args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checks.checkpoint_dir(None, args)
        checks.checkpoint_dir(str(out / "_mine"), args)
        checks.checkpoint_dir(str(tmp_path / "elsewhere"), args)


def test_a_run_under_the_old_default_directory_keeps_resuming_there(tmp_path):
    out = tmp_path / "out"
    _train(out, ResilientCheckpoint(out / "resilient_checkpoints", every_n_steps=2), 2)
    cb = ResilientCheckpoint(every_n_steps=2)
    _train(out, cb, 3)
    assert cb.restored_step == 2
    assert not (out / "_resilient_checkpoints").exists()
