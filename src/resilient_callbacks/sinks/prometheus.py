"""Prometheus sinks (extra ``prometheus``: ``prometheus_client``): an HTTP exporter to scrape, a
textfile for node_exporter's textfile collector, and a Pushgateway for batch jobs.

Each has its own registry holding one collector that reads the metrics' current values when it
is collected (a scrape, a textfile write, a push), so nothing is kept twice. With ``per_rank``
every rank runs the sink and every sample gets a ``rank`` label; the exporter of rank ``r``
listens on ``port + local rank`` (``LOCAL_RANK``, else the rank), the textfile of rank ``r`` is
``name.rank<r>.prom``.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ..metrics import Metric
from ..redact import url_text
from ..telemetry import Telemetry
from . import missing_extra

log = logging.getLogger("resilient_callbacks")

try:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as e:  # pragma: no cover - exercised only without the extra installed
    raise missing_extra("prometheus", "prometheus_client") from e


# the ports this process's exporters hold: (addr, first port, how many); a per_rank exporter
# holds its node's range (port + each local rank), each rank serving one of them
_SERVING: set[tuple[str, int, int]] = set()
# held from an exporter's check of _SERVING until its server listens (or failed to) and is in
# it, and while a closed one leaves it: each sink starts in its own thread, so two
# Checkpointers' exporters given one port both found it free, and the second to bind failed
# with "address in use" (retried, as a busy port of another process is) or bound first
_SERVING_LOCK = threading.Lock()
_WRITING: dict[str, Any] = {}  # file -> the textfile sink of this process writing it
# (url, job, grouping key) -> the Pushgateway sink of this process pushing that group
_PUSHING: dict[tuple[str, str, tuple[tuple[str, str], ...]], Any] = {}
_CLAIMING = threading.Lock()  # a claim's check and its entry in _WRITING/_PUSHING: one step


class _Collector:
    """Yields the current value of every metric of one Telemetry (a prometheus_client
    custom collector)."""

    def __init__(self, sink: _PrometheusBase) -> None:
        self._sink = sink

    def collect(self) -> Iterator[Any]:
        t = self._sink.telemetry
        if t is None:
            return
        extra = ("rank",) if self._sink.per_rank else ()
        extra_v = (str(t.rank),) if self._sink.per_rank else ()
        families: dict[str, Any] = {}
        for m, labels, value in t.samples():
            fam = families.get(m.name)
            if fam is None:
                cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                fam = cls(m.name, f"{m.help} ({m.unit})", labels=[*m.labels, *extra], unit="")
                families[m.name] = fam
            fam.add_metric([*labels, *extra_v], value)
        yield from families.values()

    def describe(self) -> list[Any]:
        return []  # no description at registration: collect() is called only when read


class _PrometheusBase:
    name = "prometheus"

    def __init__(self, per_rank: bool = False) -> None:
        self.per_rank = per_rank
        self.telemetry: Telemetry | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._claimed: tuple[dict[Any, Any], Any] | None = None  # (_WRITING/_PUSHING, key)

    def start(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def _claim(self, table: dict[Any, Any], key: Any, conflict: str) -> None:
        """Hold ``key`` (a file, a Pushgateway group) in this process's ``table`` for this
        sink; raise ``ConfigError(conflict)`` where a sink of another open Checkpointer holds
        it (one whose Checkpointer closed, its last write or push still under way, is none).
        Not retried: the conflict is this process's own."""
        with _CLAIMING:  # (each sink starts in its own thread: two could both find it free)
            other = table.get(key)
            if other not in (None, self) and other.telemetry is not None and other.telemetry.active:
                raise ConfigError(conflict)
            table[key] = self
            self._claimed = (table, key)

    def _release(self) -> None:
        """Give up what :meth:`_claim` held, unless another sink holds it since."""
        if self._claimed is not None:
            table, key = self._claimed
            with _CLAIMING:
                if table.get(key) is self:
                    del table[key]
            self._claimed = None

    def emit(
        self,
        flat: Mapping[str, float],
        samples: Sequence[tuple[Metric, tuple[str, ...], float]],
        events: Sequence[Mapping[str, Any]],
        step: int,
    ) -> None:
        pass

    def close(self) -> None:
        pass


