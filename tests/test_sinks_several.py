"""Several Checkpointers in one process (a model's and its EMA's), each with metrics sinks: in
one active MLflow run their metrics, event tags and checkpoint artifacts do not mix (the second
logs into a run nested in it); two exporters on one port say which is which."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.metrics import PREFIX
from test_monitoring import exporter_port


def _train_both(a: Checkpointer, b: Checkpointer, last: int) -> None:
    model, ema = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    a.restore({"m": model})
    b.restore({"m": ema})
    for step in range(1, last + 1):
        a.step(step, {"m": model})
        b.step(step, {"m": ema})


def test_two_checkpointers_in_one_active_mlflow_run_do_not_mix(
    tmp_path: Path, monkeypatch, mlflow_sqlite: str
):
    """``with mlflow.start_run():`` around a model's Checkpointer (a save every 5 steps) and an
    EMA's (every 10), both ``telemetry={"kind": "mlflow", "log_checkpoint": "final"}``: the old
    src logged both into the active run, so ``saves_total`` went 1, 1, 2, 2, ... from two
    sources, the EMA's ``save.step_10`` tag overwrote the model's and one checkpoint artifact
    the other. Now the model's go to the active run and the EMA's to a run nested in it, named
    after its directory."""
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    monkeypatch.chdir(tmp_path)  # a sqlite store puts its artifacts under ./mlruns
    # the environment, not mlflow.set_tracking_uri(): that one outlives the test
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite)
    sink = {"kind": "mlflow", "log_checkpoint": "final"}
    exp = mlflow.tracking.MlflowClient().create_experiment("several")
    with (
        mlflow.start_run(experiment_id=exp) as active,
        Checkpointer(tmp_path / "model", every_n_steps=5, telemetry=sink) as a,
        Checkpointer(tmp_path / "ema", every_n_steps=10, telemetry=sink) as b,
    ):
        _train_both(a, b, 30)
    c = mlflow.tracking.MlflowClient()
    runs = {r.info.run_id: r for r in c.search_runs([active.info.experiment_id])}
    assert len(runs) == 2, [r.info.run_name for r in runs.values()]
    (nested,) = [r for r in runs.values() if r.info.run_id != active.info.run_id]
    assert nested.data.tags["mlflow.parentRunId"] == active.info.run_id
    assert nested.info.run_name == "ema" and nested.info.status == "FINISHED"
    for run, dirpath, saves in ((runs[active.info.run_id], "model", 6), (nested, "ema", 3)):
        history = c.get_metric_history(run.info.run_id, PREFIX + "saves_total")
        assert max(m.value for m in history) == saves, dirpath
        tags = [k for k in run.data.tags if k.startswith("resilient_ckpt.save.step_")]
        assert len(tags) == saves, (dirpath, tags)
        art = json.loads(run.data.tags["resilient_ckpt.checkpoint_artifact"])
        assert art["step"] == 30
        (manifest,) = [
            f.path
            for f in c.list_artifacts(run.info.run_id, "checkpoints/step_000000030")
            if f.path.endswith("manifest.json")
        ]
        local = c.download_artifacts(run.info.run_id, manifest, str(tmp_path / dirpath))
        assert (tmp_path / dirpath / "step_000000030" / "manifest.json").read_bytes() == (
            Path(local).read_bytes()
        )


def test_two_exporters_on_one_port_name_the_conflict(tmp_path: Path, caplog):
    """The EMA's Checkpointer given the model's exporter port: switched off at once with a
    message that says it is this process's other Checkpointer and what to do (the old src said
    only "address in use ... is another exporter using that port?"; a retry cannot mend it)."""
    pytest.importorskip("prometheus_client")
    with (
        caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
        Checkpointer(tmp_path / "model", every_n_steps=5, telemetry="prometheus:127.0.0.1:0") as a,
    ):
        port = exporter_port(a)  # bound by the model's exporter: no other process can take it
        sink = f"prometheus:127.0.0.1:{port}"
        with Checkpointer(tmp_path / "ema", every_n_steps=10, telemetry=sink) as b:
            _train_both(a, b, 10)
    # after close: each sink has started by then (in its own thread)
    said = [r.getMessage() for r in caplog.records if "metrics sink" in r.getMessage()]
    assert len(said) == 1, said
    assert "another Checkpointer of this process" in said[0]
    assert f"prometheus:{port + 1}" in said[0] and "switched off" in said[0]


def test_two_textfiles_at_one_path_name_the_conflict(tmp_path: Path, caplog):
    """Both given ``textfile:ckpt.prom``: the old src let each rewrite the file with its own
    values, so node_exporter saw the model's and the EMA's saves in turn under one series. The
    second one is switched off at once, with what to do; the file holds the first one's."""
    prom_parser = pytest.importorskip("prometheus_client.parser")
    path = tmp_path / "ckpt.prom"
    sink = f"textfile:{path}"
    with (
        caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
        Checkpointer(tmp_path / "model", every_n_steps=5, telemetry=sink) as a,
        Checkpointer(tmp_path / "ema", every_n_steps=10, telemetry=sink) as b,
    ):
        _train_both(a, b, 30)
    said = [r.getMessage() for r in caplog.records if "metrics sink" in r.getMessage()]
    assert len(said) == 1, said
    assert "another Checkpointer of this process writes its metrics to" in said[0]
    assert "ckpt.ema.prom" in said[0] and "switched off" in said[0]
    fams = {f.name: f for f in prom_parser.text_string_to_metric_families(path.read_text())}
    saves = sum(s.value for s in fams[PREFIX + "saves"].samples)
    assert saves in (6, 3)  # the model's or the EMA's (whichever started first), not a mix


