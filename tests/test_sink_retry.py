"""A metrics sink that fails is retried with back-off, not switched off at its first failure (a
weeks-long run lost all its monitoring to one MLflow server restart or Pushgateway blip); one
that keeps failing is switched off, said once; at close the sinks finish concurrently, so
several slow ones do not add up past a preemption's grace period."""

from __future__ import annotations

import http.server
import logging
import threading
import time
from pathlib import Path

import pytest

from resilient_callbacks import Checkpointer, sink_retry, telemetry
from resilient_callbacks.metrics import PREFIX
from resilient_callbacks.telemetry import Telemetry
from test_monitoring import _state, _train

prom_parser = pytest.importorskip("prometheus_client.parser")


@pytest.fixture
def fast_retry(monkeypatch):
    """Retries without waiting (the back-off's length is not what these tests check)."""
    monkeypatch.setattr(
        sink_retry, "DEFAULT_POLICY", sink_retry.RetryPolicy(first_s=0.0, max_s=0.0)
    )


def _said(caplog, part: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if part in r.getMessage()]


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_pushgateway_blip_loses_only_the_push_it_hit(tmp_path: Path, caplog):
    """The gateway (an HTTP server on 127.0.0.1 taking PUTs as the Pushgateway's API does)
    answers 503 to the first push, then recovers: the push at close reaches it with every save,
    and the log says the sink failed and that it is back. The old src switched the sink off at
    the first failure, so the gateway never got a value again."""
    received: list[bytes] = []
    answers = iter([503])

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            code = next(answers, 200)
            if code == 200:
                received.append(body)
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    ).start()  # (shutdown() waits for a poll: 0.5 s by default)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    state = _state()
    try:
        with (
            caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
            Checkpointer(
                tmp_path / "ck", every_n_steps=3, async_save=False, telemetry=f"pushgateway:{url}"
            ) as ck,
        ):
            ck.restore(state)
            _train(ck, range(1, 7), state)
    finally:
        server.shutdown()
    assert received, "nothing reached the gateway after its blip"
    fams = {f.name: f for f in prom_parser.text_string_to_metric_families(received[-1].decode())}
    assert sum(s.value for s in fams[PREFIX + "saves"].samples) == 2
    failed = _said(caplog, "failed (training goes on)")
    assert len(failed) == 1 and "retrying" in failed[0], failed
    assert len(_said(caplog, "is back after 1 failed attempt")) == 1
    assert not _said(caplog, "switched off for the rest")


def test_a_sink_is_retried_during_the_run_and_said_back(fast_retry, caplog):
    """Two failures, then the sink answers again: it gets the values after its outage (the
    old src never called it again), with one warning at the outage and one when it is back."""
    calls: list[dict] = []
    lock = threading.Lock()

    def flaky(values: dict) -> None:
        with lock:
            calls.append(values)
            if len(calls) <= 2:
                raise ConnectionError("tracking server restarting")

    with caplog.at_level(logging.DEBUG, logger="resilient_callbacks"):
        t = Telemetry([metrics_callable(flaky)], period_s=0.0)
        try:
            _wait_for(lambda: len(calls) >= 3, "the sink to be tried again")
            t.set(PREFIX + "step", 7)
            t.notify()
            _wait_for(lambda: calls[-1].get(PREFIX + "step") == 7, "the values after the outage")
        finally:
            t.close()
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    msgs = [r.getMessage() for r in warned]
    assert len([m for m in msgs if "failed (training goes on)" in m]) == 1, msgs
    assert len([m for m in msgs if "is back after 2 failed attempt(s)" in m]) == 1, msgs
    assert not [m for m in msgs if "switched off for the rest" in m], msgs


def test_a_sink_that_keeps_failing_is_switched_off_said_once(monkeypatch, caplog):
    monkeypatch.setattr(
        sink_retry,
        "DEFAULT_POLICY",
        sink_retry.RetryPolicy(first_s=0.0, max_s=0.0, give_up_s=0.0),
    )
    calls: list[int] = []

    def down(values: dict) -> None:
        calls.append(1)
        raise RuntimeError("dashboard down")

    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
        t = Telemetry([metrics_callable(down)], period_s=0.0)
        try:
            _wait_for(lambda: _said(caplog, "switched off for the rest"), "the sink switched off")
            t.notify()
        finally:
            t.close()
    assert len(calls) == 2  # the first failure, one retry; none after, none at close
    (off,) = _said(caplog, "switched off for the rest")
    assert "kept failing" in off and "2 attempts" in off and "dashboard down" in off
    assert len(_said(caplog, "failed (training goes on)")) == 1


