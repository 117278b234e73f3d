"""MLflow's model registry, with a real sqlite store: the checkpoint the sink logs as an artifact
becomes a model version (source: the artifact, run: the MLflow run, tags: the checkpoint's step
and manifest digest); a resumed run that logs a newer checkpoint adds version 2, one that logs
the same checkpoint adds none; a registry that fails is warned about and the run completes; a
``register_model`` without ``log_checkpoint`` is a ConfigError at construction."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from resilient_callbacks import Checkpointer, ConfigError
from resilient_callbacks.catalog import Depth, Status, scan, verify
from resilient_callbacks.manifest import MANIFEST_NAME, read_manifest

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")


def _sink(uri: str, **extra) -> dict:
    return {
        "kind": "mlflow",
        "tracking_uri": uri,
        "experiment": "registry-test",
        "log_checkpoint": "final",
        "register_model": "tiny-linear",
        **extra,
    }


def _run(d: Path, sink: dict, last: int, **options) -> int:
    """Restore from ``d`` and train up to step ``last`` (a save every 5 and at the end)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)  # the weight: 16 KiB, a blob with incremental=True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    with Checkpointer(d, every_n_steps=5, keep_last=2, telemetry=sink, **options) as ck:
        start = ck.restore(state)
        for step in range(start + 1, last + 1):
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.step(step, state, final=step == last)
    return start


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_logged_checkpoint_is_registered_and_a_resumed_run_adds_a_version(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str
):
    monkeypatch.chdir(tmp_path)  # a sqlite store puts its artifacts under ./mlruns
    uri = mlflow_sqlite
    d = tmp_path / "ck"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)

    # incremental: the weight lives in <dirpath>/blobs, outside the checkpoint's own folder
    assert _run(d, _sink(uri), 10, incremental=True) == 0
    assert read_manifest(str(d / "step_000000010")).blobs
    (run,) = client.search_runs([client.get_experiment_by_name("registry-test").experiment_id])
    run_id = run.info.run_id
    v1 = client.get_model_version("tiny-linear", "1")
    assert v1.run_id == run_id
    assert v1.source == f"{run.info.artifact_uri}/checkpoints/step_000000010"
    assert v1.tags["resilient_ckpt.step"] == "10"
    assert v1.tags["resilient_ckpt.checkpoint"] == "step_000000010"
    assert v1.tags["resilient_ckpt.manifest_sha256"] == _sha256(
        d / "step_000000010" / MANIFEST_NAME
    )
    # what the version points at is the whole checkpoint, its blobs in: download it elsewhere
    # and verify every checksum (blobs resolve inside it, or beside it where there are none)
    got = Path(mlflow.artifacts.download_artifacts(v1.source, dst_path=str(tmp_path / "dl1")))
    assert got == tmp_path / "dl1" / "step_000000010"
    verify(str(got), read_manifest(str(got)), Depth.FULL)
    assert read_manifest(str(got)).step == 10
    assert (got / "blobs").is_dir()
    model = torch.nn.Linear(64, 64)  # and a Checkpointer restores from the download
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with Checkpointer(tmp_path / "dl1") as ck:
        assert ck.restore(state) == 10

    # a second process resumes, trains on and logs a newer checkpoint: version 2, same run
    assert _run(d, _sink(uri), 15, incremental=True) == 10
    v2 = client.get_model_version("tiny-linear", "2")
    assert v2.run_id == run_id
    assert v2.tags["resilient_ckpt.step"] == "15"
    assert v2.source.endswith("/checkpoints/step_000000015")
    assert v2.tags["resilient_ckpt.manifest_sha256"] == _sha256(
        d / "step_000000015" / MANIFEST_NAME
    )
    assert v2.tags["resilient_ckpt.manifest_sha256"] != v1.tags["resilient_ckpt.manifest_sha256"]
    tag = json.loads(client.get_run(run_id).data.tags["resilient_ckpt.registered_model"])
    assert tag == {"name": "tiny-linear", "version": 2, "step": 15}

    # a third resumes with nothing left to train: the same checkpoint again, no new version
    assert _run(d, _sink(uri), 15, incremental=True) == 15
    versions = client.search_model_versions("name = 'tiny-linear'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_failing_registry_is_warned_about_and_the_artifact_stays(
    tmp_path: Path, monkeypatch, caplog, mlflow_sqlite: str
):
    caplog.set_level(logging.WARNING, logger="resilient_callbacks")
    monkeypatch.chdir(tmp_path)
    uri = mlflow_sqlite
    (tmp_path / "a_file").write_text("not a directory")
    broken = f"sqlite:///{tmp_path / 'a_file' / 'registry.db'}"  # cannot be created
    d = tmp_path / "ck"
    _run(d, _sink(uri, registry_uri=broken), 5)
    assert [e.step for e in scan(str(d)) if e.status is Status.VALID] == [5]  # it completed
    msgs = [r.getMessage() for r in caplog.records if "registering checkpoint" in r.getMessage()]
    assert len(msgs) == 1 and "tiny-linear" in msgs[0], msgs
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("registry-test").experiment_id])
    assert run.info.status == "FINISHED"  # the sink went on to close its run
    art = json.loads(run.data.tags["resilient_ckpt.checkpoint_artifact"])
    assert art["name"] == "step_000000005"
    assert "resilient_ckpt.registered_model" not in run.data.tags


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"register_model": "m"}, "log_checkpoint"),
        ({"register_model": "m", "log_checkpoint": None}, "log_checkpoint"),
        ({"register_model": "a/b", "log_checkpoint": "final"}, "'/'"),
        ({"register_model": "", "log_checkpoint": "best"}, "non-empty"),
        ({"register_model": 3, "log_checkpoint": "best"}, "non-empty"),
    ],
)
def test_register_model_is_validated_early(tmp_path: Path, options: dict, says: str):
    with pytest.raises(ConfigError, match=says):
        Checkpointer(tmp_path, telemetry={"kind": "mlflow", **options})