def test_two_pushgateway_sinks_with_one_grouping_key_name_the_conflict(tmp_path: Path, caplog):
    """Both given ``pushgateway:URL``: each push replaces the group ``job/instance`` holds, so
    the old src had the model's and the EMA's values take turns in one group (the Pushgateway
    showed whichever pushed last, as if one run). The second is switched off at once, saying
    what to do; every push the gateway (an HTTP server on 127.0.0.1 taking PUTs as the
    Pushgateway's API does) received comes from one of them."""
    import http.server
    import threading

    prom_parser = pytest.importorskip("prometheus_client.parser")
    bodies: list[tuple[str, bytes]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            bodies.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    ).start()  # (shutdown() waits for a poll: 0.5 s by default)
    sink = f"pushgateway:http://127.0.0.1:{server.server_address[1]}"
    try:
        with (
            caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
            Checkpointer(tmp_path / "model", every_n_steps=5, telemetry=sink) as a,
            Checkpointer(tmp_path / "ema", every_n_steps=10, telemetry=sink) as b,
        ):
            _train_both(a, b, 30)
    finally:
        server.shutdown()
    intervals = set()
    for _, body in bodies:
        for fam in prom_parser.text_string_to_metric_families(body.decode()):
            if fam.name == PREFIX + "interval_steps":
                intervals.update(s.value for s in fam.samples)
    assert len(intervals) == 1, intervals  # the model's (5) or the EMA's (10), never both
    said = [r.getMessage() for r in caplog.records if "metrics sink" in r.getMessage()]
    assert len(said) == 1, said
    assert "another Checkpointer of this process pushes its metrics to" in said[0]
    assert "job" in said[0] and "switched off" in said[0]


def test_per_rank_exporters_whose_port_ranges_overlap_name_the_conflict(
    tmp_path: Path, caplog, monkeypatch
):
    """``per_rank`` exporters on a node of 4 ranks: the model's on PORT serve PORT..PORT+3 (one
    per local rank), so the EMA's given PORT+1 (what the conflict message suggested) took rank
    1's port for its rank 0: on the node one of the two lost its port and Prometheus' target
    PORT+1 served either. The second is switched off at once and told a port past the range."""
    pytest.importorskip("prometheus_client")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with (
        caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
        Checkpointer(
            tmp_path / "model",
            every_n_steps=5,
            telemetry={"kind": "prometheus", "addr": "127.0.0.1", "port": 0},
        ) as probe,
    ):
        port = exporter_port(probe)  # a free port (and the three after it, most likely)
    caplog.clear()
    sink = {"kind": "prometheus", "addr": "127.0.0.1", "per_rank": True}
    with (
        caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
        Checkpointer(tmp_path / "model", every_n_steps=5, telemetry={**sink, "port": port}) as a,
    ):
        assert exporter_port(a) == port
        with Checkpointer(
            tmp_path / "ema", every_n_steps=10, telemetry={**sink, "port": port + 1}
        ) as b:
            _train_both(a, b, 10)
    said = [r.getMessage() for r in caplog.records if "metrics sink" in r.getMessage()]
    assert len(said) == 1, said
    assert "another Checkpointer of this process serves its metrics on" in said[0]
    assert f"prometheus:{port + 4}" in said[0] and "switched off" in said[0]


