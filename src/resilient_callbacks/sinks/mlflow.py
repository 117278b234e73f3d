"""The MLflow sink (extra ``mlflow``: ``mlflow-skinny``, with ``sqlalchemy``/``alembic`` for a
``sqlite:///`` store): metrics into a run, checkpoint events as tags, and optionally a verified
checkpoint as an artifact.

Which run: ``run_id`` if given; else the run active (``mlflow.start_run``) where the Checkpointer
is constructed; else a run of ``experiment`` tagged ``resilient_ckpt.run_id=<the checkpoint
run's id>``, found again after a restart (so a killed and resumed job keeps one MLflow run), or
created. Metrics go in with the training step; each event becomes a tag
``resilient_ckpt.<event>.step_<N>`` (``save``, ``restore``, ``fallback``, ``preemption``, ...).

``log_checkpoint="final"`` (the newest valid checkpoint at close) or ``"best"`` (the best by
``monitor``): every checksum is verified, then the checkpoint directory is logged as the artifact
``checkpoints/<name>`` and the tag ``resilient_ckpt.checkpoint_artifact`` names it (with
``incremental=True``, the blobs it shares with other checkpoints go into its ``blobs/``, where
restore looks first: the artifact is a checkpoint on its own).

``register_model="NAME"`` (with ``log_checkpoint``): then that artifact becomes a version of the
registered model ``NAME`` (created when missing) in the registry (``registry_uri``, else the
tracking store): source the artifact's URI, run the MLflow run, tags naming the checkpoint, its
step and the SHA-256 of its manifest (which lists every file's checksum). A checkpoint already
registered under ``NAME`` by this run (same manifest) is not registered again, so a job that
resumes and closes without a new checkpoint adds no version. A failed registration is warned
about; the artifact stays logged and training is not affected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import posixpath
import socket
import time
import urllib.parse
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ..metrics import Metric
from ..redact import url_text
from ..telemetry import Telemetry
from . import missing_extra

try:
    import mlflow
    from mlflow.entities import Metric as MLMetric
    from mlflow.entities import RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from mlflow.utils.uri import append_to_uri_path
except ImportError as e:  # pragma: no cover - exercised only without the extra installed
    raise missing_extra("mlflow", "mlflow (or mlflow-skinny)") from e

RUN_TAG = "resilient_ckpt.run_id"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI shows the run nested in its parent
MANIFEST_TAG = "resilient_ckpt.manifest_sha256"

log = logging.getLogger("resilient_callbacks")

# (tracking URI, MLflow run id) -> the open sink logging into that run it did not create
_JOINED: weakref.WeakValueDictionary[tuple[str, str | None], MLflowSink] = (
    weakref.WeakValueDictionary()
)


class MLflowSink:
    per_rank = False

    def __init__(
        self,
        *,
        context: Mapping[str, Any],
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_id: str | None = None,
        run_name: str | None = None,
        log_checkpoint: str | None = None,
        register_model: str | None = None,
        registry_uri: str | None = None,
    ) -> None:
        self.context = context  # the Checkpointer's dirpath, monitor, mode, run_id (live)
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        # else the experiment MLflow's start_run() would take (a scheduler's, mlflow run's,
        # mlflow.set_experiment()'s): an id in the default store, meaningless in another one
        default_store = _same_store(self.tracking_uri, mlflow.get_tracking_uri())
        self.experiment_id = (
            os.environ.get("MLFLOW_EXPERIMENT_ID")
            if default_store and not self.experiment
            else None
        )
        self.run_name = run_name
        self.log_checkpoint = log_checkpoint
        self.register_model = register_model
        self.registry_uri = registry_uri
        self.close_timeout_s = 600.0 if log_checkpoint else 30.0
        self.own_run = False
        if run_id is None and default_store:
            active = mlflow.active_run()  # thread-local: read here, on the caller's thread
            if active is not None:  # (in the store given: a run elsewhere cannot be logged to)
                run_id = active.info.run_id
        self._tag_keys: set[str] | None = None  # event tags already on the run
        self.parent_run_id: str | None = None
        if run_id is not None:
            run_id = self._join(run_id)
        self.run_id = run_id
        self.name = f"mlflow {url_text(self.tracking_uri)}"  # no credentials in messages
        self._client: Any = None
        self._pending: list[Mapping[str, Any]] = []  # events not yet named as tags
        self._unsent: list[Any] = []  # their tags, until MLflow took them
        self._last_step = 0
        self._closed = False

    # ------------------------------------------------------------------ the sink

    def start(self, telemetry: Telemetry) -> None:
        _preflight(self.tracking_uri)
        try:
            self._client = MlflowClient(
                tracking_uri=self.tracking_uri, registry_uri=self.registry_uri
            )
        except MlflowException as e:  # a store it refuses (MLflow 3: a file store): no retry
            if e.error_code != "INVALID_PARAMETER_VALUE":
                raise
            raise ConfigError(
                f"MLflow refuses the tracking store {url_text(self.tracking_uri)}: {e}"
            ) from e

    def emit(
        self,
        flat: Mapping[str, float],
        samples: Sequence[tuple[Metric, tuple[str, ...], float]],
        events: Sequence[Mapping[str, Any]],
        step: int,
    ) -> None:
        self._pending.extend(events)
        if not self._ensure_run():
            return  # the checkpoint run's id is not known yet (no save or restore so far)
        assert self.run_id is not None
        now = int(time.time() * 1000)
        self._last_step = step
        metrics = [
            MLMetric(k.replace("/", "."), v, now, step) for k, v in flat.items() if math.isfinite(v)
        ]
        if self._tag_keys is None:  # the events earlier processes of this run tagged
            self._tag_keys = set(self._client.get_run(self.run_id).data.tags)
        # each event's tag is named once: a send that failed is retried with the same names
        self._unsent.extend(RunTag(*_event_tag(e, self._tag_keys)) for e in self._pending)
        self._pending = []
        while metrics or self._unsent:  # MLflow's batch limits
            tags = self._unsent[:100]
            self._client.log_batch(self.run_id, metrics=metrics[:100], tags=tags)
            metrics, self._unsent = metrics[100:], self._unsent[len(tags) :]

    def close(self) -> None:
        key = (self.tracking_uri, self.run_id)
        if _JOINED.get(key) is self:  # a later Checkpointer may log into that run itself
            del _JOINED[key]
        if self._client is None or self.run_id is None or self._closed:
            return
        self._closed = True  # once: the runner calls close() again after a close that raised
        failed = self.context.get("failed")
        if self.log_checkpoint:
            logged = self._log_checkpoint()
            if logged is not None and self.register_model and failed:
                log.warning(
                    "metrics sink %s: training failed (%s): checkpoint %s is logged as an "
                    "artifact but not registered as a version of model %r",
                    self.name,
                    failed,
                    logged.name,
                    self.register_model,
                )
            elif logged is not None and self.register_model:
                try:
                    self._register(logged)
                except Exception as e:  # the artifact is logged; say so, and go on
                    log.warning(
                        "metrics sink %s: registering checkpoint %s as a version of model %r "
                        "failed (the artifact checkpoints/%s is logged; training is not "
                        "affected): %s: %s",
                        self.name,
                        logged.name,
                        self.register_model,
                        logged.name,
                        type(e).__name__,
                        e,
                    )
        if self.own_run:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    # ------------------------------------------------------------------ the run

    def _join(self, run_id: str) -> str | None:
        """``run_id`` (the active run, or the one given), unless another open Checkpointer of
        this process logs into it already (a model's and its EMA's in one ``start_run()``):
        their metrics have the same names and their event tags and artifacts the same keys, so
        they would mix and overwrite each other. This one then logs into a run nested in it
        (None: made or found again by :meth:`_ensure_run`)."""
        key = (self.tracking_uri, run_id)
        other = _JOINED.get(key)
        if other is None or other._closed:
            _JOINED[key] = self
            return run_id
        self.parent_run_id = run_id
        log.info(
            "metrics sink mlflow: the MLflow run %s receives the checkpoint metrics of %s "
            "already; those of %s go to a run nested in it (the same metric names would mix)",
            run_id,
            other.context.get("dirpath"),
            self.context.get("dirpath"),
        )
        return None

    def _ensure_run(self) -> bool:
        if self.run_id is not None:
            return True
        ckpt_run = self.context.get("run_id")
        if ckpt_run is None:
            return False
        c = self._client
        exp_id = self.experiment_id or "0"
        where = f"tags.`{RUN_TAG}` = '{ckpt_run}'"
        tags = {RUN_TAG: ckpt_run}
        name = self.run_name or f"ckpt-{ckpt_run}"
        if self.parent_run_id is not None:  # nested in the run another Checkpointer logs into
            exp_id = c.get_run(self.parent_run_id).info.experiment_id
            where += f" and tags.`{PARENT_TAG}` = '{self.parent_run_id}'"
            tags[PARENT_TAG] = self.parent_run_id
            name = self.run_name or os.path.basename(str(self.context.get("dirpath")).rstrip("/"))
        elif self.experiment:
            exp = c.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp is not None else c.create_experiment(self.experiment)
        found = c.search_runs([exp_id], filter_string=where)
        if found:
            run_id = found[0].info.run_id
            c.update_run(run_id, status="RUNNING")
        else:
            run = c.create_run(
                exp_id, tags=tags, run_name=name
            )  # a retry after a reply lost finds it by its tag
            run_id = run.info.run_id
            c.log_param(run_id, "resilient_ckpt.dirpath", self.context.get("dirpath"))
        self.run_id, self.own_run = run_id, True
        return True

    def _log_checkpoint(self) -> Any:
        """Log the chosen checkpoint, verified; return its catalog entry (None: none logged)."""
        from .. import branches
        from ..blobs import BLOBS_DIR, blob_path
        from ..catalog import Depth, Status, scan, verify

        dirpath = self.context.get("dirpath")
        if not dirpath:
            return None
        run = self.context.get("run_id")  # this run's checkpoints only: not another run's
        mine = [  # in the same directory (resume="never" beside it)
            e for e in scan(dirpath, Depth.SIZE) if e.manifest and e.manifest.run_id == run
        ]
        valid = [e for e in mine if e.status is Status.VALID]
        monitor = self.context.get("monitor")
        if self.log_checkpoint == "best" and monitor:
            sign = -1.0 if self.context.get("mode") == "max" else 1.0
            # as retention ranks them: a branch a roll-back abandoned after the current lineage
            off = branches.off_lineage(
                (str(run), e.seq, e.manifest.lineage) for e in mine if e.manifest is not None
            )

            def rank(e: Any) -> tuple[int, float, int]:  # the higher, the better
                v = e.manifest.metrics.get(monitor)
                if v is None:  # no score (none reported, or not finite): the newest first
                    return 0, 0.0, e.seq
                # of tied scores the earliest, the one retention keeps as the best
                return (1 if (str(run), e.seq) in off else 2), -sign * float(v), -e.seq

            valid.sort(key=rank)  # the best last
        for e in reversed(valid):  # the chosen one; the next if it fails its verification
            assert e.manifest is not None
            try:
                verify(e.path, e.manifest, Depth.FULL)
            except Exception:
                continue
            art = f"checkpoints/{e.name}"
            self._client.log_artifacts(self.run_id, e.path, artifact_path=art)
            for b in e.manifest.blobs:  # incremental: the shared blobs go in, self-contained
                src = blob_path(e.path, b.path)
                if not src.startswith(os.path.join(e.path, "")):
                    dest = posixpath.join(art, BLOBS_DIR, posixpath.dirname(b.path)).rstrip("/")
                    self._client.log_artifact(self.run_id, src, artifact_path=dest)
            self._client.set_tag(
                self.run_id,
                "resilient_ckpt.checkpoint_artifact",
                json.dumps({"name": e.name, "step": e.manifest.step, "verified": True}),
            )
            return e
        return None

    def _register(self, e: Any) -> None:
        """``e`` (logged as ``checkpoints/<name>``) as a new version of ``register_model``."""
        from ..manifest import MANIFEST_NAME

        c, name = self._client, self.register_model
        assert name is not None and self.run_id is not None
        with open(os.path.join(e.path, MANIFEST_NAME), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        # by run_id: the one filter both the sqlite and the file registry take
        for mv in c.search_model_versions(f"run_id = '{self.run_id}'"):
            if mv.name == name and mv.tags.get(MANIFEST_TAG) == digest:
                return  # this checkpoint is this model's version already
        try:
            c.get_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            try:
                c.create_registered_model(
                    name, description="checkpoints registered by resilient_callbacks"
                )
            except MlflowException as err2:  # created meanwhile by another job
                if err2.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
        run = c.get_run(self.run_id)
        mv = c.create_model_version(
            name,
            append_to_uri_path(run.info.artifact_uri, f"checkpoints/{e.name}"),
            run_id=self.run_id,
            tags={
                "resilient_ckpt.checkpoint": e.name,
                "resilient_ckpt.step": str(e.manifest.step),
                MANIFEST_TAG: digest,
                RUN_TAG: str(self.context.get("run_id")),
                "resilient_ckpt.verified": "true",
            },
            await_creation_for=0,
        )
        c.set_tag(
            self.run_id,
            "resilient_ckpt.registered_model",
            json.dumps({"name": name, "version": int(mv.version), "step": e.manifest.step}),
        )


def _event_tag(e: Mapping[str, Any], taken: set[str]) -> tuple[str, str]:
    """The tag of an event; one that recurs at the same step (a crash loop restoring the same
    checkpoint, several fallbacks) gets ``.2``, ``.3``, ... instead of overwriting the first."""
    kind = str(e.get("event", "event"))
    step = e.get("step")
    key = base = f"resilient_ckpt.{kind}" + (f".step_{step}" if step is not None else "")
    n = 1
    while key in taken:
        n += 1
        key = f"{base}.{n}"
    taken.add(key)
    value = {k: v for k, v in e.items() if k not in ("event",)}
    return key, json.dumps(value, default=str)[:5000]


def _same_store(a: str, b: str) -> bool:
    """Whether two tracking URIs name one store (the active run's, given again explicitly)."""
    return a.rstrip("/") == b.rstrip("/")


def _preflight(uri: str) -> None:
    """Fail fast (seconds, not MLflow's minutes of retries) when an HTTP tracking server does
    not answer: its host, or the proxy MLflow's requests go through (``HTTP(S)_PROXY``, not
    bypassed by ``NO_PROXY``), which may be the only route to it."""
    u = urllib.parse.urlparse(uri)
    if u.scheme not in ("http", "https") or not u.hostname:
        return
    host, port, via = u.hostname, u.port or (443 if u.scheme == "https" else 80), ""
    proxy = urllib.request.getproxies().get(u.scheme)
    if proxy and not urllib.request.proxy_bypass(u.hostname):
        p = urllib.parse.urlparse(proxy if "://" in proxy else f"http://{proxy}")
        if p.hostname:
            host, port = p.hostname, p.port or (443 if p.scheme == "https" else 80)
            via = f" through the proxy {url_text(proxy)}"
    try:
        with socket.create_connection((host, port), timeout=5.0):
            pass
    except OSError as e:
        raise ConnectionError(
            f"MLflow tracking server {url_text(uri)} is unreachable{via}: {e}"
        ) from None
