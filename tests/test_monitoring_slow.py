"""Monitoring end to end (slow: real processes, MLflow's store, Lightning): MLflow holds the
metrics and events of a run killed and resumed, and logs a verified checkpoint; a Prometheus
exporter is scraped over HTTP during ``Trainer.fit``; an unreachable MLflow server is warned
about and the run completes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_monitoring import PREFIX, free_port, wait_scrape

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "monitor_train.py"


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "RESILIENT_PROGRESS_EVERY_S": "0.2",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }


@pytest.mark.slow
def test_mlflow_across_a_sigkill_and_resume_with_a_verified_artifact(
    tmp_path: Path, mlflow_sqlite: str
):
    mlflow = pytest.importorskip("mlflow")
    uri = mlflow_sqlite
    d = tmp_path / "ck"
    base = [sys.executable, str(TRAIN), str(d), "--steps", "30", "--every", "5"]
    base += ["--mlflow-uri", uri, "--log-checkpoint", "final", "--sleep", "0.05"]
    base += ["--register-model", "monitored"]
    # cwd: MLflow puts a sqlite store's artifacts under ./mlruns
    run = dict(capture_output=True, text=True, env=_env(), timeout=600, cwd=tmp_path)
    # the store's schema made first: MLflow migrates a new sqlite store in steps, and a
    # SIGKILL in the middle of that leaves a store no process can open again (under load the
    # kill at step 17 fell there once: "duplicate column name")
    mlflow.tracking.MlflowClient(tracking_uri=uri).search_experiments()
    p = subprocess.run([*base, "--kill-at", "17"], **run)
    assert p.returncode == -9, p.stderr[-3000:]
    p = subprocess.run(base, **run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RESTORED 15" in p.stdout
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("monitoring-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # the resumed process found the run the killed one made
    run = runs[0]
    assert run.info.status == "FINISHED"
    saves = client.get_metric_history(run.info.run_id, PREFIX + "saves_total")
    assert max(m.value for m in saves) >= 3
    steps = client.get_metric_history(run.info.run_id, PREFIX + "step")
    assert max(m.step for m in steps) == 30
    tags = run.data.tags
    assert any(k.startswith("resilient_ckpt.save.step_") for k in tags)
    restore = json.loads(tags["resilient_ckpt.restore.step_15"])
    assert restore["tier"] == "local"
    art = json.loads(tags["resilient_ckpt.checkpoint_artifact"])
    assert art == {"name": "step_000000030", "step": 30, "verified": True}
    files = [f.path for f in client.list_artifacts(run.info.run_id, "checkpoints/step_000000030")]
    assert any(f.endswith("manifest.json") for f in files)
    # registered once: by the process that finished (the killed one never reached close)
    (mv,) = client.search_model_versions("name = 'monitored'")
    assert int(mv.version) == 1 and mv.run_id == run.info.run_id
    assert mv.source.endswith("/checkpoints/step_000000030")
    assert mv.tags["resilient_ckpt.step"] == "30"


@pytest.mark.slow
def test_unreachable_mlflow_warns_and_the_run_completes(tmp_path: Path, caplog):
    pytest.importorskip("mlflow")
    from resilient_callbacks import Checkpointer

    caplog.set_level(logging.WARNING, logger="resilient_callbacks")
    port = free_port()  # nothing listens there
    state = {"w": torch.zeros(4)}
    with Checkpointer(
        tmp_path / "ck", every_n_steps=2, telemetry=f"mlflow:http://127.0.0.1:{port}"
    ) as ck:
        ck.restore(state)
        for step in range(1, 11):
            state["w"] += 1
            ck.step(step, state)
    assert ck.checkpoints()[-1].step == 10
    msgs = [r.getMessage() for r in caplog.records if "metrics sink mlflow" in r.getMessage()]
    # said when it failed (retried with back-off: tests/test_sink_retry.py) and at close
    assert len(msgs) == 2 and all("unreachable" in m for m in msgs), msgs
    assert "retrying" in msgs[0] and "failed at close" in msgs[1]


@pytest.mark.slow
def test_prometheus_scraped_during_lightning_fit(tmp_path: Path):
    L = pytest.importorskip("lightning")
    from resilient_callbacks.lightning import ResilientCheckpoint

    port = free_port()
    scrapes: list[dict] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(0.01)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.global_step == 24:
                time.sleep(1.2)
                scrapes.append(wait_scrape(port))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    cb = ResilientCheckpoint(
        tmp_path / "ck",
        every_n_steps=5,
        telemetry=[f"prometheus:127.0.0.1:{port}", "logger"],
    )
    trainer = L.Trainer(
        max_steps=30,
        callbacks=[cb],
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=L.pytorch.loggers.CSVLogger(tmp_path / "logs"),
    )
    trainer.fit(Model(), loader)
    (s,) = scrapes
    assert s[PREFIX + "saves_total"][(("reason", "periodic"),)] >= 4
    assert s[PREFIX + "last_saved_step"][()] in (15.0, 20.0)
    assert s[PREFIX + "step"][()] >= 20
    assert 0 < s[PREFIX + "goodput_ratio"][()] <= 1
    # "logger": the metrics went through the trainer's logger too
    text = next((tmp_path / "logs").rglob("metrics.csv")).read_text()
    assert PREFIX + "last_save_blocking_seconds" in text
