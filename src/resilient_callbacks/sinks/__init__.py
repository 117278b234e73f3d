"""Where the checkpoint metrics go: the ``telemetry=`` option of ``Checkpointer`` and both callbacks.

``telemetry`` takes one sink or a list of them, each given as:

- a short spec string: ``"prometheus"`` / ``"prometheus:9464"`` / ``"prometheus:127.0.0.1:9464"``
  (an HTTP exporter), ``"textfile:/var/lib/node_exporter/ckpt.prom"`` (node_exporter's textfile
  collector), ``"pushgateway:http://gateway:9091"``, ``"mlflow"`` (the active run, or a new one)
  / ``"mlflow:sqlite:///mlflow.db"`` (a tracking URI), ``"logger"`` (the framework's loggers:
  Lightning's ``trainer.loggers``, the Trainer's ``log``, so every ``report_to`` integration);
- a dict ``{"kind": "prometheus", "port": 9464, "per_rank": true}`` (the form for JSON configs,
  such as the DeepSpeed section), with the keyword options of the sink's class;
- a callable, called with the metrics dict (``{name: value}``) from a background thread;
- a sink object (see :class:`~resilient_callbacks.telemetry.Sink`).

Specs are checked when the option is validated (no extra is imported then); the sinks are built
when the Checkpointer is, and a missing extra is a :class:`~.errors.ConfigError` naming it.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..metrics import Metric
from ..sink_retry import SinkHealth
from ..telemetry import Sink, Telemetry

log = logging.getLogger("resilient_callbacks")

KINDS = ("prometheus", "textfile", "pushgateway", "mlflow", "logger")
DEFAULT_PORT = 9464  # the port OpenTelemetry's Prometheus exporter uses; node_exporter has 9100

_OPTIONS: dict[str, tuple[str, ...]] = {
    "prometheus": ("port", "addr", "per_rank"),
    "textfile": ("path", "per_rank"),
    "pushgateway": ("url", "job", "per_rank", "timeout"),
    "mlflow": (
        "tracking_uri",
        "experiment",
        "run_id",
        "run_name",
        "log_checkpoint",
        "register_model",
        "registry_uri",
    ),
    "logger": (),
}


@dataclass(frozen=True)
class SinkSpec:
    """One validated sink: its ``kind`` (one of :data:`KINDS`, ``"callable"`` or ``"object"``)
    and options (``target``: the callable or the sink object)."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    target: Any = None


