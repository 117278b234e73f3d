"""A tracking server reached through an HTTP proxy (``HTTP_PROXY``: compute nodes without a
route or DNS to it, as MLflow's own requests honour the variable): the sink's quick check that
the server answers goes to the proxy too, so the metrics arrive (the old check dialled the
server's host directly, failed, and the sink was retried for an hour, then switched off).

The server is MLflow's own tracking server app (``mlflow.server.app``, a sqlite store) served
over HTTP on 127.0.0.1; the proxy forwards each request to it."""

from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from resilient_callbacks import Checkpointer
from resilient_callbacks.metrics import PREFIX
from test_monitoring import _state, _train


def _serve(app_or_handler, *, wsgi: bool):
    if wsgi:
        from werkzeug.serving import make_server

        server = make_server("127.0.0.1", 0, app_or_handler, threaded=True)
    else:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), app_or_handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.slow
def test_a_tracking_server_behind_an_http_proxy_gets_the_metrics(tmp_path: Path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("flask")
    pytest.importorskip("sqlalchemy")
    monkeypatch.setenv("_MLFLOW_SERVER_FILE_STORE", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    from mlflow import MlflowClient
    from mlflow.server import app

    server = _serve(app, wsgi=True)
    direct = f"http://127.0.0.1:{server.server_port}"
    hosts: list[str] = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def _forward(self) -> None:
            u = urllib.parse.urlsplit(self.path)  # a proxy's request line: the absolute URL
            hosts.append(u.netloc)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
            skip = ("host", "connection", "proxy-connection", "content-length")
            req = urllib.request.Request(
                direct + u.path + (f"?{u.query}" if u.query else ""),
                data=body,
                method=self.command,
                headers={k: v for k, v in self.headers.items() if k.lower() not in skip},
            )
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            try:
                with opener.open(req, timeout=60) as r:
                    status, data, kind = r.status, r.read(), r.headers.get("Content-Type")
            except urllib.error.HTTPError as e:
                status, data, kind = e.code, e.read(), e.headers.get("Content-Type")
            self.send_response(status)
            self.send_header("Content-Type", kind or "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_DELETE = _forward

        def log_message(self, *args: object) -> None:
            pass

    proxy = _serve(Proxy, wsgi=False)
    try:
        for name in ("HTTP_PROXY", "http_proxy"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.server_address[1]}")
        for name in ("NO_PROXY", "no_proxy"):  # the test's own client goes direct
            monkeypatch.setenv(name, "127.0.0.1,localhost")
        uri = "http://mlflow.behind-a-proxy.invalid:5000"  # (.invalid never resolves)
        state = _state()
        with Checkpointer(
            tmp_path / "ck",
            every_n_steps=5,
            telemetry={"kind": "mlflow", "tracking_uri": uri, "experiment": "proxied"},
        ) as ck:
            ck.restore(state)
            _train(ck, range(1, 11), state)
        assert "mlflow.behind-a-proxy.invalid:5000" in hosts
        c = MlflowClient(tracking_uri=direct)
        (run,) = c.search_runs([c.get_experiment_by_name("proxied").experiment_id])
        history = c.get_metric_history(run.info.run_id, PREFIX + "saves_total")
        assert max(m.value for m in history) == 2
    finally:
        proxy.shutdown()
        server.shutdown()