class PrometheusExporter(_PrometheusBase):
    """An HTTP endpoint (``/metrics``) for Prometheus to scrape, on ``addr:port`` (port 0: a
    free port, then in :attr:`port`). It serves the values as they are at the scrape."""

    name = "prometheus exporter"

    def __init__(self, port: int, addr: str = "0.0.0.0", per_rank: bool = False) -> None:
        super().__init__(per_rank)
        self.port = port
        self.addr = addr
        self._server: Any = None
        self._held = (addr, port, 1)  # in _SERVING while it serves

    def start(self, telemetry: Telemetry) -> None:
        from prometheus_client import start_http_server

        super().start(telemetry)
        port = self.port
        held = (self.addr, port, 1)
        if self.per_rank and port:
            port += int(os.environ.get("LOCAL_RANK", telemetry.rank))
            held = (self.addr, self.port, _local_world_size())
        with _SERVING_LOCK:
            other = next((h for h in _SERVING if port and _overlap(h, held)), None)
            if other is not None:  # not retried: it is this process's own
                raise _taken(other)
            try:
                server, _thread = start_http_server(port, addr=self.addr, registry=self.registry)
            except OSError as e:
                raise OSError(
                    f"cannot listen on {self.addr}:{port} ({e.strerror or e}); is another "
                    "exporter using that port? Pick another with telemetry='prometheus:PORT'"
                ) from None
            self._server = server
            self.port = int(server.server_port)
            self._held = held if held[1] else (self.addr, self.port, 1)
            _SERVING.add(self._held)
        self.name = f"prometheus exporter {self.addr}:{self.port}"
        log.info("metrics served for Prometheus at http://%s:%d/metrics", self.addr, self.port)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            with _SERVING_LOCK:  # (once the port is free: the next one given it can bind it)
                _SERVING.discard(self._held)


def _taken(other: tuple[str, int, int]) -> ConfigError:
    """The error of an exporter given a port that ``other`` (another open Checkpointer's
    exporter of this process) serves."""
    addr = other[0]
    span = f"{other[1]}..{other[1] + other[2] - 1}" if other[2] > 1 else str(other[1])
    return ConfigError(
        f"another Checkpointer of this process serves its metrics on {addr}:{span} "
        "(a model's and its EMA's, each with telemetry='prometheus'"
        f"{'; per_rank: a port for each rank of this node' if other[2] > 1 else ''}): "
        "give this one its own port, e.g. "
        f"telemetry='prometheus:{other[1] + other[2]}', or one of them none"
    )


