"""``trainer.hyperparameter_search``: each trial saves into a directory of its own, named as the
Trainer names the trial's run (``run-<id>``), keeps and resumes its own checkpoints only.

The search calls ``trainer.train(trial=...)`` once per trial on one Trainer with
``model_init``; the default test makes those calls itself, as the optuna backend does
(``hp_search_backend``, ``hp_space``, ``trial.number``, ``trial.params``), where no search
backend is installed; the slow one runs ``hyperparameter_search`` with optuna where it is."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers.integrations
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import HPSearchBackend

import hf_train
from resilient_callbacks.errors import CheckpointMismatchError, ConfigError
from resilient_callbacks.transformers import ResilientCheckpoint


def _steps(d: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in d.glob("step_*") if p.name[5:].isdigit())


def _trainer(out: Path, cb: ResilientCheckpoint) -> Trainer:
    args = hf_train.training_args(str(out), 2, gradient_accumulation_steps=1, eval_strategy="no")
    return Trainer(
        model_init=hf_train.build_model,
        args=args,
        train_dataset=hf_train.TokenDataset(16, 1),
        callbacks=[cb],
    )


def _trial(trainer: Trainer, number: int, lr: float) -> int | None:
    """One trial, as the optuna backend runs it: ``train(trial=...)``; the step it resumed."""
    trainer.train(trial=SimpleNamespace(number=number, params={"learning_rate": lr}))
    (cb,) = (c for c in trainer.callback_handler.callbacks if isinstance(c, ResilientCheckpoint))
    return cb.restored_step


@pytest.fixture
def as_optuna(monkeypatch):
    """What ``hyperparameter_search(backend="optuna")`` sets on the Trainer, and optuna's
    ``hp_params`` (the trial's ``params``), without optuna."""
    monkeypatch.setattr(transformers.integrations, "hp_params", lambda trial: trial.params)

    def search(trainer: Trainer) -> Trainer:
        trainer.hp_search_backend = HPSearchBackend.OPTUNA
        trainer.hp_space = lambda trial: trial.params
        return trainer

    return search


def _two_trials(out: Path, as_optuna) -> Path:  # type: ignore[no-untyped-def]
    trainer = as_optuna(_trainer(out, ResilientCheckpoint(every_n_steps=1, keep_last=1)))
    _trial(trainer, 0, 1e-3)
    _trial(trainer, 1, 2e-3)
    return out / "_resilient_checkpoints"


def test_each_trial_saves_and_keeps_its_own_checkpoints(tmp_path, as_optuna):
    """Refused before (a ConfigError at the first trial: every trial would have resumed the
    one before). Now trial N saves into dirpath/run-N (the Trainer's name of its run), with its
    hyperparameters, and keep_last=1 there keeps each trial's newest."""
    ck = _two_trials(tmp_path / "out", as_optuna)
    assert not _steps(ck) and _steps(ck / "run-0") == [2] and _steps(ck / "run-1") == [2]
    saved = json.loads((ck / "run-1" / "step_000000002" / "shared.json").read_text())
    assert saved["structure"]["trainer"]["trial"] == {
        "name": "run-1",
        "params": {"learning_rate": 2e-3},
    }


@pytest.mark.parametrize("where", ["absolute", "up", "output_dir"])
def test_a_trial_named_outside_output_dir_is_refused(tmp_path, as_optuna, where):
    """An ``hp_name`` giving an absolute path outside ``output_dir`` or one with ``..`` put
    the trial's checkpoints outside ``dirpath`` (``dirpath/../../elsewhere/t0``) and wrote
    ``..`` into its remote keys; ``""`` put every trial in ``dirpath`` itself. Refused at the
    trial's ``train()``, before anything is saved, naming the name and what is allowed."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    name = {"absolute": str(elsewhere / "t0"), "up": "../elsewhere/t0", "output_dir": ""}[where]
    trainer = as_optuna(_trainer(out, ResilientCheckpoint(every_n_steps=1, remote=tmp_path / "r")))
    trainer.hp_name = lambda trial: name
    with pytest.raises(ConfigError) as e:
        _trial(trainer, 0, 1e-3)
    said = str(e.value)
    assert f"trial 0: hp_name returned {name!r}, which is not a folder inside output_dir" in said
    assert "a relative name without '..' parts, one per trial" in said
    assert not elsewhere.exists() and not list(tmp_path.rglob("step_*"))


def test_a_trial_named_a_folder_inside_output_dir_saves_there(tmp_path, as_optuna):
    """What the refusal above still takes: a nested relative name, and an absolute path
    inside ``output_dir`` (taken as relative to it)."""
    out = tmp_path / "out"
    trainer = as_optuna(_trainer(out, ResilientCheckpoint(every_n_steps=1, keep_last=1)))
    trainer.hp_name = lambda t: f"lr/run-{t.number}" if t.number == 0 else str(out / "run-1")
    _trial(trainer, 0, 1e-3)
    _trial(trainer, 1, 2e-3)
    ck = out / "_resilient_checkpoints"
    assert _steps(ck / "lr" / "run-0") == [2] and _steps(ck / "run-1") == [2]
    saved = json.loads((ck / "run-1" / "step_000000002" / "shared.json").read_text())
    assert saved["structure"]["trainer"]["trial"]["name"] == "run-1"


@pytest.mark.slow  # four trainings
def test_a_search_run_again_resumes_each_trial_from_its_own_checkpoints(
    tmp_path, as_optuna, caplog
):
    """A search run again (a new study: trial numbers from 0) resumes a trial from its own
    directory, and only with the hyperparameters it was trained with: trial 1's the same
    (finished: nothing trained), trial 0's drawn anew (starts at step 0, warned; the other
    trial's checkpoint kept)."""
    out = tmp_path / "out"
    ck = _two_trials(out, as_optuna)
    again = as_optuna(_trainer(out, ResilientCheckpoint(every_n_steps=1, keep_last=1)))
    caplog.set_level(logging.WARNING, logger="resilient_callbacks")
    assert _trial(again, 0, 5e-3) is None
    assert "holds checkpoints of another trial" in caplog.text
    assert _trial(again, 1, 2e-3) == 2
    assert again.state.global_step == 2 and _steps(ck / "run-1") == [2]
    assert len(list((ck / "run-0").glob("step_*"))) == 2  # the other trial's kept, not counted
    # a step named explicitly is not read ahead: its checkpoint of another trial is refused
    named = as_optuna(_trainer(out, ResilientCheckpoint(every_n_steps=1, resume=2)))
    with pytest.raises(CheckpointMismatchError, match="this train\\(\\) runs trial 'run-1'"):
        _trial(named, 1, 7e-3)


@pytest.mark.slow  # four trainings; where optuna is installed
def test_an_optuna_search_run_again_with_a_seeded_sampler_resumes_every_trial(tmp_path):
    """The real ``hyperparameter_search`` (optuna): each trial in its own directory; run again
    with the same seeded sampler, every trial draws the same hyperparameters and resumes its
    own finished training: the same objectives, nothing trained again."""
    optuna = pytest.importorskip("optuna")
    out = tmp_path / "out"

    def search() -> tuple[list[float], list[int | None]]:
        cb = ResilientCheckpoint(every_n_steps=1, keep_last=1)
        trainer = _trainer(out, cb)
        trainer.eval_dataset = hf_train.TokenDataset(8, 2)
        resumed: list[int | None] = []
        objectives: list[float] = []
        trainer.add_callback(_Restored(cb, resumed))
        trainer.hyperparameter_search(
            hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-4, 1e-2)},
            compute_objective=lambda m: objectives.append(m["eval_loss"]) or m["eval_loss"],
            backend="optuna",
            n_trials=2,
            direction="minimize",
            sampler=optuna.samplers.TPESampler(seed=0),
        )
        return objectives, resumed

    first, none = search()
    assert none == [None, None]
    ck = out / "_resilient_checkpoints"
    assert _steps(ck / "run-0") == [2] and _steps(ck / "run-1") == [2]
    again, resumed = search()
    assert resumed == [2, 2] and again == first


