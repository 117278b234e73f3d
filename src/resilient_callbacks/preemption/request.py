"""A preemption request and where one comes from: the sources, their default grace periods.

Shared by the signal watcher (:mod:`.signals`) and the cloud metadata pollers (:mod:`.cloud`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from ..errors import ConfigError


class MetadataKind(StrEnum):
    AWS = "aws"  # EC2 spot instance-action (IMDSv2 token, falling back to v1)
    GCP = "gcp"  # GCE instance/preempted (and optionally maintenance-event)
    AZURE = "azure"  # Azure scheduled events
    CUSTOM = "custom"  # any URL: HTTP 200 with a non-empty body is a notice


# ----------------------------------------------------------------------------- defaults

DEFAULT_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1")

#: Seconds between a request and the hard kill (SIGKILL / power-off), per request source.
DEFAULT_GRACE_S: Mapping[str, float] = MappingProxyType(
    {
        "SIGTERM": 30.0,  # Kubernetes terminationGracePeriodSeconds; also Slurm's KillWait
        "SIGUSR1": 120.0,  # Slurm `--signal=USR1@120`: set this to your @N
        "SIGINT": 30.0,  # Ctrl-C: nobody kills us, but don't keep a user waiting forever
        "metadata:aws": 120.0,  # EC2 spot interruption notice: two minutes
        "metadata:gcp": 30.0,  # GCE preemption / Spot VM: 30 s ACPI soft-off
        "metadata:azure": 30.0,  # Azure Spot Preempt: at least 30 s (NotBefore when given)
    }
)


# ----------------------------------------------------------------------------- the request


@dataclass(frozen=True, kw_only=True)
class PreemptionRequest:
    """One request to stop: where it came from, when, and how long until the hard kill."""

    source: str  # "SIGTERM", "SIGUSR1", "SIGINT", "metadata:<kind>", "manual", ...
    wall_time: float  # time.time() when recorded
    monotonic: float  # time.monotonic() when recorded
    detail: str = ""
    grace_s: float | None = None  # seconds from `monotonic` to the hard kill; None: unknown
    signum: int | None = None  # the signal number, for a signal (exit code 128 + signum)

    def remaining_s(self, now: float | None = None) -> float | None:
        """Seconds left before the hard kill (>= 0), or None when the deadline is unknown."""
        if self.grace_s is None:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self.monotonic + self.grace_s - now)


def _check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name}={value!r}: must be a finite number of seconds {bound}")
    return float(value)