def _local_world_size() -> int:
    """The ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 where it is not set)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _overlap(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    """Whether two (addr, first port, count) ranges share a port on one address (every
    address, ``0.0.0.0`` or ``::``, includes each of its family: compared as strings, an
    exporter on ``0.0.0.0`` beside one on ``127.0.0.1`` failed with "address in use")."""
    return _same_address(a[0], b[0]) and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]


def _same_address(x: str, y: str) -> bool:
    if x == y or "" in (x, y):
        return True
    if "::" in (x, y):  # every IPv6 address; IPv4 too where the host lets "::" take IPv4
        return _v6_takes_v4() or ":" in (y if x == "::" else x)
    return "0.0.0.0" in (x, y) and ":" not in x + y


BINDV6ONLY = "/proc/sys/net/ipv6/bindv6only"  # Linux's setting; absent elsewhere


@functools.cache
def _v6_takes_v4() -> bool:
    """Whether a socket bound to ``::`` takes IPv4 connections too (Linux's default
    ``net.ipv6.bindv6only=0``), read once; ``True`` where it cannot be read (the safe side:
    a conflict said at once, rather than an exporter that fails to bind and is retried)."""
    try:
        with open(BINDV6ONLY) as f:
            return f.read().strip() != "1"
    except (OSError, ValueError):
        return True


class PrometheusTextfile(_PrometheusBase):
    """Writes the metrics in Prometheus' text format to ``path`` (atomically: a temporary
    file renamed), for node_exporter's ``--collector.textfile.directory``: batch jobs need no
    open port."""

    name = "prometheus textfile"

    def __init__(self, path: str | os.PathLike[str], per_rank: bool = False) -> None:
        super().__init__(per_rank)
        self.path = os.fspath(path)

    def close(self) -> None:
        self._release()

    def start(self, telemetry: Telemetry) -> None:
        super().start(telemetry)
        if self.per_rank and self._claimed is None:  # once: start() is retried after a failure
            self.path = self.path[: -len(".prom")] + f".rank{telemetry.rank}.prom"
        self.name = f"prometheus textfile {self.path}"
        self._claim(
            _WRITING,
            os.path.abspath(self.path),
            f"another Checkpointer of this process writes its metrics to {self.path} (a "
            "model's and its EMA's, each with the same telemetry='textfile:...'): give this "
            f"one its own file, e.g. {self.path[: -len('.prom')]}.ema.prom",
        )
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._write()

    def _write(self) -> None:
        from prometheus_client import write_to_textfile

        write_to_textfile(self.path, self.registry)

    def emit(
        self,
        flat: Mapping[str, float],
        samples: Sequence[tuple[Metric, tuple[str, ...], float]],
        events: Sequence[Mapping[str, Any]],
        step: int,
    ) -> None:
        self._write()


class PrometheusPushgateway(_PrometheusBase):
    """Pushes the metrics to a Pushgateway (``url``) under ``job`` and this host (and rank),
    when they change (at most every few seconds) and at close."""

    name = "prometheus pushgateway"

    def __init__(
        self,
        url: str,
        job: str = "resilient_ckpt",
        per_rank: bool = False,
        timeout: float = 10.0,
    ) -> None:
        super().__init__(per_rank)
        self.url = url
        self.job = job
        self.timeout = timeout
        self.name = f"prometheus pushgateway {url_text(url)}"  # no credentials in messages
        self._key: dict[str, str] = {}

    def start(self, telemetry: Telemetry) -> None:
        super().start(telemetry)
        self._key = {"instance": socket.gethostname()}
        if self.per_rank:
            self._key["rank"] = str(telemetry.rank)
        # a push replaces the whole group: two pushing one would overwrite each other in turn
        self._claim(
            _PUSHING,
            (self.url.rstrip("/"), self.job, tuple(sorted(self._key.items()))),
            f"another Checkpointer of this process pushes its metrics to {url_text(self.url)} "
            f"as job {self.job!r} of this host (a model's and its EMA's, each with the same "
            "telemetry='pushgateway:...'): give this one its own job, e.g. "
            f"telemetry={{'kind': 'pushgateway', 'url': ..., 'job': '{self.job}_ema'}}",
        )

    def close(self) -> None:
        self._release()

    def emit(
        self,
        flat: Mapping[str, float],
        samples: Sequence[tuple[Metric, tuple[str, ...], float]],
        events: Sequence[Mapping[str, Any]],
        step: int,
    ) -> None:
        from prometheus_client import push_to_gateway

        push_to_gateway(
            self.url,
            job=self.job,
            registry=self.registry,
            grouping_key=self._key,
            timeout=self.timeout,
        )


def make(kind: str, options: Mapping[str, Any]) -> _PrometheusBase:
    if kind == "prometheus":
        return PrometheusExporter(**options)
    if kind == "textfile":
        return PrometheusTextfile(**options)
    return PrometheusPushgateway(**options)