def parse(value: Any) -> tuple[SinkSpec, ...]:
    """The sinks ``value`` names (``None``: none), or :class:`ConfigError` saying what is wrong."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(s for v in value for s in parse(v))
    if isinstance(value, str):
        return (_parse_str(value),)
    if isinstance(value, Mapping):
        return (_parse_dict(value),)
    if hasattr(value, "emit") and callable(value.emit):
        return (SinkSpec("object", target=value),)
    if callable(value):
        return (SinkSpec("callable", target=value),)
    raise ConfigError(f"telemetry={value!r:.200}: {_USAGE}")


_USAGE = (
    "give a sink as 'prometheus[:PORT]', 'textfile:PATH', 'pushgateway:URL', 'mlflow[:URI]', "
    "'logger', a dict {'kind': ..., options}, a callable taking the metrics dict, or a list of "
    "these (docs/monitoring.md)"
)


def _parse_str(s: str) -> SinkSpec:
    kind, _, rest = s.strip().partition(":")
    kind = kind.lower()
    if kind not in KINDS:
        raise ConfigError(f"telemetry={s!r}: unknown sink {kind!r}; {_USAGE}")
    opts: dict[str, Any] = {}
    if kind == "prometheus" and rest:
        host, _, port = rest.rpartition(":")
        opts["port"] = port
        if host:
            opts["addr"] = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    elif kind == "textfile":
        opts["path"] = rest
    elif kind == "pushgateway":
        opts["url"] = rest
    elif kind == "mlflow" and rest:
        opts["tracking_uri"] = rest
    elif kind == "logger" and rest:
        raise ConfigError(f"telemetry={s!r}: 'logger' takes no argument")
    return _check(kind, opts, repr(s))


def _parse_dict(d: Mapping[str, Any]) -> SinkSpec:
    kind = str(d.get("kind", "")).lower()
    if kind not in KINDS:
        raise ConfigError(
            f"telemetry={dict(d)!r:.200}: 'kind' must be one of {', '.join(KINDS)}; {_USAGE}"
        )
    opts = {k: v for k, v in d.items() if k != "kind"}
    unknown = sorted(set(opts) - set(_OPTIONS[kind]))
    if unknown:
        raise ConfigError(
            f"telemetry sink {kind!r}: unknown option(s) {', '.join(unknown)}; it takes "
            f"{', '.join(_OPTIONS[kind]) or 'none'}"
        )
    return _check(kind, opts, repr(dict(d)))


def _check(kind: str, opts: dict[str, Any], given: str) -> SinkSpec:
    if kind == "prometheus":
        given_port = opts.get("port", DEFAULT_PORT)
        try:
            port = int(given_port)
        except (TypeError, ValueError):
            port = -1
        whole = isinstance(given_port, str) or (
            isinstance(given_port, (int, float)) and float(given_port).is_integer()
        )
        if isinstance(given_port, bool) or not whole or not 0 <= port <= 65535:
            raise ConfigError(
                f"telemetry={given}: the port must be a number 0..65535 (0: any free)"
            )
        opts["port"] = port
        opts.setdefault("addr", "0.0.0.0")
    if kind == "textfile":
        path = opts.get("path")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(
                f"telemetry={given}: 'textfile' needs a path, e.g. "
                "'textfile:/var/lib/node_exporter/textfile/ckpt.prom'"
            )
        if not os.fspath(path).endswith(".prom"):
            raise ConfigError(f"telemetry={given}: node_exporter reads only files ending in .prom")
    if kind == "pushgateway" and not (isinstance(opts.get("url"), str) and "://" in opts["url"]):
        raise ConfigError(
            f"telemetry={given}: 'pushgateway' needs the gateway's URL, e.g. "
            "'pushgateway:http://gateway:9091'"
        )
    timeout = opts.get("timeout", 10)
    if kind == "pushgateway" and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise ConfigError(f"telemetry={given}: timeout={timeout!r}: seconds, a number > 0")
    for name in ("experiment", "run_id", "run_name", "tracking_uri", "registry_uri", "job"):
        if opts.get(name) is not None and not isinstance(opts[name], str):
            raise ConfigError(f"telemetry={given}: {name}={opts[name]!r}: a string")
    if kind == "mlflow":
        lc = opts.get("log_checkpoint")
        if lc not in (None, "final", "best"):
            raise ConfigError(
                f"telemetry={given}: log_checkpoint={lc!r}: use 'final' (the newest valid "
                "checkpoint at close), 'best' (the best by monitor) or None"
            )
        rm = opts.get("register_model")
        if rm is not None:
            if not lc:
                raise ConfigError(
                    f"telemetry={given}: register_model={rm!r} registers the checkpoint the sink "
                    "logs as an artifact, and none is logged: add log_checkpoint='final' or 'best'"
                )
            if not isinstance(rm, str) or not rm.strip() or any(c in rm for c in "/:"):
                raise ConfigError(
                    f"telemetry={given}: register_model={rm!r}: give the registered model's "
                    "name, a non-empty string without '/' or ':' (MLflow's rule)"
                )
    for flag in ("per_rank",):
        if flag in opts and not isinstance(opts[flag], bool):
            raise ConfigError(f"telemetry={given}: {flag} must be true or false")
    return SinkSpec(kind, opts)


class CheckpointerContext(Mapping[str, Any]):
    """What a sink may ask of its Checkpointer (live: ``run_id`` is known after the first save
    or restore): ``dirpath``, ``run_id``, ``monitor``, ``mode``; ``failed``: the name of the
    exception the run failed with (:meth:`Checkpointer.abort`), else None."""

    def __init__(self, ck: Any) -> None:
        self._ref = weakref.ref(ck)
        self._keys = ("dirpath", "run_id", "monitor", "mode", "failed")

    def __getitem__(self, key: str) -> Any:
        ck = self._ref()
        if ck is None or key not in self._keys:
            raise KeyError(key)
        if key == "run_id":
            return ck._dir.run_id
        if key == "dirpath":
            return ck.dirpath
        if key == "failed":
            return ck.failed_with
        return str(getattr(ck.config, key)) if getattr(ck.config, key) is not None else None

    def __iter__(self) -> Any:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def warn_logger_without_framework() -> None:
    """``telemetry="logger"`` on a Checkpointer no framework's callback drives (the same on
    every rank: said once, on rank 0)."""
    from .. import notices

    notices.say_once(
        log,
        "telemetry='logger' sends the metrics through a framework's loggers (the Lightning and "
        "Transformers callbacks); this Checkpointer has none, so that sink does nothing. Pass "
        "a callable (telemetry=fn) to get the metrics here.",
        UserWarning,
        stacklevel=4,  # the caller of Checkpointer.step() / save()
    )


_LOGGER_HEALTH: weakref.WeakKeyDictionary[Any, SinkHealth] = weakref.WeakKeyDictionary()


def to_framework(ck: Any, send: Callable[[dict[str, float]], Any], *, final: bool = False) -> None:
    """``telemetry="logger"``: the metrics now (``ck.metrics()``) through the framework's
    loggers, ``send`` (the adapters': Lightning's loggers, the Trainer's ``log``), on the
    training thread; nothing unless ``"logger"`` is among ``ck``'s sinks. A logger that raises
    is retried as every sink is (:mod:`..sink_retry`): said once, skipped without waiting until
    its back-off has passed, said again when it is back, switched off if it keeps failing.
    ``final``: the end of training, tried even during a back-off."""
    if "logger" not in ck.telemetry_kinds:
        return
    health = _LOGGER_HEALTH.get(ck)
    if health is None:
        health = _LOGGER_HEALTH[ck] = SinkHealth("logger")
    if health.off or not (final or health.due()):
        return
    try:
        send(ck.metrics())
    except Exception as e:
        health.failed(e, final=final)
    else:
        health.ok()


def kinds(specs: Sequence[SinkSpec]) -> set[str]:
    return {s.kind for s in specs}


def build(specs: Sequence[SinkSpec], context: Mapping[str, Any]) -> list[Sink]:
    """The sink objects of ``specs`` (``"logger"`` is the adapters' own: skipped here).
    ``context``: ``dirpath``, ``monitor``, ``mode`` of the Checkpointer (for MLflow's
    checkpoint artifact). Imports each sink's extra; a missing one is a ConfigError."""
    out: list[Sink] = []
    for spec in specs:
        if spec.kind == "object":
            out.append(spec.target)
        elif spec.kind == "callable":
            out.append(CallableSink(spec.target))
        elif spec.kind in ("prometheus", "textfile", "pushgateway"):
            from . import prometheus

            out.append(prometheus.make(spec.kind, spec.options))
        elif spec.kind == "mlflow":
            from . import mlflow

            out.append(mlflow.MLflowSink(context=context, **spec.options))
    return out


def missing_extra(extra: str, module: str) -> ConfigError:
    return ConfigError(
        f"the {extra} metrics sink needs {module}, which is not installed: "
        f"pip install 'resilient-callbacks[{extra}]'"
    )


class CallableSink:
    """A plain-loop hook: ``fn(metrics)`` with ``{name: value}`` (see
    :func:`~resilient_callbacks.metrics.flat_key`), from a background thread, when something
    changed (at most every few seconds) and at close."""

    per_rank = False

    def __init__(self, fn: Callable[[dict[str, float]], Any]) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def start(self, telemetry: Telemetry) -> None:
        pass

    def emit(
        self,
        flat: Mapping[str, float],
        samples: Sequence[tuple[Metric, tuple[str, ...], float]],
        events: Sequence[Mapping[str, Any]],
        step: int,
    ) -> None:
        self.fn(dict(flat))

    def close(self) -> None:
        pass


__all__ = ["KINDS", "CallableSink", "SinkSpec", "build", "parse", "to_framework"]
