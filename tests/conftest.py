"""Shared fixtures: a real S3 API server (moto's ThreadedMotoServer) on 127.0.0.1.

``s3_server`` is one server per test session (the AWS credentials it needs are set for the
tests that use it alone); it can be stopped and started again on the same
port (moto keeps its buckets in-process, so the data survives a restart, like a store that was
unreachable for a while). ``s3_remote`` gives each test its own bucket and returns the
``(url, remote_options)`` pair to pass as ``Checkpointer(remote=url, remote_options=options)``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from torch_needs import DCP_MISSING, TRANSFORMERS_MISSING

# files built on resilient_callbacks.dcp, or on the Transformers Trainer: not collected where the
# running torch cannot run them (RESILIENT_TORCH=torch==2.4.1 bash scripts/test.sh)
DCP_FILES = [
    "test_dcp_sharded.py",
    "test_dcp_storage.py",
    "test_dcp_storage_edges.py",
    "test_sharded_reshard.py",
    "test_upstream_dcp.py",
]
TRANSFORMERS_FILES = [
    "test_transformers.py",
    "test_transformers_auto_batch.py",
    "test_transformers_best.py",
    "test_transformers_callback_order.py",
    "test_transformers_checks.py",
    "test_transformers_collator_rng.py",
    "test_transformers_ddp.py",
    "test_transformers_fsdp.py",
    "test_transformers_hp_search.py",
    "test_transformers_many_trainings.py",
    "test_transformers_new_data.py",
    "test_transformers_phases.py",
    "test_transformers_preempted.py",
    "test_transformers_scheduler_settings.py",
    "test_transformers_settings_killed.py",
    "test_transformers_setups.py",
    "test_transparent_transformers.py",
    "test_upstream_transformers.py",
]
collect_ignore = (DCP_FILES if DCP_MISSING else []) + (
    TRANSFORMERS_FILES if TRANSFORMERS_MISSING else []
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the test modules imported at collection (torch, transformers, lightning, ...: about
    half a million objects) lives as long as the test process: frozen, the cyclic collector no
    longer walks it at every full collection. accelerate's out-of-memory retry calls
    ``gc.collect()`` at every attempt (0.4 s each in a fresh process, seconds each late in the
    suite: one auto-batch-size test took 104 s in the suite, 13 s alone), and the collections
    Python runs by itself get as cheap. What the tests create stays collectable."""
    gc.collect()
    gc.freeze()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test module's last test, freeze as above what lives on (modules imported by the
    tests themselves: deepspeed, lightning's strategies, ...); its garbage is collected first."""
    if nextitem is not None and nextitem.path != item.path:
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def _trains_on_after_a_caught_preemption_exit() -> Iterator[None]:
    """A test that catches a preemption's ``SystemExit(75)`` leaves this process as a real one
    on its way out is left: marked as exiting, the handlers that keep its exit code in place
    (``preemption/exiting.py``). After the test it trains on, with the handlers from before,
    as the next test expects (``exiting.clear()``, as the next Checkpointer would)."""
    yield
    exiting = sys.modules.get("resilient_callbacks.preemption.exiting")
    if exiting is not None:
        exiting.clear()


@pytest.fixture(autouse=True)
def _framework_globals_put_back() -> Iterator[None]:
    """What a training run in the test process leaves behind, put back after the test:
    Lightning's ``seed_everything()`` sets ``PL_GLOBAL_SEED``/``PL_SEED_WORKERS`` in
    ``os.environ`` (later in-process fits' ``DistributedSampler`` seed, and every process a
    later test starts, inherit them), and the training scripts run in-process
    (``lightning_train.main``) call ``torch.set_num_threads(1)``: later tests ran with one
    thread or two depending on whether such a test ran before them."""
    import torch

    env = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    threads = torch.get_num_threads()
    yield
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def pytest_report_header() -> list[str]:
    said = []
    if DCP_MISSING:
        said.append(f"not collected: {', '.join(DCP_FILES)} ({DCP_MISSING})")
    if TRANSFORMERS_MISSING:
        said.append(f"not collected: {', '.join(TRANSFORMERS_FILES)} ({TRANSFORMERS_MISSING})")
    return said