class _Restored(TrainerCallback):
    """Records the step each trial's ResilientCheckpoint resumed (at its start)."""

    def __init__(self, cb: ResilientCheckpoint, into: list[int | None]) -> None:
        self.cb, self.into = cb, into

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.into.append(self.cb.restored_step)


class _RaiseAt(TrainerCallback):
    """Raises once, at the end of step ``step`` (a trial that fails, in a notebook)."""

    def __init__(self, step: int) -> None:
        self.step: int | None = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            self.step = None
            raise RuntimeError("trial failed")


@pytest.mark.slow  # four trainings
def test_a_trial_trained_again_in_the_same_process_reads_its_own_directory_ahead(
    tmp_path, as_optuna
):
    """A second search in the same process (a notebook) trains trial 0 again: its checkpoints
    go to run-0/train-2 (phases.py). There it raised at step 1 and is called again with the
    same hyperparameters: it resumes from run-0/train-2. The check of the trial read run-0
    (the first search's trial 0, other hyperparameters) and started it at step 0."""
    cb = ResilientCheckpoint(every_n_steps=1)
    trainer = as_optuna(_trainer(tmp_path / "out", cb))
    _trial(trainer, 0, 1e-3)
    trainer.add_callback(_RaiseAt(2))  # (before the save of step 2)
    with pytest.raises(RuntimeError, match="trial failed"):
        _trial(trainer, 0, 3e-3)
    run_0 = tmp_path / "out" / "_resilient_checkpoints" / "run-0"
    assert _steps(run_0) == [1, 2] and _steps(run_0 / "train-2") == [1]
    assert _trial(trainer, 0, 3e-3) == 1
    assert _steps(run_0 / "train-2") == [1, 2]


@pytest.mark.slow  # three trainings
def test_a_search_run_again_on_a_new_node_reads_the_trials_remote_store_ahead(
    tmp_path, as_optuna, caplog
):
    """With ``remote=``, a search run again where the local disk is gone (a new node) and its
    trial 0 drew other hyperparameters: the check read the empty local directory alone, the
    restore then loaded the earlier trial 0 from the store and refused it (a
    CheckpointMismatchError saying to remove it from dirpath, where it is not): the search
    stopped, where with the local disk it went on. The trial's store is read ahead as well:
    it starts at step 0 with the warning, the other trial's checkpoints kept; the same
    hyperparameters resume from the store."""
    import shutil

    out, store = tmp_path / "out", tmp_path / "durable"
    opts = {"every_n_steps": 1, "keep_last": 1, "remote": store.as_uri()}
    _trial(as_optuna(_trainer(out, ResilientCheckpoint(**opts))), 0, 1e-3)
    shutil.rmtree(out)  # a new node
    again = as_optuna(_trainer(out, ResilientCheckpoint(**opts)))
    caplog.set_level(logging.WARNING, logger="resilient_callbacks")
    assert _trial(again, 0, 5e-3) is None
    said = caplog.text
    assert f"{store.as_uri()}/run-0 holds checkpoints of another trial" in said, said
    assert len(list((store / "run-0").glob("step_*/manifest.json"))) == 2  # (2 runs' newest)
    shutil.rmtree(out)
    assert _trial(as_optuna(_trainer(out, ResilientCheckpoint(**opts))), 0, 5e-3) == 2