def test_a_framework_logger_that_fails_once_is_tried_again(fast_retry, caplog):
    """``telemetry="logger"`` (a W&B or MLflow logger raising once on a network blip): the next
    save's metrics go through again; the old src switched it off for the rest of the run."""
    from resilient_callbacks import sinks

    class Ck:
        telemetry_kinds = frozenset({"logger"})

        def metrics(self) -> dict:
            return {PREFIX + "saves_total": 1.0}

    sent: list[dict] = []

    def send(values: dict) -> None:
        sent.append(values)
        if len(sent) == 1:
            raise OSError("logger backend unreachable")

    ck = Ck()
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
        sinks.to_framework(ck, send)
        sinks.to_framework(ck, send)
        assert len(sent) == 2  # the next save's metrics went through
        sinks.to_framework(ck, send, final=True)
    assert len(sent) == 3
    assert len(_said(caplog, "metrics sink logger failed")) == 1
    assert len(_said(caplog, "metrics sink logger is back")) == 1


def test_sinks_close_concurrently_so_their_waits_do_not_add_up(monkeypatch, caplog):
    """Three sinks that hang at close, 10 s allowed each: close() waits 10 s in all, not 30 s
    (a preempted process whose grace period is unknown, or the model's and the EMA's
    Checkpointers at exit, lost the sum), and names each one that did not finish. Time is a
    fake clock advanced by each join's wait, so this checks the waits, not the machine."""
    release = threading.Event()
    entered = threading.Semaphore(0)

    class Hanging:
        per_rank = False
        close_timeout_s = 10.0

        def __init__(self, name: str) -> None:
            self.name = name

        def start(self, telemetry) -> None:  # type: ignore[no-untyped-def]
            pass

        def emit(self, flat, samples, events, step) -> None:  # type: ignore[no-untyped-def]
            entered.release()
            release.wait()

        def close(self) -> None:
            pass

    t = Telemetry([Hanging("a"), Hanging("b"), Hanging("c")], period_s=0.0)
    for _ in range(3):
        assert entered.acquire(timeout=60)  # every sink is inside its send
    clock = [1000.0]

    class FakeTime:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

    waits: list[float] = []

    def join(self, timeout=None):  # type: ignore[no-untyped-def]
        waits.append(timeout)
        clock[0] += timeout  # the sink hangs: the whole wait passes

    monkeypatch.setattr(telemetry, "time", FakeTime)
    monkeypatch.setattr(telemetry._Runner, "join", join)
    try:
        with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
            t.close()
    finally:
        monkeypatch.undo()
        release.set()
    assert sum(waits) == pytest.approx(10.0), waits
    (said,) = _said(caplog, "did not finish sending")
    assert all(n in said for n in ("a (within 10 s)", "b (within 10 s)", "c (within 10 s)"))


def metrics_callable(fn):  # type: ignore[no-untyped-def]
    from resilient_callbacks.sinks import CallableSink

    return CallableSink(fn)


