"""Cloud metadata pollers: :class:`MetadataPoller` turns an AWS spot, GCP preemption, Azure
scheduled-events (or any URL's) notice into :meth:`PreemptionWatcher.trigger`.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from http.client import HTTPException
from types import MappingProxyType

from ..errors import ConfigError
from .request import MetadataKind, _check_seconds
from .signals import PreemptionWatcher

# The name the module had before it became a package: log filters and tests select on it.
log = logging.getLogger("resilient_callbacks.preemption")

DEFAULT_URLS: Mapping[MetadataKind, str] = MappingProxyType(
    {
        MetadataKind.AWS: "http://169.254.169.254/latest/meta-data/spot/instance-action",
        MetadataKind.GCP: "http://metadata.google.internal/computeMetadata/v1/instance/preempted",
        MetadataKind.AZURE: "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01",
    }
)
AWS_TOKEN_PATH = "/latest/api/token"  # IMDSv2: PUT on the same host as the instance-action URL
AWS_TOKEN_TTL_S = 21600
GCP_MAINTENANCE_NAME = "maintenance-event"  # read next to the preempted URL
AZURE_EVENT_TYPES = ("Preempt", "Terminate", "Reboot", "Redeploy", "Freeze")
DEFAULT_AZURE_EVENT_TYPES = ("Preempt", "Terminate")

_MAX_BODY = 64 * 1024


class _PollError(Exception):
    """The endpoint could not be read (refused, timeout, unexpected status, bad body)."""


@dataclass(frozen=True)
class _Notice:
    detail: str
    grace_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class PollerConfig:
    """Options of a :class:`MetadataPoller`. ``url`` defaults to the kind's cloud endpoint."""

    kind: MetadataKind | str
    url: str | None = None
    interval_s: float = 5.0
    timeout_s: float = 1.0
    warn_after_failures: int = 3
    aws_imdsv2: bool = True
    gcp_maintenance: bool = False
    azure_event_types: tuple[str, ...] | Iterable[str] = DEFAULT_AZURE_EVENT_TYPES
    azure_vm_name: str | None = None  # only events whose Resources name this VM count

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", MetadataKind(self.kind))
        except ValueError:
            kinds = ", ".join(repr(k.value) for k in MetadataKind)
            raise ConfigError(f"kind={self.kind!r}: must be one of {kinds}") from None
        url = self.url if self.url is not None else DEFAULT_URLS.get(MetadataKind(self.kind))
        if url is None:
            raise ConfigError("kind='custom' needs url=... (the endpoint to poll)")
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ConfigError(f"url={url!r}: must be an http:// or https:// URL")
        object.__setattr__(self, "url", url)
        _check_seconds("interval_s", self.interval_s)
        _check_seconds("timeout_s", self.timeout_s)
        n = self.warn_after_failures
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"warn_after_failures={n!r}: must be an int >= 1")
        for name in ("aws_imdsv2", "gcp_maintenance"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be True or False")
        types = self.azure_event_types
        if isinstance(types, str) or not isinstance(types, Iterable):
            raise ConfigError(f"azure_event_types={types!r}: must be a list, e.g. ['Preempt']")
        types = tuple(types)
        bad = [t for t in types if t not in AZURE_EVENT_TYPES]
        if bad or not types:
            raise ConfigError(
                f"azure_event_types={list(types)!r}: must be a non-empty list of "
                f"{', '.join(AZURE_EVENT_TYPES)}"
            )
        object.__setattr__(self, "azure_event_types", types)
        if self.azure_vm_name is not None and not (
            isinstance(self.azure_vm_name, str) and self.azure_vm_name
        ):
            raise ConfigError(f"azure_vm_name={self.azure_vm_name!r}: must be a VM name or None")


_TOKEN_RE = re.compile(r"[A-Za-z0-9+/=_.\-]{1,1024}")  # what a header can carry


def _seconds_until(when: datetime) -> float:
    return max(0.0, when.timestamp() - time.time())


class MetadataPoller:
    """Polls one metadata endpoint from a daemon thread; on a notice, ``watcher.trigger()``.

    Which process/thread calls what: the training process calls :meth:`start` and :meth:`stop`,
    or uses it as a context manager; a notice concerns one VM, so one poller per node is enough
    when the flag is combined across ranks, and one per rank is harmless. Its
    thread only reads the endpoint and calls :meth:`PreemptionWatcher.trigger`, which never
    blocks the training thread. An unreachable endpoint is not a notice: it is logged at debug,
    polling goes on, and one warning is logged after ``warn_after_failures`` failures in a row.
    A notice triggers once; it triggers again only if it changes, or disappears and comes back.
    """

    def __init__(
        self,
        watcher: PreemptionWatcher,
        *,
        kind: MetadataKind | str,
        url: str | None = None,
        interval_s: float = 5.0,
        timeout_s: float = 1.0,
        warn_after_failures: int = 3,
        aws_imdsv2: bool = True,
        gcp_maintenance: bool = False,
        azure_event_types: Iterable[str] = DEFAULT_AZURE_EVENT_TYPES,
        azure_vm_name: str | None = None,
    ) -> None:
        if not isinstance(watcher, PreemptionWatcher):
            raise ConfigError(f"watcher={watcher!r}: must be a PreemptionWatcher")
        self.config = PollerConfig(
            kind=kind,
            url=url,
            interval_s=interval_s,
            timeout_s=timeout_s,
            warn_after_failures=warn_after_failures,
            aws_imdsv2=aws_imdsv2,
            gcp_maintenance=gcp_maintenance,
            azure_event_types=azure_event_types,
            azure_vm_name=azure_vm_name,
        )
        self.watcher = watcher
        self.kind = MetadataKind(self.config.kind)
        self.source = f"metadata:{self.kind.value}"
        self._azure_types = tuple(self.config.azure_event_types)
        self.url: str = self.config.url  # type: ignore[assignment]
        self.polls = 0  # completed polls, failed or not
        self.consecutive_failures = 0
        # Metadata endpoints are link-local: never send them through an http_proxy.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_notice: str | None = None
        self._aws_token: str | None = None
        self._aws_token_expiry = 0.0

    # -------------------------------------------------------------- lifecycle

    def start(self) -> MetadataPoller:
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"resilient-callbacks-{self.source}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, join: bool = True) -> None:
        """Stop polling and join the thread (waits at most for one in-flight request; not
        with ``join=False``: a dropped Checkpointer's)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if join and t is not None and t is not threading.current_thread():
            t.join(timeout=2 * self.config.timeout_s + 1.0)

    def __enter__(self) -> MetadataPoller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        stop = self._stop
        while not stop.is_set():
            self.poll_once()
            stop.wait(self.config.interval_s)

    # -------------------------------------------------------------- one poll

    def poll_once(self) -> bool:
        """Read the endpoint once; True when it shows a notice. Never raises."""
        try:
            notice = self._check()
        except Exception as e:  # _PollError, or a bug: either way the thread must live on
            self.polls += 1
            self.consecutive_failures += 1
            log.debug("%s: cannot read %s: %s", self.source, self.url, e, exc_info=True)
            if self.consecutive_failures == self.config.warn_after_failures:
                log.warning(
                    "cannot read the %s preemption notice endpoint %s (%d failures in a row; "
                    "last: %s). Polling continues; notices are missed while this lasts. Check "
                    "that this machine runs on that cloud, or pass the right url=.",
                    self.kind.value,
                    self.url,
                    self.consecutive_failures,
                    e,
                )
            return False
        self.polls += 1
        if self.consecutive_failures >= self.config.warn_after_failures:
            log.info("%s: %s is reachable again", self.source, self.url)
        self.consecutive_failures = 0
        if notice is None:
            self._last_notice = None
            return False
        if notice.detail != self._last_notice:
            self._last_notice = notice.detail
            log.warning("preemption notice from %s: %s", self.source, notice.detail)
            self.watcher.trigger(self.source, notice.detail, grace_s=notice.grace_s)
        return True

    def _get(self, url: str, headers: Mapping[str, str], method: str = "GET") -> tuple[int, bytes]:
        req = urllib.request.Request(url, headers=dict(headers), method=method)
        try:
            with self._opener.open(req, timeout=self.config.timeout_s) as resp:
                return int(resp.status), resp.read(_MAX_BODY)
        except urllib.error.HTTPError as e:
            with contextlib.closing(e):
                return int(e.code), b""
        except (OSError, HTTPException) as e:  # refused, reset, timeout (URLError is an OSError)
            raise _PollError(f"{method} {url}: {getattr(e, 'reason', None) or e}") from e

    def _check(self) -> _Notice | None:
        return {
            MetadataKind.AWS: self._check_aws,
            MetadataKind.GCP: self._check_gcp,
            MetadataKind.AZURE: self._check_azure,
            MetadataKind.CUSTOM: self._check_custom,
        }[self.kind]()

    def _token(self) -> str | None:
        """An IMDSv2 session token, or None to fall back to IMDSv1 for this poll."""
        if self._aws_token is not None and time.monotonic() < self._aws_token_expiry:
            return self._aws_token
        self._aws_token = None
        url = urllib.parse.urljoin(self.url, AWS_TOKEN_PATH)
        hdr = {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
        try:
            status, body = self._get(url, hdr, method="PUT")
        except _PollError as e:
            log.debug("%s: no IMDSv2 token (%s); trying IMDSv1", self.source, e)
            return None
        token = body.decode("ascii", "replace").strip()
        if status != 200 or not _TOKEN_RE.fullmatch(token):  # (a proxy's HTML page, say)
            log.debug("%s: no IMDSv2 token (HTTP %d); trying IMDSv1", self.source, status)
            return None
        self._aws_token = token
        self._aws_token_expiry = time.monotonic() + AWS_TOKEN_TTL_S - 60
        return token

    def _check_aws(self) -> _Notice | None:
        token = self._token() if self.config.aws_imdsv2 else None
        try:
            status, body = self._get(self.url, {"X-aws-ec2-metadata-token": token} if token else {})
        except _PollError:
            self._aws_token = None  # whatever failed, the next poll asks for a new token
            raise
        if status == 404:
            return None  # no interruption scheduled
        if status == 401:
            self._aws_token = None  # expired or rejected: get a new one next poll
            raise _PollError(f"GET {self.url}: HTTP 401 (IMDSv2 token missing or rejected)")
        if status != 200:
            raise _PollError(f"GET {self.url}: HTTP {status}")
        try:
            doc = json.loads(body)
            action, when = str(doc["action"]), str(doc.get("time", ""))
        except (ValueError, TypeError, KeyError) as e:
            raise _PollError(
                f"GET {self.url}: not an instance-action document: {body[:200]!r}"
            ) from e
        try:
            grace: float | None = _seconds_until(datetime.fromisoformat(when))
        except ValueError:
            grace = None
        return _Notice(f"action={action} time={when}", grace)

    def _check_gcp(self) -> _Notice | None:
        hdr = {"Metadata-Flavor": "Google"}
        status, body = self._get(self.url, hdr)
        if status != 200:
            raise _PollError(f"GET {self.url}: HTTP {status}")
        if body.strip().upper() == b"TRUE":
            return _Notice("preempted=TRUE")
        if self.config.gcp_maintenance:
            url = urllib.parse.urljoin(self.url, GCP_MAINTENANCE_NAME)
            status, body = self._get(url, hdr)
            if status != 200:
                raise _PollError(f"GET {url}: HTTP {status}")
            event = body.decode("utf-8", "replace").strip()
            # MIGRATE_ON_HOST_MAINTENANCE: a live migration, the VM keeps running
            if event and event.upper() != "NONE" and not event.upper().startswith("MIGRATE"):
                return _Notice(f"maintenance-event={event}")
        return None

    def _check_azure(self) -> _Notice | None:
        status, body = self._get(self.url, {"Metadata": "true"})
        if status != 200:
            raise _PollError(f"GET {self.url}: HTTP {status}")
        try:
            events = json.loads(body).get("Events") or []
            if not isinstance(events, list):
                raise TypeError("Events is not a list")
        except (ValueError, TypeError, AttributeError) as e:
            raise _PollError(f"GET {self.url}: not a scheduled-events document: {e}") from e
        found: list[_Notice] = []
        for ev in events:
            if not isinstance(ev, dict) or ev.get("EventType") not in self._azure_types:
                continue
            vm = self.config.azure_vm_name
            if vm is not None and vm not in (ev.get("Resources") or []):
                continue  # an event for another VM of the same scale set / availability set
            not_before = str(ev.get("NotBefore") or "")
            try:
                grace: float | None = _seconds_until(email.utils.parsedate_to_datetime(not_before))
            except (TypeError, ValueError):
                grace = None
            found.append(
                _Notice(
                    f"{ev.get('EventType')} {ev.get('EventStatus', '')} NotBefore={not_before} "
                    f"EventId={ev.get('EventId', '')}",
                    grace,
                )
            )
        if not found:
            return None
        return min(found, key=lambda n: math.inf if n.grace_s is None else n.grace_s)

    def _check_custom(self) -> _Notice | None:
        status, body = self._get(self.url, {})
        if status in (204, 404):
            return None
        if status != 200:
            raise _PollError(f"GET {self.url}: HTTP {status}")
        text = body.decode("utf-8", "replace").strip()
        return _Notice(text[:500]) if text else None
