"""A sink's URL may carry credentials (``MLFLOW_TRACKING_URI=postgresql://user:pass@db/mlflow``,
``https://user:token@mlflow.example``, a Pushgateway behind basic auth): the warnings about a
sink that fails, and its name in every message, show them as ``***`` (:mod:`.redact`)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from resilient_callbacks import Checkpointer
from test_monitoring import _state, _train


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kind", ["mlflow", "pushgateway"])
def test_a_failing_sinks_warnings_do_not_show_the_credentials_in_its_url(
    tmp_path: Path, caplog, kind: str
):
    if kind == "mlflow":
        pytest.importorskip("mlflow")
    else:
        pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        url = f"http://ckuser:s3cr3t-pw@127.0.0.1:{port}/?token=tok-123"  # nothing answers
        state = _state()
        with (
            caplog.at_level(logging.DEBUG, logger="resilient_callbacks"),
            Checkpointer(tmp_path / "ck", every_n_steps=2, telemetry=f"{kind}:{url}") as ck,
        ):
            ck.restore(state)
            _train(ck, range(1, 5), state)
    said = [r.getMessage() for r in caplog.records if "metrics sink" in r.getMessage()]
    assert said, "the sink did not fail"
    assert any(f"127.0.0.1:{port}" in m for m in said), said  # which sink: still named
    for m in said:
        assert "s3cr3t-pw" not in m and "tok-123" not in m, m