def test_mlflow_event_tags_sent_after_a_failed_batch_keep_their_names(
    tmp_path: Path, mlflow_sqlite: str
):
    """An MLflow ``log_batch`` that fails (the tracking server restarting) is sent again at the
    next try with the same tag names: the old src named each event again on the retry, so the
    save of step 5 became ``resilient_ckpt.save.step_5.2`` (as if it had happened twice) and
    ``...step_5`` was never written. A real sqlite store; the failure is the first call's."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from resilient_callbacks.sinks.mlflow import MLflowSink

    uri = mlflow_sqlite
    context = {"run_id": "run-a", "dirpath": str(tmp_path / "ck")}
    sink = MLflowSink(context=context, tracking_uri=uri, experiment="blip")
    t = Telemetry()
    sink.start(t)
    real = sink._client.log_batch
    fails = iter([ConnectionError("tracking server restarting")])

    def log_batch(*args, **kwargs):  # type: ignore[no-untyped-def]
        err = next(fails, None)
        if err is not None:
            raise err
        return real(*args, **kwargs)

    sink._client.log_batch = log_batch
    save = {"event": "save", "step": 5, "bytes": 10}
    with pytest.raises(ConnectionError):
        sink.emit({PREFIX + "step": 5.0}, [], [save], 5)
    sink.emit({PREFIX + "step": 6.0}, [], [], 6)  # the retry: nothing new since
    tags = sink._client.get_run(sink.run_id).data.tags
    assert "resilient_ckpt.save.step_5" in tags
    assert not [k for k in tags if k.startswith("resilient_ckpt.save.step_5.")], tags


def test_a_second_checkpointer_closed_after_a_preemption_keeps_to_the_grace_period(
    tmp_path: Path, caplog
):
    """The model's and the EMA's Checkpointers in one process: at a SIGTERM the model's saves
    and exits (code 75) within the grace period; the EMA's is closed after it (its ``with``
    block, or at exit) with no timeout, and the old src gave its sinks their normal limits (600
    s for an MLflow sink logging a checkpoint), so the process outlived the grace period and
    the scheduler's SIGKILL came before the exit code. Its close now keeps to what is left."""
    import os
    import signal

    import torch

    release = threading.Event()
    timer = threading.Timer(30.0, release.set)  # the old src waits for it (no hang forever)
    timer.start()

    class Hanging:
        name = "ema-sink"
        per_rank = False
        close_timeout_s = 600.0  # as the MLflow sink's when it logs a checkpoint

        def start(self, telemetry) -> None:  # type: ignore[no-untyped-def]
            pass

        def emit(self, flat, samples, events, step) -> None:  # type: ignore[no-untyped-def]
            if step >= 7:
                release.wait()

        def close(self) -> None:
            release.wait()

    model, ema = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    a = Checkpointer(tmp_path / "model", every_n_steps=5, grace_period=2)
    b = Checkpointer(tmp_path / "ema", every_n_steps=5, grace_period=2, telemetry=Hanging())
    try:
        with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
            a.restore({"m": model})
            b.restore({"m": ema})
            with pytest.raises(SystemExit) as exit_:
                for step in range(1, 20):
                    if step == 7:
                        os.kill(os.getpid(), signal.SIGTERM)
                    a.step(step, {"m": model})  # acts on it: saves, exits
                    b.step(step, {"m": ema})
            assert exit_.value.code == 75
            assert [e.step for e in a.checkpoints()][-1] == 7
            b.close()  # as its `with` block or the exit hook does
        said = _said(caplog, "did not finish sending")
        assert len(said) == 1 and "ema-sink" in said[0] and "within 600 s" not in said[0], said
    finally:
        timer.cancel()
        release.set()
        a.close()
        b.close()


def test_a_store_mlflow_refuses_is_switched_off_at_once_not_retried(
    tmp_path: Path, monkeypatch, caplog
):
    """MLflow 3 refuses a plain file store (``mlflow:file:...``): a mistake in the setup, not
    an outage, so no retry mends it: switched off at its first failure, said once, with
    MLflow's reason (not retried for an hour, nor once more at close)."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    state = _state()
    with (
        caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
        Checkpointer(
            tmp_path / "ck", every_n_steps=2, telemetry=f"mlflow:file:{tmp_path / 'mlruns'}"
        ) as ck,
    ):
        ck.restore(state)
        _train(ck, range(1, 5), state)
    (said,) = _said(caplog, "metrics sink mlflow")
    assert "switched off for the rest of this run" in said
    assert "MLflow refuses the tracking store" in said and "retrying" not in said


def test_a_flapping_sink_is_warned_about_once_then_logged_at_info(caplog):
    """A sink that fails, recovers and fails again within ``quiet_s`` of the last warning: the
    later outages (and recoveries) go to INFO, so a flapping gateway does not fill the log
    of a weeks-long run with warnings."""
    h = sink_retry.SinkHealth("gateway", sink_retry.RetryPolicy(first_s=0.0, quiet_s=3600.0))
    with caplog.at_level(logging.INFO, logger="resilient_callbacks"):
        for _ in range(3):
            h.failed(ConnectionError("blip"))
            assert h.due() and not h.off
            h.ok()
    levels = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records]
    assert [lv for lv, _ in levels] == [logging.WARNING] * 2 + [logging.INFO] * 4, levels
