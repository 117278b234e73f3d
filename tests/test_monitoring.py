"""Monitoring: the checkpoint metrics reach a real Prometheus exporter (scraped over HTTP on
127.0.0.1 during training), a node_exporter textfile (parsed by prometheus_client's parser), a
plain callable and MLflow; a sink that fails is warned about once and training goes on."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from resilient_callbacks import Checkpointer, ConfigError
from resilient_callbacks.metrics import METRICS, PREFIX
from torch_needs import needs_transformers

prom_parser = pytest.importorskip("prometheus_client.parser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exporter_port(ck: Checkpointer, timeout: float = 60.0) -> int:
    """The port the Prometheus exporter of ``ck`` (given port 0) listens on, once its thread
    started it: bound by the exporter itself, so no other process can take it in between (a
    free port picked beforehand could be)."""
    deadline = time.monotonic() + timeout
    while True:
        ports = [
            r.sink.port
            for r in ck.telemetry._runners
            if str(getattr(r.sink, "name", "")).startswith("prometheus exporter ")
        ]
        if ports:
            return int(ports[0])
        assert time.monotonic() < deadline, "the exporter did not start"
        time.sleep(0.02)


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``{family name: {labels: value}}`` of one real HTTP scrape."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in prom_parser.text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def scrape_openmetrics(port: int) -> list:
    """A scrape as Prometheus makes it by default (OpenMetrics first in its Accept header),
    parsed by prometheus_client's strict OpenMetrics parser."""
    from prometheus_client.openmetrics import parser

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics",
        headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert "openmetrics" in r.headers["Content-Type"]
        return list(parser.text_string_to_metric_families(r.read().decode()))