def test_a_pushgateway_sink_still_finishing_its_last_push_is_no_conflict(tmp_path: Path, caplog):
    """A Checkpointer closed while its last push hangs (close() does not wait past its
    timeout), then another one of the same process pushing as the same job (Lightning's second
    fit): that one pushes; only two open at once are a conflict."""
    import http.server
    import threading

    hold, held, paths = threading.Event(), threading.Event(), []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if hold.is_set() and not held.is_set():
                held.set()  # the first push after hold: the closing one's, kept waiting
                release.wait(120)
            paths.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    release = threading.Event()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    ).start()  # (shutdown() waits for a poll: 0.5 s by default)
    sink = f"pushgateway:http://127.0.0.1:{server.server_address[1]}"
    try:
        with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
            _close_held_then_open_another(tmp_path, sink, hold, held, paths)
    finally:
        release.set()
        server.shutdown()
    said = [r.getMessage() for r in caplog.records if "another Checkpointer" in r.getMessage()]
    assert said == []


def _close_held_then_open_another(
    tmp_path: Path, sink: str, hold: Any, held: Any, done: list[Any]
) -> None:
    """A Checkpointer closed (with a short timeout) while its sink's last output hangs
    (``hold`` set, ``held`` set by the hanging output), then a second one on the same sink,
    whose output arrives (``done`` grows)."""
    a = Checkpointer(tmp_path / "first", every_n_steps=5, telemetry=sink)
    model = torch.nn.Linear(8, 8)
    a.restore({"m": model})
    for step in range(1, 6):
        a.step(step, {"m": model})
    hold.set()
    a.close(timeout=0.5)  # its last output hangs: not waited for
    assert held.wait(60)
    n = len(done)
    with Checkpointer(tmp_path / "second", every_n_steps=5, telemetry=sink) as b:
        b.restore({})
    # the second one's output arrived (by its close, or soon after where a loaded machine
    # made its close give up waiting)
    assert _within(60, lambda: len(done) > n)


def test_a_textfile_sink_still_finishing_its_last_write_is_no_conflict(
    tmp_path: Path, caplog, monkeypatch
):
    """A Checkpointer closed while its last textfile write hangs (a stalled NFS mount; close()
    does not wait past its timeout), then another one of the same process writing the same
    file (Lightning's second fit): that one writes it; only two open at once are a conflict."""
    pytest.importorskip("prometheus_client")
    import threading

    from resilient_callbacks.sinks import prometheus

    hold, held, release, writes = threading.Event(), threading.Event(), threading.Event(), []
    write = prometheus.PrometheusTextfile._write

    def hanging_write(self: prometheus.PrometheusTextfile) -> None:
        if hold.is_set() and not held.is_set():
            held.set()  # the first write after hold: the closing one's, kept waiting
            release.wait(120)
        write(self)
        writes.append(self)

    monkeypatch.setattr(prometheus.PrometheusTextfile, "_write", hanging_write)
    sink = f"textfile:{tmp_path / 'ckpt.prom'}"
    try:
        with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
            _close_held_then_open_another(tmp_path, sink, hold, held, writes)
    finally:
        release.set()
    said = [r.getMessage() for r in caplog.records if "another Checkpointer" in r.getMessage()]
    assert said == []