@dataclass
class S3Server:
    host: str
    port: int
    _server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server (pass as ``remote_options``)."""
        return {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        if self._server is None:
            self._server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
            self._server.start()
            self.host, self.port = self._server.get_host_and_port()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def create_bucket(self, name: str | None = None) -> str:
        import boto3

        name = name or f"rc-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=name)
        return name


#: what the tests using the S3 server run with (fake credentials, moto's region): set for those
#: tests alone (:func:`s3_server`), so that no other test runs with credentials it did not set
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
#: those variables as the session found them
AWS_AT_START = {var: os.environ.get(var) for var in S3_ENV}


@pytest.fixture(scope="session")
def _s3_session_server() -> Iterator[S3Server]:
    """The one S3 server of the session (started once: :func:`s3_server` is its way in)."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server(host="127.0.0.1", port=0)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_server(_s3_session_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session's S3 server, and :data:`S3_ENV` in ``os.environ`` for this test alone (and
    the processes it starts): set at the session's start and never removed, they made every
    later test of the session run with fake AWS credentials."""
    for var, value in S3_ENV.items():
        monkeypatch.setenv(var, value)
    return _s3_session_server


@pytest.fixture
def s3_remote(s3_server: S3Server) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh bucket on the session's S3 server: ``(url, remote_options)``. Restarts the
    server first if an earlier test left it stopped."""
    s3_server.start()
    bucket = s3_server.create_bucket()
    yield f"s3://{bucket}/run", s3_server.options
    s3_server.start()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for an in-process Trainer, as in the subprocess runs (the machine
    is small and shared: more threads only contend)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs mounted under tmp_path (needs root and mount permission)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs to simulate a full disk: {r.stderr.strip() or r.returncode}"
        )
    try:
        yield mnt
    finally:
        r = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture(scope="session")
def _empty_mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow sqlite store, its schema made once a session: MLflow makes a new store
    in dozens of migration steps, seconds of CPU each time."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    import mlflow

    folder = tmp_path_factory.mktemp("mlflow-empty")
    path = folder / "mlflow.db"
    with contextlib.chdir(folder):  # (its Default experiment's artifacts: ./mlruns, here)
        mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_sqlite(tmp_path: Path, _empty_mlflow_store: Path) -> Iterator[str]:
    """The tracking URI of a new, empty MLflow sqlite store of this test alone,
    ``tmp_path/mlflow.db`` (a copy of :func:`_empty_mlflow_store`: its schema already made,
    as a store that a tracking server or an earlier run created).

    MLflow's process-wide state is put back after the test: ``mlflow.set_experiment()`` (which
    Transformers' MLflow callback calls) sets ``MLFLOW_EXPERIMENT_ID`` in ``os.environ`` and
    the active experiment, ``set_tracking_uri()`` the default store, a failed test may leave
    a run active. Left behind, they named an experiment of this test's deleted store to the
    later tests (a later test's run went to "experiment 1" of a new store, which had none)."""
    import mlflow
    from mlflow.tracking import _tracking_service, fluent

    shutil.copyfile(_empty_mlflow_store, tmp_path / "mlflow.db")
    env = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    experiment, uri = fluent._active_experiment_id, _tracking_service.utils._tracking_uri
    try:
        yield f"sqlite:///{tmp_path / 'mlflow.db'}"
    finally:
        while mlflow.active_run() is not None:  # (this thread's: MLflow's stack is per thread)
            mlflow.end_run()
        for k in [k for k in os.environ if k.startswith("MLFLOW_") and k not in env]:
            del os.environ[k]
        os.environ.update(env)
        fluent._active_experiment_id = experiment
        _tracking_service.utils._tracking_uri = uri