def wait_scrape(port: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _train(ck: Checkpointer, steps: range, state: dict, during=None) -> None:
    model, opt = state["model"], state["optimizer"]
    for step in steps:
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
        ck.step(step, state)
        if during is not None:
            during(step)


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_metric_names_follow_prometheus_conventions():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    # OpenMetrics names a counter's family without "_total": families must be unique too
    families = [m.name.removesuffix("_total") if m.kind == "counter" else m.name for m in METRICS]
    assert len(families) == len(set(families)), sorted(families)
    for m in METRICS:
        assert m.name.startswith(PREFIX)
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        if m.unit == "seconds":
            assert "_seconds" in m.name, m.name
        if m.unit == "bytes":
            assert "_bytes" in m.name, m.name


def test_prometheus_exporter_scraped_during_a_plain_loop(tmp_path: Path, monkeypatch):
    from resilient_callbacks import recorder

    # the derived values refreshed at every step() (else at most once a second: the test
    # slept past that interval before each scrape)
    monkeypatch.setattr(recorder, "REFRESH_S", 0.0)
    state = _state()
    scrapes: list[dict] = []

    def during(step: int) -> None:
        if step in (12, 30):  # mid-run, after saves were committed
            ck.flush()  # step 30's background save: counted once it commits
            ck.step(step, state)  # (already saved: a no-op that refreshes)
            scrapes.append(wait_scrape(port))
            assert scrape_openmetrics(port)  # valid: no two families of one name

    with Checkpointer(
        tmp_path / "ck", every_n_steps=5, keep_last=2, telemetry="prometheus:127.0.0.1:0"
    ) as ck:
        port = exporter_port(ck)
        ck.restore(state)
        _train(ck, range(1, 31), state, during)
    first, last = scrapes
    g = lambda s, name, labels=(): s[PREFIX + name][labels]  # noqa: E731
    assert g(last, "saves_total", (("reason", "periodic"),)) == 6
    assert g(first, "saves_total", (("reason", "periodic"),)) >= 1
    assert g(last, "last_saved_step") == 30.0
    assert 0 < g(last, "last_save_blocking_seconds") < 30
    assert g(last, "save_blocking_seconds_total") >= g(last, "last_save_blocking_seconds")
    size = sum(t.numel() * t.element_size() for t in state["model"].state_dict().values())
    assert size < g(last, "save_bytes") < size + 200_000  # tensors plus metadata
    assert g(last, "save_throughput_bytes_per_second") > 0
    assert g(last, "interval_steps") == 5
    assert 0.005 < g(last, "step_seconds") < 5
    assert g(last, "mtbf_seconds") >= 24 * 3600  # the prior, no failure yet
    assert g(last, "optimal_interval_seconds") > 0
    assert g(last, "step") == 30
    assert 0 < g(last, "goodput_ratio") <= 1
    assert g(last, "useful_seconds") <= g(last, "wall_seconds_total")
    assert g(last, "useful_seconds") > g(first, "useful_seconds")
    # the exporter stops with the Checkpointer: nothing listens on the port any more
    with pytest.raises(OSError):
        scrape(port)


def test_textfile_for_node_exporter_parsed_by_prometheus_client(tmp_path: Path):
    path = tmp_path / "textfile" / "ckpt.prom"
    state = _state()
    with Checkpointer(
        tmp_path / "ck", every_n_steps=4, async_save=False, telemetry=f"textfile:{path}"
    ) as ck:
        ck.restore(state)
        _train(ck, range(1, 9), state)
    fams = {f.name: f for f in prom_parser.text_string_to_metric_families(path.read_text())}
    saves = fams[PREFIX + "saves"]  # the parser names counter families without _total
    assert saves.type == "counter"
    assert {(s.name, s.labels["reason"], s.value) for s in saves.samples} == {
        (PREFIX + "saves_total", "periodic", 2.0)
    }
    assert fams[PREFIX + "last_saved_step"].samples[0].value == 8
    assert fams[PREFIX + "save_bytes"].type == "gauge"
    assert not list(path.parent.glob("*.tmp*"))  # written atomically


def test_a_loop_that_only_saves_exports_its_step_and_no_made_up_goodput(tmp_path: Path):
    """A loop that calls ckpt.save(step=...) itself and never step(): the textfile said
    step 0 and goodput_ratio 0 (useful_seconds 0: no step was timed), a dashboard's alert on a
    stuck run, or a goodput of nothing, while the report says "unknown". Now the step is the
    one last saved, and useful_seconds and goodput_ratio are left out (unknown) until a
    step() measures training compute."""
    path = tmp_path / "textfile" / "ckpt.prom"
    state = _state()
    with Checkpointer(tmp_path / "ck", async_save=False, telemetry=f"textfile:{path}") as ck:
        ck.restore(state)
        for step in (100, 200, 300):
            ck.save(step, state)
    fams = {f.name: f for f in prom_parser.text_string_to_metric_families(path.read_text())}
    assert fams[PREFIX + "step"].samples[0].value == 300
    assert fams[PREFIX + "last_saved_step"].samples[0].value == 300
    assert PREFIX + "goodput_ratio" not in fams and PREFIX + "useful_seconds" not in fams
    assert fams[PREFIX + "wall_seconds"].samples[0].value > 0  # (the run's clock is known)
    ended = [json.loads(x) for x in (tmp_path / "ck" / "history.jsonl").read_text().splitlines()]
    assert ended[-1]["event"] == "end" and ended[-1]["step"] == 300, ended[-1]


def test_callable_hook_and_metrics_without_a_sink(tmp_path: Path):
    got: list[dict] = []
    state = _state()
    with Checkpointer(tmp_path / "a", every_n_steps=3, telemetry=got.append) as ck:
        ck.restore(state)
        _train(ck, range(1, 7), state)
    assert got, "the hook was never called"
    assert got[-1][PREFIX + "saves_total"] == 2  # the last call is at close: every save in
    assert got[-1][PREFIX + "saves_total/periodic"] == 2
    with Checkpointer(tmp_path / "b", every_n_steps=3) as ck:  # no sink: ck.metrics() still
        ck.restore(state)
        _train(ck, range(1, 7), state)
        ck.flush()
        m = ck.metrics()
    assert m[PREFIX + "saves_total"] == 2 and m[PREFIX + "last_saved_step"] == 6


def test_bad_specs_are_config_errors(tmp_path: Path):
    for bad in (
        "prometheus:http",
        "statsd:1234",
        "textfile:/tmp/x.txt",
        42,
        {"kind": "mlflow", "x": 1},
    ):
        with pytest.raises(ConfigError):
            Checkpointer(tmp_path, telemetry=bad)


def test_failing_sinks_warn_once_and_training_goes_on(tmp_path: Path, caplog):
    caplog.set_level(logging.WARNING, logger="resilient_callbacks")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    calls = []

    def broken(values: dict) -> None:
        calls.append(1)
        raise RuntimeError("dashboard down")

    state = _state()
    try:
        t0 = time.perf_counter()
        with Checkpointer(
            tmp_path / "ck",
            every_n_steps=2,
            telemetry=[f"prometheus:127.0.0.1:{port}", broken],
        ) as ck:
            ck.restore(state)
            _train(ck, range(1, 21), state)
        elapsed = time.perf_counter() - t0
    finally:
        busy.close()
    assert [e.step for e in ck.checkpoints()][-1] == 20  # the run completed and saved
    msgs = [r.getMessage() for r in caplog.records if "metrics sink" in r.getMessage()]
    for sink in ("prometheus exporter", "broken"):  # said when it failed, and at close
        said = [m for m in msgs if f"metrics sink {sink} " in m]
        assert len(said) == 2, msgs
        assert "failed (training goes on)" in said[0] and "retrying" in said[0]
        assert "failed at close" in said[1] and "not sent" in said[1]
    assert len(calls) >= 2  # retried (tests/test_sink_retry.py), and tried once more at close
    assert elapsed < 60


def test_a_hanging_sink_does_not_block_training(tmp_path: Path):
    release = threading.Event()
    returned = threading.Event()

    def hang(values: dict) -> None:
        release.wait(300)
        returned.set()

    state = _state()
    with Checkpointer(tmp_path / "ck", every_n_steps=2, telemetry=hang) as ck:
        ck.restore(state)
        _train(ck, range(1, 11), state)
        ck.flush()
        # ten steps and their saves done while the sink was still stuck (no clock involved:
        # had training waited for the sink, the sink would have returned first)
        assert not returned.is_set()
        assert [e.step for e in ck.checkpoints()][-1] == 10
        release.set()


def test_pushgateway_receives_the_metrics_over_http(tmp_path: Path):
    """A batch job's metrics are PUT to a Pushgateway URL (here an HTTP server on 127.0.0.1
    that keeps what it is sent, as the Pushgateway's API receives it) under the job and this
    host; the body parses with prometheus_client's parser."""
    import http.server

    received: list[tuple[str, str, bytes]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def _keep(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            received.append((self.command, self.path, body))
            self.send_response(200)
            self.end_headers()

        do_PUT = do_POST = _keep

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        state = _state()
        with Checkpointer(
            tmp_path / "ck", every_n_steps=3, async_save=False, telemetry=f"pushgateway:{url}"
        ) as ck:
            ck.restore(state)
            _train(ck, range(1, 7), state)
    finally:
        server.shutdown()
    assert received, "nothing was pushed"
    method, path, body = received[-1]  # the push at close holds every save
    assert method == "PUT" and path.startswith("/metrics/job/resilient_ckpt/instance/")
    fams = {f.name: f for f in prom_parser.text_string_to_metric_families(body.decode())}
    assert sum(s.value for s in fams[PREFIX + "saves"].samples) == 2
    assert fams[PREFIX + "last_saved_step"].samples[0].value == 6


@needs_transformers
def test_transformers_logger_telemetry_reaches_the_trainers_log(tmp_path: Path):
    """``telemetry="logger"`` on the Trainer callback: after each save every checkpoint metric
    goes through ``Trainer.log`` (so to every ``report_to`` integration) and into the log
    history. (In the default suite: the one test of the Transformers path of "logger".)"""
    import hf_train
    from resilient_callbacks.transformers import ResilientCheckpoint

    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2, telemetry="logger")
    trainer = hf_train.build_trainer(
        str(tmp_path / "out"), max_steps=4, callbacks=[rc], eval_strategy="no",
        metric_for_best_model=None, gradient_accumulation_steps=1,  # 4 batches, not 12
    )  # fmt: skip
    trainer.train()
    sent = [e["step"] for e in trainer.state.log_history if PREFIX + "step" in e]
    assert sent == [2, 4, 4]  # after the saves of steps 2 and 4, and at the end of training
    logged = [e for e in trainer.state.log_history if PREFIX + "saves_total" in e]
    # after each save, the metrics as they are then (a background save is counted once it
    # committed), and once more at the end of training, with every save in
    assert [e[PREFIX + "saves_total"] for e in logged][-1] == 2
    assert logged[-1][PREFIX + "last_saved_step"] == 4
    assert all(e[PREFIX + "save_bytes"] > 0 for e in logged)


def test_counters_exist_at_zero_before_their_first_event(tmp_path: Path):
    """An alert on increase(resilient_ckpt_save_failures_total[...]) sees the first failure:
    the series exists, at 0, from the start."""
    with Checkpointer(tmp_path) as ck:
        m = ck.metrics()
    for name in ("save_failures_total", "preemptions_total", "saves_skipped_total"):
        assert m[PREFIX + name] == 0, name


def test_restore_fallbacks_reach_the_history(tmp_path: Path):
    """A fallback happens before the restore tells the run's id: it is recorded right after
    the restart it belongs to (it used to be dropped)."""
    from resilient_callbacks import history

    state = _state()
    with Checkpointer(tmp_path, every_n_steps=1) as ck:
        _train(ck, range(1, 3), state)
    shard = next((tmp_path / "step_000000002").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="skipping"), Checkpointer(tmp_path) as ck:
        assert ck.restore(_state()) == 1
    events = [r["event"] for r in history.records(str(tmp_path))]
    assert events[events.index("restart") + 1] == "fallback", events


def test_upload_backlog_after_a_restart_counts_the_earlier_processes_checkpoints(
    tmp_path: Path, monkeypatch
):
    from resilient_callbacks import sync

    state = _state()
    with Checkpointer(tmp_path / "ck", every_n_steps=1, keep_last=5) as ck:  # no remote yet
        _train(ck, range(1, 4), state)
    monkeypatch.setattr(
        sync.RemoteSync, "_attempt", lambda self, name: self._failed(name, OSError("down"))
    )
    ck = Checkpointer(tmp_path / "ck", remote=f"file://{tmp_path}/remote", remote_timeout=1)
    try:
        assert ck.restore(_state()) == 3
        m = ck.metrics()
        assert m[PREFIX + "upload_backlog_checkpoints"] == 3
        assert m[PREFIX + "upload_backlog_bytes"] > 3 * 32 * 32 * 4
        assert m[PREFIX + "upload_lag_seconds"] > 0
    finally:
        ck.close(timeout=1)


def test_wall_time_counts_from_the_runs_start_after_a_restore_on_a_new_machine(tmp_path: Path):
    """The local directory (and its history) is lost; the run resumes from the remote tier:
    its wall time still counts from the run's first start, recorded in the checkpoint."""
    import shutil

    state, remote = _state(), f"file://{tmp_path}/remote"
    with Checkpointer(tmp_path / "ck", every_n_steps=4, remote=remote) as ck:
        assert ck.restore(state) == 0  # the run starts here
        for step in range(1, 9):
            time.sleep(0.05)  # 0.4 s of "training": useful time
            ck.step(step, state)
    shutil.rmtree(tmp_path / "ck")
    with Checkpointer(tmp_path / "ck", remote=remote) as ck:
        assert ck.restore(_state()) == 8
        m = ck.metrics()
    assert m[PREFIX + "useful_seconds"] >= 0.3  # 7 of the 8 sleeps: between step()s
    # before this process saves anything: the newest checkpoint is the one restored
    assert m[PREFIX + "last_saved_step"] == 8 and m[PREFIX + "step"] == 8
    assert 0 < time.time() - m[PREFIX + "last_save_timestamp_seconds"] < 600
    assert m[PREFIX + "wall_seconds_total"] >= m[PREFIX + "useful_seconds"]
    assert m[PREFIX + "restarts_total"] == 1


def test_a_restart_after_a_clean_close_is_no_failure(tmp_path: Path):
    """A run closed cleanly (finished, or a preemption saved before exiting) and resumed:
    restarts_total stays 0 and the MTBF stays the prior (the restart counted as a failure and
    halved it); a process that ended without an ``end`` record (killed) still counts."""
    from resilient_callbacks import history

    state = {"w": torch.zeros(4)}
    with Checkpointer(tmp_path / "ck", every_n_steps=2) as ck:
        for step in range(1, 5):
            ck.step(step, state)
    with Checkpointer(tmp_path / "ck", every_n_steps=2) as ck:
        assert ck.restore(state) == 4
        m = ck.metrics()
    assert m[PREFIX + "restarts_total"] == 0
    assert m[PREFIX + "mtbf_seconds"] >= 24 * 3600  # the prior (and the run's time): no failure

    def ev(kind: str, t: float) -> history.Event:
        return history.Event(kind, t, 0, "r", 1)

    killed = [ev("start", 0), ev("end", 1), ev("restart", 2), ev("restart", 3), ev("end", 4)]
    assert history.failures([*killed, ev("restart", 5)], "r") == (0, [3])
    assert history.failures([ev("restart", 7), ev("failed", 8), ev("restart", 9)], "r") == (
        7,
        [7, 9],
    )
    # a clock stepped back: out of order, before the start, in the future -> clamped in order
    now = time.time()
    back = [ev("start", 100), ev("restart", 50), ev("restart", 120), ev("restart", now + 9e3)]
    start, restarts = history.failures(back, "r")
    assert start == 100 and restarts[:2] == [100, 120] and 120 <= restarts[2] <= time.time()


def test_downtime_is_the_time_between_a_lifes_last_record_and_the_next_restart(tmp_path):
    """history.downtime: what the learned MTBF leaves out of the exposure."""
    from resilient_callbacks import history

    def rec(event: str, t: float, run: str = "r") -> str:
        return json.dumps({"event": event, "time": t, "step": 0, "run_id": run}) + "\n"

    lines = [
        rec("restart", 0, "other"),  # another run before this one: not its downtime
        rec("end", 5, "other"),
        rec("restart", 10),  # the lineage's history begins with a restart (remote tier)
        rec("progress", 20),
        rec("save", 30),
        '{"event": "progress", "ti\n',  # a torn line: the record before it counts
        rec("restart", 100),  # 70 s down
        rec("end", 150),
        rec("restart", 1150),  # 1000 s down
        rec("progress", 1160),
    ]
    (tmp_path / "history.jsonl").write_text("".join(lines))
    assert history.downtime(str(tmp_path), "r") == 1070
    assert history.downtime(str(tmp_path), "r", until=1200) == 1110  # a restart now
    assert history.lineage(str(tmp_path), "r") == (10, [10, 100], 1070)
    assert history.downtime(str(tmp_path / "none"), "r") == 0


def test_a_wall_clock_stepped_back_does_not_stop_an_adaptive_resume(tmp_path, monkeypatch):
    """adaptive=True, the clock 2 h behind the run's recorded start (a node with a wrong clock,
    NTP stepping back): restore() raised ConfigError ("restart time ... is before run_start")
    after loading the state, and at every later start too (the bad record stayed)."""
    state = {"w": torch.zeros(4)}
    with Checkpointer(tmp_path / "ck", every_n_steps=2, adaptive=True, mtbf_hours=1) as ck:
        for step in range(1, 5):
            ck.step(step, state)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 7200)
    for _ in range(2):  # behind, twice (the second run reads the first one's records)
        with Checkpointer(tmp_path / "ck", every_n_steps=2, adaptive=True, mtbf_hours=1) as ck:
            assert ck.restore(state) == 4
    monkeypatch.setattr(time, "time", real)
    with Checkpointer(tmp_path / "ck", every_n_steps=2, adaptive=True, mtbf_hours=1) as ck:
        assert ck.restore(state) == 4


def test_sink_options_are_checked_when_the_checkpointer_is_built(tmp_path: Path):
    for spec, needle in (
        ({"kind": "prometheus", "port": 9464.9}, "port"),
        ({"kind": "pushgateway", "url": "http://127.0.0.1:1", "timeout": "soon"}, "timeout"),
        ({"kind": "mlflow", "experiment": 5}, "experiment"),
    ):
        with pytest.raises(ConfigError, match=needle):
            Checkpointer(tmp_path / "a", telemetry=spec)
    with Checkpointer(tmp_path / "b", telemetry="prometheus:[::1]:0") as ck:
        assert ck.telemetry_kinds == {"prometheus"}
    with (
        pytest.warns(UserWarning, match="telemetry='logger' sends the metrics through") as got,
        Checkpointer(tmp_path / "c", every_n_steps=1, telemetry="logger") as ck,
    ):
        ck.step(1, _state())
    assert got[0].filename == __file__  # the line that called step(), not the interpreter's


@needs_transformers
def test_transformers_final_checkpoint_logs_reach_the_trainers_mlflow_run(
    tmp_path: Path, monkeypatch, one_thread, mlflow_sqlite: str
):
    """``report_to="mlflow"``: MLflow's callback ends its run in ``on_train_end``; the last
    committed checkpoint's figures are logged before that, into the Trainer's run (logged
    after it, they started a second, stray run)."""
    mlflow = pytest.importorskip("mlflow")
    import hf_train
    from resilient_callbacks.transformers import ResilientCheckpoint

    monkeypatch.chdir(tmp_path)  # a sqlite store puts its artifacts under ./mlruns
    uri = mlflow_sqlite  # (the store's schema made before the Trainer's first call)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)
    trainer = hf_train.build_trainer(
        str(tmp_path / "out"), max_steps=4, callbacks=[rc], eval_strategy="no",
        metric_for_best_model=None, report_to="mlflow",
    )  # fmt: skip
    trainer.train()
    exp = client.get_experiment_by_name("hf")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [(r.info.run_name, sorted(r.data.metrics)) for r in runs]
    history = client.get_metric_history(runs[0].info.run_id, "resilient/last_committed_step")
    assert max(m.value for m in history) == 4


def test_the_runs_counters_are_not_shown_as_0_before_restore(tmp_path: Path):
    """``restarts_total`` and ``wall_seconds_total`` count over the run's lives: a new process
    knows them after restore(). Shown as 0 before it, a scrape saw a counter reset at every
    restart (Prometheus' increase() counting 1 + 2 + ... + N restarts; a monitoring probe)."""
    state = _state()
    with Checkpointer(tmp_path / "ck", every_n_steps=2) as ck:
        assert ck.restore(state) == 0
        time.sleep(0.2)
        for step in range(1, 5):
            ck.step(step, state)
    with Checkpointer(tmp_path / "ck") as ck:
        before = ck.metrics()
        assert PREFIX + "restarts_total" not in before
        assert PREFIX + "wall_seconds_total" not in before
        assert before[PREFIX + "preemptions_total"] == 0  # this process's counters: at 0
        assert ck.restore(_state()) == 4
        after = ck.metrics()
    assert after[PREFIX + "restarts_total"] == 0  # a clean close: no failure
    assert after[PREFIX + "wall_seconds_total"] >= 0.2


def test_a_run_that_never_calls_restore_is_timed_from_its_construction(tmp_path: Path):
    """resume="never" and no restore(): the run's clock started at the first save, so the
    steps before it were useful time outside the wall time (goodput clamped to 1). It starts
    when the Checkpointer is made; the history's start record says so too."""
    import json

    state = _state()
    made = time.time()
    with Checkpointer(tmp_path / "ck", every_n_steps=10, resume="never") as ck:
        built = time.time()  # (construction alone took 0.4 s on a loaded machine)
        for step in range(1, 11):
            time.sleep(0.05)
            ck.step(step, state)
        m = ck.metrics()
    assert m[PREFIX + "useful_seconds"] >= 0.4
    assert m[PREFIX + "wall_seconds_total"] >= m[PREFIX + "useful_seconds"] - 0.05
    lines = (tmp_path / "ck" / "history.jsonl").read_text().splitlines()
    (start,) = [r for r in map(json.loads, lines) if r["event"] == "start"]
    assert made <= start["time"] <= built, (made, built, start)


def test_a_prometheus_exporter_on_port_0_says_which_port_it_took(tmp_path: Path, caplog):
    """``prometheus:ADDR:0`` listens on a free port: the log names it (it was nowhere), and a
    scrape there answers."""
    import re

    caplog.set_level(logging.INFO, logger="resilient_callbacks")
    with Checkpointer(tmp_path / "ck", telemetry="prometheus:127.0.0.1:0") as ck:
        ck.restore(_state())
        deadline = time.monotonic() + 60  # the sink starts on its own thread
        while True:
            said = [r.getMessage() for r in caplog.records if "/metrics" in r.getMessage()]
            if said or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert said, [r.getMessage() for r in caplog.records]
        url = re.search(r"http://\S+/metrics", said[0]).group(0)
        assert not url.endswith(":0/metrics")
        body = urllib.request.urlopen(url, timeout=30).read().decode()
    assert PREFIX + "preemptions_total 0.0" in body


def test_a_framework_logger_that_raises_is_retried_and_training_goes_on(tmp_path: Path, caplog):
    """``telemetry="logger"``: a logger that raises on the checkpoint metrics (a tracking
    backend down, a key it refuses) is warned about and retried with back-off, as every sink
    is; it used to raise out of the Lightning callback and stop ``fit()``."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from resilient_callbacks.lightning import ResilientCheckpoint

    calls: list[int] = []

    class Flaky(CSVLogger):
        def log_metrics(self, metrics, step=None):  # type: ignore[no-untyped-def]
            if any(k.startswith(PREFIX) for k in metrics):
                calls.append(step)
                raise ConnectionError("tracking backend down")
            super().log_metrics(metrics, step)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):  # type: ignore[no-untyped-def]
            x, y = batch
            return ((self.lin(x) - y) ** 2).mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(40, 4), torch.randn(40, 1)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=10, logger=Flaky(str(tmp_path / "logs")), enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ResilientCheckpoint(tmp_path / "ck", every_n_steps=4, telemetry="logger")],
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
        trainer.fit(Model(), data)
    assert trainer.global_step == 10
    # the saves at steps 4 and 8 (within the back-off: skipped, never waited for), and the end
    assert 2 <= len(calls) <= 3
    said = [
        r.getMessage() for r in caplog.records if "metrics sink logger failed" in r.getMessage()
    ]
    assert len(said) == 2, said  # when it failed, and at the end (its last values not sent)
    assert "training goes on" in said[0] and "failed at close" in said[1]


def test_a_hanging_sink_does_not_hold_a_preempted_process_past_its_grace_period(
    tmp_path: Path, caplog
):
    """At a preemption the process exits (code 75) within the grace period: the checkpoint and
    the history are durable by then, the metrics sinks get what is left of it. A sink that
    hangs (an MLflow server that accepts the connection and never answers, logging the final
    checkpoint: 600 s) held the exit for its own close timeout, far past a grace period of
    seconds, so the scheduler's SIGKILL came before the exit code."""
    import os
    import signal

    release = threading.Event()
    timer = threading.Timer(30.0, release.set)  # the old src waits for it (no hang forever)
    timer.start()

    class Hanging:
        name = "hanging"
        per_rank = False
        close_timeout_s = 600.0  # as the MLflow sink's when it logs a checkpoint

        def start(self, telemetry) -> None:  # type: ignore[no-untyped-def]
            pass

        def emit(self, flat, samples, events, step) -> None:  # type: ignore[no-untyped-def]
            release.wait()

        def close(self) -> None:
            release.wait()

    state = _state()
    ck = Checkpointer(tmp_path / "ck", every_n_steps=5, grace_period=2, telemetry=Hanging())
    try:
        with (
            caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
            pytest.raises(SystemExit) as exit_,
        ):
            ck.restore(state)
            for step in range(1, 20):
                if step == 7:
                    os.kill(os.getpid(), signal.SIGTERM)
                ck.step(step, state)
        assert exit_.value.code == 75
        said = [
            r.getMessage() for r in caplog.records if "did not finish sending" in r.getMessage()
        ]
        assert len(said) == 1 and "within 600 s" not in said[0], said
    finally:
        timer.cancel()
        release.set()