def _within(seconds: float, cond: Callable[[], bool]) -> bool:
    """Whether ``cond`` holds within ``seconds`` (a bound on a hang, not a timing claim)."""
    import time

    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_two_exporters_starting_at_once_on_one_port_serve_one_and_name_the_conflict(monkeypatch):
    """Each sink starts in its own thread, so the model's and the EMA's exporters, given one
    port, can start at the same time. The old src checked that no exporter of this process
    held the port and then bound it, unlocked: the second one checked while the first was
    binding, found the port free, and either bound it first (the model's exporter then failed
    with "address in use") or failed with "address in use" itself (retried, as a port of
    another process is). Now the check and the bind are one step: the first serves, the second
    is told at once that another Checkpointer of this process serves that port. Made
    deterministic: the first exporter's bind waits until the second has reached the check
    (or the lock before it)."""
    import socket
    import threading
    import urllib.request

    prometheus_client = pytest.importorskip("prometheus_client")
    from resilient_callbacks.errors import ConfigError
    from resilient_callbacks.sinks import prometheus
    from resilient_callbacks.telemetry import Telemetry

    with socket.socket() as s:  # a port free now (bound by the test's exporters from here on)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first, second = (prometheus.PrometheusExporter(port, addr="127.0.0.1") for _ in range(2))
    binding, second_moved = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    real_start = prometheus_client.start_http_server
    real_lock = getattr(prometheus, "_SERVING_LOCK", threading.Lock())

    def start_http_server(*a: Any, **k: Any) -> Any:
        if threading.current_thread().name == "first":
            binding.set()
            assert second_moved.wait(60), "the second exporter did not start"
        return real_start(*a, **k)

    class Arrival:  # the lock, saying when the second exporter arrives at it
        def __enter__(self) -> None:
            if threading.current_thread().name == "second":
                second_moved.set()
            real_lock.acquire()

        def __exit__(self, *exc: Any) -> None:
            real_lock.release()

    monkeypatch.setattr(prometheus_client, "start_http_server", start_http_server)
    monkeypatch.setattr(prometheus, "_SERVING_LOCK", Arrival(), raising=False)

    def start(name: str, sink: Any) -> None:
        try:
            sink.start(Telemetry())
            outcome[name] = "serving"
        except Exception as e:
            outcome[name] = e
        finally:
            if name == "second":
                second_moved.set()

    threads = {
        n: threading.Thread(target=start, args=(n, s), name=n)
        for n, s in (("first", first), ("second", second))
    }
    try:
        threads["first"].start()
        assert binding.wait(60), "the first exporter did not start"
        threads["second"].start()
        for t in threads.values():
            t.join(60)
            assert not t.is_alive()
        assert outcome["first"] == "serving", outcome
        assert isinstance(outcome["second"], ConfigError), outcome
        assert "another Checkpointer of this process" in str(outcome["second"])
        assert f"prometheus:{port + 1}" in str(outcome["second"])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
            assert PREFIX + "uploads_total" in r.read().decode()  # (the first one serves)
    finally:
        first.close()
        second.close()
    assert not [h for h in prometheus._SERVING if h[1] == port]


def test_two_textfiles_starting_at_once_at_one_path_name_the_conflict(tmp_path: Path, monkeypatch):
    """As for exporters: two textfile sinks given one path and starting at the same moment
    (each in its own thread) both found the path unclaimed in the old src and both rewrote the
    file with their own values. Now one writes it, the other is told at once. Made
    deterministic: each claim waits, between its look and its entry, until the other one has
    looked too or arrived at the lock."""
    import threading

    pytest.importorskip("prometheus_client")
    from resilient_callbacks.errors import ConfigError
    from resilient_callbacks.sinks import CallableSink, prometheus
    from resilient_callbacks.telemetry import Telemetry

    path = tmp_path / "ckpt.prom"
    moved = {n: threading.Event() for n in ("first", "second")}  # looked, or at the lock
    real_lock = getattr(prometheus, "_CLAIMING", threading.Lock())

    def other() -> str:
        return "second" if threading.current_thread().name == "first" else "first"

    class Looks(dict):  # _WRITING, holding each claim between its look and its entry
        def get(self, *a: Any) -> Any:
            found = super().get(*a)
            if threading.current_thread().name in moved:  # (not close() in the test's thread)
                moved[threading.current_thread().name].set()
                assert moved[other()].wait(60), "the other sink did not start"
            return found

    class Arrival:  # the lock, saying when a sink arrives at it
        def __enter__(self) -> None:
            if threading.current_thread().name in moved:
                moved[threading.current_thread().name].set()
            real_lock.acquire()

        def __exit__(self, *exc: Any) -> None:
            real_lock.release()

    monkeypatch.setattr(prometheus, "_WRITING", Looks())
    monkeypatch.setattr(prometheus, "_CLAIMING", Arrival(), raising=False)
    outcome: dict[str, Any] = {}
    sinks = {n: prometheus.PrometheusTextfile(path) for n in ("first", "second")}
    # telemetry with a sink attached (an active one: a closed Checkpointer's claim is none)
    telemetry = {n: Telemetry([CallableSink(lambda d: None)]) for n in sinks}

    def start(name: str) -> None:
        try:
            sinks[name].start(telemetry[name])
            outcome[name] = "writing"
        except Exception as e:
            outcome[name] = e

    threads = [threading.Thread(target=start, args=(n,), name=n) for n in sinks]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert sorted(map(str, outcome.values())).count("writing") == 1, outcome
        (refused,) = [e for e in outcome.values() if e != "writing"]
        assert isinstance(refused, ConfigError), outcome
        assert "another Checkpointer of this process writes its metrics to" in str(refused)
    finally:
        for name in sinks:
            sinks[name].close()
            telemetry[name].close()