def test_the_best_checkpoint_logged_is_this_runs_not_another_runs_beside_it(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str
):
    """An older run's checkpoints in the same directory (this run started with resume="never")
    score better: the artifact and the model version are still this run's best."""
    monkeypatch.chdir(tmp_path)
    uri = mlflow_sqlite
    d, state = tmp_path / "ck", {"model": torch.nn.Linear(8, 8)}
    with Checkpointer(d, every_n_steps=5, keep_last=2, keep_best=1, monitor="loss") as ck:
        ck.restore(state)
        for step in range(1, 11):  # the older run: far better losses
            ck.step(step, state, {"loss": 0.01 * step})
    sink = _sink(uri, log_checkpoint="best")
    opts = {"every_n_steps": 5, "keep_last": 2, "keep_best": 1, "monitor": "loss"}
    with Checkpointer(d, resume="never", telemetry=sink, **opts) as ck:
        ck.restore(state)
        for step in range(1, 11):  # its best: step 5 (loss 0.5)
            ck.step(step, state, {"loss": 0.5 if step == 5 else 1.0 + 0.1 * step})
        mine = ck._dir.run_id
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("registry-test").experiment_id])
    name = json.loads(run.data.tags["resilient_ckpt.checkpoint_artifact"])["name"]
    logged = read_manifest(str(d / name))
    assert logged.run_id == mine, (name, logged.run_id, mine)
    assert logged.step == 5 and logged.metrics["loss"] == pytest.approx(0.5)
    v1 = client.get_model_version("tiny-linear", "1")
    assert v1.tags["resilient_ckpt.checkpoint"] == name


def test_the_best_checkpoint_logged_of_tied_scores_is_the_kept_best(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str
):
    """Every save reports the same loss: retention keeps the earliest as the best (a later
    score must be strictly better); the sink logged the newest of the ties, the checkpoint
    kept as the newest, not the best."""
    monkeypatch.chdir(tmp_path)
    uri = mlflow_sqlite
    d, state = tmp_path / "ck", {"model": torch.nn.Linear(8, 8)}
    opts = {"every_n_steps": 5, "keep_last": 1, "keep_best": 1, "monitor": "loss"}
    with Checkpointer(d, telemetry=_sink(uri, log_checkpoint="best"), **opts) as ck:
        ck.restore(state)
        for step in range(1, 16):
            ck.step(step, state, {"loss": 1.0})
    assert sorted(e.step for e in scan(str(d), Depth.NONE) if e.status is Status.VALID) == [5, 15]
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("registry-test").experiment_id])
    name = json.loads(run.data.tags["resilient_ckpt.checkpoint_artifact"])["name"]
    assert read_manifest(str(d / name)).step == 5


def test_the_best_checkpoint_logged_without_any_score_is_the_newest(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str
):
    """log_checkpoint="best" but no save reported the monitored metric (the evaluation never
    ran): the checkpoints unscored are tried newest first, as before the earliest-of-ties rule
    (528e433 ranked them earliest first too, and logged the run's first checkpoint)."""
    monkeypatch.chdir(tmp_path)
    uri = mlflow_sqlite
    d, state = tmp_path / "ck", {"model": torch.nn.Linear(8, 8)}
    opts = {"every_n_steps": 5, "keep_last": 2, "keep_best": 1, "monitor": "loss"}
    with Checkpointer(d, telemetry=_sink(uri, log_checkpoint="best"), **opts) as ck:
        ck.restore(state)
        for step in range(1, 11):
            ck.step(step, state)  # no metrics
    assert sorted(e.step for e in scan(str(d), Depth.NONE) if e.status is Status.VALID) == [5, 10]
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("registry-test").experiment_id])
    name = json.loads(run.data.tags["resilient_ckpt.checkpoint_artifact"])["name"]
    assert read_manifest(str(d / name)).step == 10


def test_the_best_checkpoint_logged_is_of_the_current_lineage(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str
):
    """The run rolled back (resume=5 while 10 existed): the abandoned 10 scored best and is
    still there (keep_last=None). Retention ranks the current lineage's best first (10-1);
    the sink logged the abandoned 10, a timeline the run threw away."""
    monkeypatch.chdir(tmp_path)
    uri = mlflow_sqlite
    d, state = tmp_path / "ck", {"model": torch.nn.Linear(8, 8)}
    opts = {"every_n_steps": 5, "keep_last": None, "keep_best": 1, "monitor": "loss"}
    with Checkpointer(d, **opts) as ck:
        ck.restore(state)
        for step in range(1, 11):
            ck.step(step, state, {"loss": 0.1 if step == 10 else 1.0})
    with Checkpointer(d, resume=5, telemetry=_sink(uri, log_checkpoint="best"), **opts) as ck:
        assert ck.restore(state) == 5
        for step in range(6, 16):
            ck.step(step, state, {"loss": 0.5 if step == 10 else 0.9})
    assert (d / "step_000000010").is_dir()  # the abandoned one, kept
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("registry-test").experiment_id])
    name = json.loads(run.data.tags["resilient_ckpt.checkpoint_artifact"])["name"]
    assert name == "step_000000010-1"
