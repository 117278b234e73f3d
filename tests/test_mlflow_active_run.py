"""``telemetry="mlflow:URI"`` inside ``with mlflow.start_run():`` on that same tracking store
(the Trainer's ``report_to="mlflow"`` with ``MLFLOW_TRACKING_URI``, the URI also written out in
the sink): the checkpoint metrics go to the active run, not to a second run of their own.
Each store is a copy of conftest's empty one (``mlflow_sqlite``): its schema made once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from resilient_callbacks import Checkpointer
from resilient_callbacks.metrics import PREFIX
from test_monitoring import _state, _train


def test_the_same_tracking_uri_given_explicitly_logs_into_the_active_run(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str
):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)  # a sqlite store puts its artifacts under ./mlruns
    uri = mlflow_sqlite
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # not set_tracking_uri(): it outlives a test
    exp = mlflow.tracking.MlflowClient().create_experiment("active")
    state = _state()
    with (
        mlflow.start_run(experiment_id=exp) as active,
        Checkpointer(tmp_path / "ck", every_n_steps=5, telemetry=f"mlflow:{uri}") as ck,
    ):
        ck.restore(state)
        _train(ck, range(1, 11), state)
    c = mlflow.tracking.MlflowClient()
    runs = c.search_runs([exp])
    assert [r.info.run_id for r in runs] == [active.info.run_id], [r.info.run_name for r in runs]
    assert c.search_runs(["0"]) == []  # (the old src made a stray run in "Default")
    history = c.get_metric_history(active.info.run_id, PREFIX + "saves_total")
    assert max(m.value for m in history) == 2


def test_another_tracking_uri_than_the_active_runs_gets_a_run_of_its_own(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str, _empty_mlflow_store: Path
):
    """The active run lives in another store: the sink cannot log into it, so it makes its
    own run in the store it was given (as before)."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite)
    shutil.copyfile(_empty_mlflow_store, tmp_path / "b.db")  # (another empty store)
    other = f"sqlite:///{tmp_path / 'b.db'}"
    exp = mlflow.tracking.MlflowClient().create_experiment("active")
    state = _state()
    with (
        mlflow.start_run(experiment_id=exp),
        Checkpointer(tmp_path / "ck", every_n_steps=5, telemetry=f"mlflow:{other}") as ck,
    ):
        ck.restore(state)
        _train(ck, range(1, 11), state)
    c = mlflow.tracking.MlflowClient(tracking_uri=other)
    (run,) = c.search_runs(["0"])
    history = c.get_metric_history(run.info.run_id, PREFIX + "saves_total")
    assert max(m.value for m in history) == 2


def test_mlflow_experiment_id_in_the_environment_is_where_its_run_goes(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str
):
    """``MLFLOW_EXPERIMENT_ID`` (as a job scheduler or ``mlflow run`` sets it; MLflow's own
    ``start_run`` honours it) and no active run: the sink's run is made in that experiment, as
    with ``MLFLOW_EXPERIMENT_NAME`` (the old src put it in "Default")."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    c = mlflow.tracking.MlflowClient()
    exp = c.create_experiment("from-env")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    state = _state()
    with Checkpointer(tmp_path / "ck", every_n_steps=5, telemetry="mlflow") as ck:
        ck.restore(state)
        _train(ck, range(1, 11), state)
    assert c.search_runs(["0"]) == []
    (run,) = c.search_runs([exp])
    assert max(m.value for m in c.get_metric_history(run.info.run_id, PREFIX + "saves_total")) == 2


def test_an_experiment_id_of_another_store_is_not_used_in_the_sinks_store(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str, _empty_mlflow_store: Path
):
    """``MLFLOW_EXPERIMENT_ID`` names an experiment of the default store (``mlflow.
    set_experiment()`` sets it, as Transformers' MLflow callback calls it); the sink is given
    another store: there that id names no experiment, or another one. Its run goes to the
    other store's "Default" (the old src asked for experiment 1 there, failed at every step and
    sent nothing)."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    exp = mlflow.tracking.MlflowClient().create_experiment("of-the-default-store")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    shutil.copyfile(_empty_mlflow_store, tmp_path / "b.db")
    other = f"sqlite:///{tmp_path / 'b.db'}"
    state = _state()
    with Checkpointer(tmp_path / "ck", every_n_steps=5, telemetry=f"mlflow:{other}") as ck:
        ck.restore(state)
        _train(ck, range(1, 11), state)
    c = mlflow.tracking.MlflowClient(tracking_uri=other)
    (run,) = c.search_runs(["0"])
    assert max(m.value for m in c.get_metric_history(run.info.run_id, PREFIX + "saves_total")) == 2