def test_an_exporter_on_all_addresses_and_one_on_localhost_at_one_port_name_the_conflict(
    tmp_path: Path, caplog
):
    """The model's exporter on ``127.0.0.1:PORT``, the EMA's given ``0.0.0.0:PORT`` (every
    address: localhost too): the old src compared the address strings, found no conflict, and
    the EMA's failed with "address in use ... is another exporter using that port?" and was
    retried for minutes. It is told at once that another Checkpointer of this process serves
    that port."""
    pytest.importorskip("prometheus_client")
    with (
        caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
        Checkpointer(tmp_path / "model", every_n_steps=5, telemetry="prometheus:127.0.0.1:0") as a,
    ):
        port = exporter_port(a)
        with Checkpointer(tmp_path / "ema", every_n_steps=10, telemetry=f"prometheus:{port}") as b:
            _train_both(a, b, 10)
    said = [r.getMessage() for r in caplog.records if "metrics sink" in r.getMessage()]
    assert len(said) == 1, said
    assert f"another Checkpointer of this process serves its metrics on 127.0.0.1:{port}" in said[0]
    assert "switched off" in said[0]


@pytest.mark.parametrize("bindv6only", ["0", "1", None])
def test_an_exporter_on_ipv6_all_addresses_overlaps_ipv4_as_the_host_binds_it(
    tmp_path: Path, monkeypatch, bindv6only: str | None
):
    """``::`` takes IPv4 too only where ``net.ipv6.bindv6only`` is 0 (Linux's default): with 1,
    one exporter on ``::`` and one on ``0.0.0.0`` or ``127.0.0.1`` at one port both bind, and the
    old src refused the second. Unknown (no such file: not Linux): overlapping, the safe side."""
    pytest.importorskip("prometheus_client")
    from resilient_callbacks.sinks import prometheus

    setting = tmp_path / "bindv6only"
    if bindv6only is not None:
        setting.write_text(bindv6only + "\n")
    monkeypatch.setattr(prometheus, "BINDV6ONLY", str(setting))
    prometheus._v6_takes_v4.cache_clear()
    try:
        takes_v4 = bindv6only != "1"
        for v4 in ("0.0.0.0", "127.0.0.1"):
            assert prometheus._overlap(("::", 9464, 1), (v4, 9464, 1)) is takes_v4, v4
            assert prometheus._overlap((v4, 9460, 8), ("::", 9467, 1)) is takes_v4, v4
        assert prometheus._overlap(("::", 9464, 1), ("::1", 9464, 1))  # IPv6: always
        assert not prometheus._overlap(("::", 9464, 1), ("127.0.0.1", 9465, 1))
        assert not prometheus._overlap(("0.0.0.0", 9464, 1), ("::1", 9464, 1))
    finally:
        prometheus._v6_takes_v4.cache_clear()  # (the host's, read again by the next one)
